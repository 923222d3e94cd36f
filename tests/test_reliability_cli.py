"""`embedcore train` / `demo` and the readers under hostile configs and files (issue 24, items 11, 12, 14).

Every refusal is exactly one ``error:`` line naming the key (or file:line and column), exit status 2, no
traceback and no output folder; what cannot be allocated is refused before it is; an undefined AUC does not
lose the epoch. The CLI runs in-process (``main([...])``); two subprocess runs prove that nothing else
reaches stderr.
"""

import inspect
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embedcore.checkpoint.config_codec import constructor_parameters
from embedcore.app.cli import main
from embedcore.app.data import CsvClickLog, DataFormatError, MovieLens
from embedcore.app.metrics import BinaryMetrics
from embedcore.app.models import DLRM
from embedcore.app.models.layers import Linear
from embedcore import TableConfig
from embedcore.app.run_config import (DATA_SCHEMA, DATASETS, DEFAULTS, SCHEMA, STORAGE_DEFAULTS, STORAGE_SCHEMA,
                                      ConfigError, check, merge)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYNTHETIC = """[data]
kind = "synthetic"
n_train = 600
n_eval = 200
vocabulary_sizes = [20, 30]
n_dense = 2
"""
REST = """[embedding]
dim = 4
[model]
bottom = [4]
top = [4]
[train]
epochs = 1
batch_size = 128
"""


def csv_data(name):
    return f'[data]\nkind = "csv"\npath = "{name}"\n'


class Recorder:
    """A callable that must never be called by `train` (an optimizer path naming it is refused)."""

    calls = 0

    def __init__(self, *args, **kwargs):
        Recorder.calls += 1

    def __call__(self, *args, **kwargs):
        Recorder.calls += 1


RECORDER = Recorder.__new__(Recorder)

FILES = {
    "header.csv": "label,I1,C1\n",
    "weight.csv": "label,I1,C1\n1,2,3:1e39\n0,1,2\n",
    "dense.csv": "label,I1,C1\n1,2,3\n0,-1e39,2\n",
    "huge_id.csv": "label,I1,C1\n1,2,3\n0,1,100000000000000000\n",
    "ok.csv": "label,I1,C1\n" + "".join(f"{i % 2},{i},{i % 5}\n" for i in range(300)),
    "a_file": "not a folder",
}

