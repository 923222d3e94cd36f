"""`embedcore quickstart`: TensorFlow's two CustomOptimizer examples learn planted values; its argument errors."""

import subprocess
import sys

import pytest

from embedcore.app.cli import main
from embedcore.app.quickstart import run


def test_quickstart_learns_the_planted_values():
    lines = []
    result = run(steps=120, batch_size=128, log_every=60, out=lines.append)
    assert result["step"] == 120
    assert result["losses"][-1] < 0.1 * result["losses"][0]
    assert result["user_corr"] > 0.9 and result["item_corr"] > 0.9
    assert any("element by element" in line for line in lines)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_quickstart_learns_with_16_bit_tables(dtype):
    lines = []
    result = run(steps=120, batch_size=128, log_every=60, out=lines.append, weights_dtype=dtype, slot_dtype=dtype)
    assert result["losses"][-1] < 0.1 * result["losses"][0]
    assert result["user_corr"] > 0.9 and result["item_corr"] > 0.9
    assert f"rows {dtype}, slots {dtype}, rounding stochastic" in lines[0]


def test_quickstart_command_takes_the_storage_options(capsys):
    assert main(["quickstart", "--steps", "60", "--weights-dtype", "bfloat16", "--rounding", "nearest"]) == 0
    assert "rows bfloat16, slots float32, rounding to nearest" in capsys.readouterr().out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["quickstart", "--steps", "0"])
    assert exc.value.code == 2
    assert "--steps: must be >= 1" in capsys.readouterr().err


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "embedcore", "--help"], capture_output=True, text=True, check=True)
    assert all(command in out.stdout for command in ("demo", "train", "quickstart"))
