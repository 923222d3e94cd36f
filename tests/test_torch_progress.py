"""The first build compiles kernels for ~10 s: EmbeddingModule says so on stderr while it does."""

import io
import time

import pytest

pytest.importorskip("torch", reason="needs the torch extra: pip install torch==2.13.0 'embedcore[torch]'")

from embedcore.torch import _compile_progress  # noqa: E402


def test_a_long_build_reports_progress_until_it_ends():
    out = io.StringIO()
    with _compile_progress(after=0.05, every=0.1, stream=out):
        time.sleep(0.38)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("embedcore: compiling the tables' kernels")
    assert 2 <= sum(line.startswith("embedcore: still compiling") for line in lines) <= 4
    assert lines[-1].startswith("embedcore: kernels ready in 0.")


def test_a_quick_build_says_nothing_and_the_environment_can_silence_it(monkeypatch):
    out = io.StringIO()
    with _compile_progress(after=0.5, stream=out):
        pass
    assert out.getvalue() == ""
    monkeypatch.setenv("EMBEDCORE_PROGRESS", "0")
    with _compile_progress(after=0.0, stream=out):
        time.sleep(0.05)
    assert out.getvalue() == ""