# (config text, what the one error line must contain). Keys are named as "section.key".
BAD_CONFIGS = {
    "section not a table": ("train = 5\n" + SYNTHETIC, "[train] must be a table"),
    "data not a table": ('data = "synthetic"\n', "[data] must be a table"),
    "tables not a table": (SYNTHETIC + "[embedding]\ntables = 5\n", "embedding.tables"),
    "dense lr a string": (SYNTHETIC + REST.replace("top = [4]", 'top = [4]\ndense_learning_rate = "x"'),
                          "model.dense_learning_rate"),
    "dense lr negative": (SYNTHETIC + REST.replace("top = [4]", "top = [4]\ndense_learning_rate = -1"),
                          "model.dense_learning_rate"),
    "dense lr inf": (SYNTHETIC + REST.replace("top = [4]", "top = [4]\ndense_learning_rate = inf"),
                     "model.dense_learning_rate"),
    "data.path an int": ('[data]\nkind = "csv"\npath = 5\n' + REST, "data.path"),
    "csv without a path": ('[data]\nkind = "csv"\n' + REST, "[data] kind 'csv' needs the key(s) ['path']"),
    "movielens without a path": ('[data]\nkind = "movielens"\n' + REST,
                                 "[data] kind 'movielens' needs the key(s) ['path']"),
    "n_eval 0": (SYNTHETIC.replace("n_eval = 200", "n_eval = 0") + REST, "data.n_eval"),
    "click_rate 1": (SYNTHETIC + "click_rate = 1.0\n" + REST, "data.click_rate"),
    "vocabulary of 0": (SYNTHETIC.replace("[20, 30]", "[20, 0]") + REST, "data.vocabulary_sizes[1]"),
    "learning rate NaN": (SYNTHETIC + REST.replace("dim = 4", "dim = 4\nlearning_rate = nan"),
                          "embedding.learning_rate"),
    "learning rate 1e39": (SYNTHETIC + REST.replace("dim = 4", "dim = 4\nlearning_rate = 1e39"),
                           "embedding.learning_rate"),
    "accumulator NaN": (SYNTHETIC + REST.replace("dim = 4", "dim = 4\ninitial_accumulator_value = nan"),
                        "embedding.initial_accumulator_value"),
    "per-table lr -1": (SYNTHETIC + REST + '[embedding.tables.C1]\noptimizer = "sgd"\nlearning_rate = -1\n',
                        "embedding.tables.C1.learning_rate"),
    "epochs 1.5": (SYNTHETIC + REST.replace("epochs = 1", "epochs = 1.5"), "train.epochs"),
    "batch_size true": (SYNTHETIC + REST.replace("batch_size = 128", "batch_size = true"), "train.batch_size"),
    "seed negative": (SYNTHETIC + REST + "seed = -1\n", "train.seed"),
    "output is a file": (SYNTHETIC + REST + 'output = "{tmp}/a_file"\n', "train.output"),
    "output under a file": (SYNTHETIC + REST + 'output = "{tmp}/a_file/out"\n', "train.output"),
    "optimizer a builtin": (SYNTHETIC + REST.replace("dim = 4", 'dim = 4\noptimizer = "os:getcwd"'),
                            "embedding.optimizer 'os:getcwd'"),
    "optimizer a class": (SYNTHETIC + REST.replace(
        "dim = 4", 'dim = 4\noptimizer = "tests.test_reliability_cli:Recorder"'), "embedding.optimizer"),
    "optimizer a callable object": (SYNTHETIC + REST.replace(
        "dim = 4", 'dim = 4\noptimizer = "tests.test_reliability_cli:RECORDER"'), "embedding.optimizer"),
    "csv with only a header": (csv_data("header.csv") + REST, "header.csv: no data rows"),
    "csv weight 1e39": (csv_data("weight.csv") + REST, "weight.csv:2: column 'C1'"),
    "csv dense -1e39": (csv_data("dense.csv") + REST, "dense.csv:3: column 'I1'"),
    "csv eval_fraction NaN": (csv_data("ok.csv") + "eval_fraction = nan\n" + REST, "data.eval_fraction"),
    "csv delimiter of two": (csv_data("ok.csv") + 'delimiter = ",,"\n' + REST, "data.delimiter"),
    # Item 12: sizes refused before anything is allocated, naming what and the bytes.
    "dim 10^9": (SYNTHETIC + REST.replace("dim = 4", "dim = 1000000000"), "embedding.dim = 1000000000"),
    "a layer of 10^9": (SYNTHETIC + REST.replace("top = [4]", "top = [1000000000]"), "top layer 0"),
    "vocabulary 2^31-1": (SYNTHETIC.replace("[20, 30]", "[2147483647, 30]") + REST, "feature 'C1'"),
    "vocabulary 2^31": (SYNTHETIC.replace("[20, 30]", "[2147483648, 30]") + REST, "data.vocabulary_sizes[0]"),
    "hash_buckets 2^32": (csv_data("ok.csv") + "hash_buckets = 4294967296\n" + REST, "table 'C1', 4,294,967,296 rows"),
    "hash_buckets 2^32+1": (csv_data("ok.csv") + "hash_buckets = 4294967297\n" + REST, "data.hash_buckets"),
    "csv id 10^17": (csv_data("huge_id.csv") + REST, "huge_id.csv:3: column 'C1': its largest id 100000000000000000"),
    # Issue 28: how tables are stored, for every table and per table.
    "weights_dtype int8": (SYNTHETIC + REST.replace("dim = 4", 'dim = 4\nweights_dtype = "int8"'),
                           "embedding.weights_dtype must be one of ['bfloat16', 'float16', 'float32'], got 'int8'"),
    "weights_dtype a number": (SYNTHETIC + REST.replace("dim = 4", "dim = 4\nweights_dtype = 16"),
                               "embedding.weights_dtype"),
    "weights_dtype of another case": (SYNTHETIC + REST.replace("dim = 4", 'dim = 4\nweights_dtype = "BFloat16"'),
                                      "embedding.weights_dtype"),
    "slot_dtype half": (SYNTHETIC + REST.replace("dim = 4", 'dim = 4\nslot_dtype = "half"'), "embedding.slot_dtype"),
    "stochastic_rounding a string": (SYNTHETIC + REST.replace("dim = 4", 'dim = 4\nstochastic_rounding = "yes"'),
                                     "embedding.stochastic_rounding must be true or false"),
    "stochastic_rounding 1": (SYNTHETIC + REST.replace("dim = 4", "dim = 4\nstochastic_rounding = 1"),
                              "embedding.stochastic_rounding"),
    "per-table weights_dtype float64": (SYNTHETIC + REST + '[embedding.tables.C1]\nweights_dtype = "float64"\n',
                                        "embedding.tables.C1.weights_dtype"),
    "per-table slot_dtype a list": (SYNTHETIC + REST + '[embedding.tables.C2]\nslot_dtype = ["bfloat16"]\n',
                                    "embedding.tables.C2.slot_dtype"),
    "per-table rounding a string": (SYNTHETIC + REST + '[embedding.tables.C1]\noptimizer = "sgd"\n'
                                    'stochastic_rounding = "false"\n', "embedding.tables.C1.stochastic_rounding"),
    "per-table storage and an lr without an optimizer": (
        SYNTHETIC + REST + '[embedding.tables.C1]\nweights_dtype = "bfloat16"\nlearning_rate = 0.1\n',
        "[embedding.tables.C1] needs an optimizer to take ['learning_rate']"),
    "per-table misspelt storage key": (SYNTHETIC + REST + '[embedding.tables.C1]\nweight_dtype = "bfloat16"\n',
                                       "['weight_dtype']"),
    "per-table storage of a table the data lacks": (SYNTHETIC + REST + '[embedding.tables.C9]\n'
                                                    'weights_dtype = "bfloat16"\n', "C9"),
    "16-bit tables too big": (csv_data("ok.csv") + "hash_buckets = 1000000000\n" + REST.replace(
        "dim = 4", 'dim = 4\nweights_dtype = "bfloat16"\nslot_dtype = "bfloat16"'),
        "dim = 4 bfloat16 values a row, with their optimizer slots; largest: table 'C1', 1,000,000,000 rows "
        "from hash_buckets of column 'C1', 16,000,000,000 bytes"),
}


