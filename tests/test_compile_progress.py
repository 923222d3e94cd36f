"""Compiling kernels says so on stderr, wherever it happens: the first build, lookup or update."""

import io
import time

import numba
import numpy as np
import pytest

from embedcore.compile_progress import Reporter
from numba.core import event


@pytest.fixture(autouse=True)
def progress_on(monkeypatch):
    monkeypatch.setenv("EMBEDCORE_PROGRESS", "1")  # the session silences it (tests/conftest.py)


def _jitted_in(module_name, source="def f(x):\n    return x + 1\n"):
    namespace = {"__name__": module_name}
    exec(compile(source, f"<{module_name}>", "exec"), namespace)
    return numba.njit(namespace["f"])


def _report(after, quiet=0.1, every=5.0, work=None):
    out = io.StringIO()

    reporter = Reporter(after=after, every=every, quiet=quiet, stream=out)
    with event.install_listener("numba:compile", reporter):
        work()
    time.sleep(quiet + 0.3)  # the last line comes once compilations have been quiet for a while
    return out.getvalue().splitlines()


def test_an_embedcore_kernel_compiling_is_reported_until_it_ends():
    kernel = _jitted_in("embedcore_generated_progress_test")
    lines = _report(after=0.0, work=lambda: kernel(np.float32(1.0)))
    assert lines[0].startswith("embedcore: compiling kernels with Numba")
    assert lines[-1].startswith("embedcore: kernels ready (") and lines[-1].endswith(" s of compiling)")


def test_a_long_run_of_compilations_gives_still_compiling_lines_and_one_ready_line():
    kernels = [_jitted_in(f"embedcore_generated_progress_many_{k}") for k in range(3)]

    def work():
        for k in kernels:
            k(np.int64(3))
            time.sleep(0.15)
    lines = _report(after=0.0, every=0.1, quiet=0.3, work=work)
    assert lines[0].startswith("embedcore: compiling kernels with Numba")
    assert sum(line.startswith("embedcore: still compiling") for line in lines) >= 2
    assert sum(line.startswith("embedcore: kernels ready") for line in lines) == 1


def test_quick_compiles_other_code_and_the_environment_say_nothing(monkeypatch):
    quick = _jitted_in("embedcore_generated_progress_quick")
    assert _report(after=30.0, work=lambda: quick(np.int32(1))) == []  # ended before `after`
    users = _jitted_in("my_model_code")
    assert _report(after=0.0, work=lambda: users(np.int16(1))) == []   # not embedcore's
    monkeypatch.setenv("EMBEDCORE_PROGRESS", "0")
    silenced = _jitted_in("embedcore_generated_progress_silenced")
    assert _report(after=0.0, work=lambda: silenced(np.int8(1))) == []