def write_files(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)


def with_output(text, tmp_path):
    """``text`` with ``train.output`` set to ``tmp_path/out`` unless it says where (or has no [train])."""
    if "output =" in text or "train = " in text:
        return text.replace("{tmp}", str(tmp_path))
    out = f'output = "{tmp_path / "out"}"\n'
    return text.replace("[train]\n", "[train]\n" + out) if "[train]" in text else text + "[train]\n" + out


def train(tmp_path, capsys, text, *extra):
    """Run `embedcore train` in-process on ``text``; returns (exit status, stdout, stderr lines)."""
    write_files(tmp_path)
    config = tmp_path / "run.toml"
    config.write_text(with_output(text, tmp_path))
    code = main(["train", "--config", str(config), *extra])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_every_bad_config_is_one_error_line_naming_the_key(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(1 << 30))  # no huge case may ever allocate, anywhere
    Recorder.calls = 0
    text, key = BAD_CONFIGS[name]
    started = time.perf_counter()
    code, out, err = train(tmp_path, capsys, text)
    assert code == 2
    assert len(err) == 1 and err[0].startswith("embedcore train: error: "), err
    assert key in err[0], err[0]
    assert len(err[0]) < 1000
    assert not (tmp_path / "out").exists()         # nothing written, not even the folder
    assert Recorder.calls == 0                       # an optimizer path is never called to find out
    assert time.perf_counter() - started < 30


def test_sizes_are_refused_in_milliseconds_without_allocating(tmp_path, capsys):
    """Without a memory cap: the real machine's memory decides, and the refusal costs no allocation."""
    import resource
    huge_layers = SYNTHETIC + REST.replace("top = [4]", "top = [2147483647, 2147483647]")
    for text in (BAD_CONFIGS["csv id 10^17"][0], huge_layers):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        code, _, err = train(tmp_path, capsys, text)
        assert code == 2 and "nothing was allocated" in err[0] and "bytes" in err[0], err
        assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024  # KiB: < 200 MB


def test_a_derived_vocabulary_too_big_for_the_tables_names_its_line(tmp_path, capsys, monkeypatch):
    """An id that fits the reader's bound but whose table (dim x rows + slots) does not names the table,
    the id and its file:line:column."""
    monkeypatch.setenv("EMBEDCORE_MEMORY_LIMIT", str(64 << 20))
    (tmp_path / "big.csv").write_text("label,I1,C1\n1,2,3\n0,1,10000000\n")
    code, _, err = train(tmp_path, capsys, csv_data("big.csv") + REST)
    assert code == 2 and len(err) == 1
    assert "table 'C1', 10,000,001 rows from its largest id 10000000 at" in err[0]
    assert "big.csv:3, column 'C1'" in err[0]


def test_garbage_lines_give_bounded_messages(tmp_path, capsys):
    garbage = "x" * 10_000_000
    for text, column in ((f"label,I1,C1\n1,2,3\n0,1,{garbage}\n", "C1"), (f"label,I1,C1\n1,{garbage},3\n", "I1"),
                         (f"label,I1,C1\n{garbage},1,3\n", "label")):
        (tmp_path / "g.csv").write_text(text)
        code, _, err = train(tmp_path, capsys, csv_data("g.csv") + REST)
        assert code == 2 and len(err) == 1
        assert f"g.csv:{text.count(chr(10))}: column '{column}'" in err[0]
        assert len(err[0]) < 500 and "10,000,000 characters" in err[0]
    (tmp_path / "h.csv").write_text(f"label,I1,{garbage}\n1,2,3\n")
    code, _, err = train(tmp_path, capsys, csv_data("h.csv") + REST)
    assert code == 2 and len(err) == 1 and len(err[0]) < 600 and "h.csv:1" in err[0]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cell=st.text(st.characters(blacklist_characters=",\n\r", blacklist_categories=["Cs"]), min_size=1,
                    max_size=3000), column=st.sampled_from(["I1", "C1", "label"]))
def test_any_bad_cell_is_quoted_within_bounds(tmp_path, cell, column):
    cells = {"label": "1", "I1": "2", "C1": "3"}
    cells[column] = cell
    path = tmp_path / "cell.csv"
    path.write_text("label,I1,C1\n" + ",".join(cells.values()) + "\n", encoding="utf-8")
    try:
        CsvClickLog(path)
    except DataFormatError as e:
        assert str(e).startswith(f"{path}:2: column '{column}': ")
        assert len(str(e)) <= len(str(path)) + 400
    except ValueError as e:  # pragma: no cover - a refusal must always be a DataFormatError
        pytest.fail(f"not a DataFormatError: {e!r}")


def test_hostile_files_are_refused_without_blocking_or_reading_without_end(tmp_path, capsys):
    fifo = tmp_path / "fifo.csv"
    os.mkfifo(fifo)
    code, _, err = train(tmp_path, capsys, csv_data("fifo.csv") + REST)
    assert code == 2 and "not a regular file" in err[0]
    code, _, err = train(tmp_path, capsys, csv_data("/dev/zero") + REST)
    assert code == 2 and "not a regular file" in err[0]
    with pytest.raises(DataFormatError, match="not a regular file"):
        MovieLens(fifo)
    os.mkfifo(tmp_path / "fifo.toml")
    assert main(["train", "--config", str(tmp_path / "fifo.toml")]) == 2
    assert "not a regular file" in capsys.readouterr().err
    os.symlink("/dev/zero", tmp_path / "zero.json")
    assert main(["train", "--config", str(tmp_path / "zero.json")]) == 2
    assert "not a regular file" in capsys.readouterr().err
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert main(["train", "--config", str(tmp_path / "deep.json")]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_movielens_messages_are_bounded(tmp_path):
    (tmp_path / "ratings.dat").write_text("1::2::3::4\n1::2::" + "x" * 1_000_000 + "::4\n")
    with pytest.raises(DataFormatError, match="ratings.dat:2") as info:
        MovieLens(tmp_path / "ratings.dat")
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("data", ["one class", "no eval split"])
def test_an_undefined_auc_keeps_training_and_writes_everything(tmp_path, capsys, data):
    (tmp_path / "clicks.csv").write_text("label,I1,C1\n" + "".join(f"1,{i % 7},{i % 5}\n" for i in range(300)))
    text = csv_data("clicks.csv") + ("eval_fraction = 0.0\n" if data == "no eval split" else "") + \
        REST.replace("epochs = 1", "epochs = 2") + "eval_every = 2\n"
    code, out, err = train(tmp_path, capsys, text)
    assert code == 0, err
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text(),
                         parse_constant=lambda c: pytest.fail(f"metrics.json holds {c}: not strict JSON"))
    assert len(metrics["epochs"]) == 2 and metrics["steps"] == 2 * math.ceil(metrics["dataset"]["train_samples"] / 128)
    assert metrics["final"]["auc"] is None and all(e["auc"] is None for e in metrics["evaluations"])
    assert (metrics["final"]["log_loss"] is None) == (data == "no eval split")
    assert (tmp_path / "out" / "checkpoint" / "CURRENT").exists()
    assert out.count("AUC undefined") == 2


def test_genuine_bugs_keep_their_traceback(tmp_path, capsys, monkeypatch):
    """Only embedcore's error classes become error lines: a plain ValueError or KeyError from a bug in the
    training loop propagates with its traceback."""
    import embedcore.app.trainer as trainer

    def broken(logits, labels):
        raise ValueError("a bug, not a user error")

    monkeypatch.setattr(trainer, "bce_with_logits", broken)
    with pytest.raises(ValueError, match="a bug"):
        train(tmp_path, capsys, SYNTHETIC + REST)
    monkeypatch.setattr(trainer, "run", lambda *a, **k: {}["missing"])
    with pytest.raises(KeyError):
        train(tmp_path, capsys, SYNTHETIC + REST)


def test_an_interrupt_is_one_line_and_status_130(tmp_path, capsys, monkeypatch):
    import embedcore.app.trainer as trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "run", interrupted)
    code, _, err = train(tmp_path, capsys, SYNTHETIC + REST)
    assert code == 130 and err == ["embedcore train: interrupted"]


def test_a_multi_line_message_is_one_line(tmp_path, capsys, monkeypatch):
    import embedcore.app.trainer as trainer
    from embedcore.compiler import RowFunctionError

    def fails(*args, **kwargs):
        raise RowFunctionError("cannot compile\n  line 2 of the cause\n" + "y" * 10_000)

    monkeypatch.setattr(trainer, "run", fails)
    code, _, err = train(tmp_path, capsys, SYNTHETIC + REST)
    assert code == 2 and len(err) == 1 and "cannot compile / line 2 of the cause" in err[0]
    assert len(err[0]) < 2100


@pytest.mark.parametrize("name", ["section not a table", "csv id 10^17"])
def test_no_traceback_reaches_stderr_of_the_process(tmp_path, name):
    write_files(tmp_path)
    (tmp_path / "run.toml").write_text(with_output(BAD_CONFIGS[name][0], tmp_path))
    proc = subprocess.run([sys.executable, "-m", "embedcore", "train", "--config", str(tmp_path / "run.toml")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("embedcore train: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------------------
# The schema itself

def test_the_schema_names_every_key_of_every_section_and_reader():
    for kind, cls in DATASETS.items():
        assert set(DATA_SCHEMA[kind]) == set(constructor_parameters(cls)) - {"self"}, kind
    for section in ("model", "train"):
        assert set(SCHEMA[section]) == set(DEFAULTS[section])
    storage = {name for name, p in inspect.signature(TableConfig).parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert set(STORAGE_SCHEMA) == set(STORAGE_DEFAULTS) == storage
    defaults = inspect.signature(TableConfig).parameters
    assert STORAGE_DEFAULTS == {k: defaults[k].default for k in storage}


VALUES = (st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=True, allow_infinity=True)
          | st.text(max_size=5) | st.lists(st.integers(-3, 10 ** 12) | st.floats(), max_size=3)
          | st.dictionaries(st.text(max_size=3), st.integers(-3, 3), max_size=2))
KEYS = ([("model", k) for k in DEFAULTS["model"]] + [("train", k) for k in DEFAULTS["train"] if k != "output"]
        + [("embedding", "dim"), ("embedding", "learning_rate"), ("embedding", "initial_accumulator_value")]
        + [("embedding", k) for k in STORAGE_SCHEMA]
        + [("data", k) for k in DATA_SCHEMA["synthetic"]])


@settings(max_examples=300, deadline=None)
@given(key=st.sampled_from(KEYS), value=VALUES)
def test_any_value_of_any_key_is_accepted_or_refused_naming_that_key(key, value):
    section, name = key
    try:
        config = merge(DEFAULTS, {section: {name: value}})
        check(config)
    except ConfigError as e:
        assert f"{section}.{name}" in str(e) or f"[{section}.{name}]" in str(e), str(e)
        assert len(str(e)) < 600
        return
    if isinstance(value, float):
        assert math.isfinite(value) and abs(value) <= float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------------------
# The pieces the CLI relies on

def test_dense_layers_too_big_are_refused_before_allocating():
    with pytest.raises(ValueError, match=r"largest: top layer 0, 7 x 1,000,000,000\).*bytes"):
        DLRM(2, ["a", "b"], 4, (4,), (10 ** 9,))
    with pytest.raises(ValueError, match=r"Linear layer 100,000 x 1,000,000 .*nothing was allocated"):
        Linear(100_000, 1_000_000)


def test_binary_metrics_can_report_an_undefined_auc():
    m = BinaryMetrics()
    empty = m.result(allow_undefined=True)
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("log_loss", "auc", "click_rate"))
    m.update([1, 1], [0.2, 0.3])
    result = m.result(allow_undefined=True)
    assert math.isnan(result["auc"]) and result["n"] == 2 and result["click_rate"] == 1.0
    assert result["log_loss"] == pytest.approx(-np.mean(np.log([0.2, 0.3])))
    with pytest.raises(ValueError, match="only one class"):
        m.result()


def test_csv_values_beyond_float32_are_refused_and_its_maximum_is_read(tmp_path):
    path = tmp_path / "f.csv"
    path.write_text("label,I1,C1\n1,3.4028234e38,3:3.4028234e38\n0,-3.4028234e38,2\n")
    ds = CsvClickLog(path, eval_fraction=0.0)
    batch = next(ds.batches(10))
    assert np.all(np.isfinite(batch.dense)) and np.isfinite(batch.weights["C1"].values).all()
    for text, column in (("1,3.5e38,3\n", "I1"), ("1,2,3:-3.5e38\n", "C1")):
        path.write_text("label,I1,C1\n" + text)
        with pytest.raises(DataFormatError, match=f"f.csv:2: column '{column}'.*float32's range"):
            CsvClickLog(path)
