"""A pytest plugin that counts the Numba compilations a test run makes (``-p tests.compile_counter``).

Each outermost compilation (a kernel with what it inlines and calls compiled for it) is one function and one
signature; the plugin writes, to the file named by ``EMBEDCORE_COUNT_COMPILES`` (else prints), how many distinct
ones there were, the seconds they took, and the costliest functions; under pytest-xdist the workers hand their
counts to the controller, which reports for the whole run. Subprocesses are not counted.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time

import pytest

from numba.core import event


class _Counter(event.Listener):
    def __init__(self):
        self.local = threading.local()
        self.seconds = collections.Counter()
        self.count = collections.Counter()

    def on_start(self, ev):
        stack = self.local.__dict__.setdefault("stack", [])
        stack.append(time.perf_counter())

    def on_end(self, ev):
        stack = self.local.__dict__.setdefault("stack", [])
        started = stack.pop()
        if not stack:
            dispatcher = ev.data["dispatcher"]
            func = getattr(dispatcher, "py_func", dispatcher)
            name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
            if name.split(".")[0].startswith("embedcore_generated_"):
                name = "<generated>." + name.split(".", 1)[1]
            self.count[name] += 1
            self.seconds[name] += time.perf_counter() - started


_COUNTER = _Counter()


def pytest_configure(config):
    event.register("numba:compile", _COUNTER)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """Under pytest-xdist, in the controller: add a finished worker's counts to this process's."""
    counts = getattr(node, "workeroutput", {}).get("compile_counts")
    if counts:
        for name, (n, seconds) in counts.items():
            _COUNTER.count[name] += n
            _COUNTER.seconds[name] += seconds


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """In an xdist worker: hand the counts to the controller (before the worker sends what it has)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["compile_counts"] = {name: (_COUNTER.count[name], _COUNTER.seconds[name])
                                          for name in _COUNTER.count}


def pytest_unconfigure(config):
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller reports for all
        return
    report = {"compilations": sum(_COUNTER.count.values()), "seconds": round(sum(_COUNTER.seconds.values()), 1),
              "functions": len(_COUNTER.count),
              "costliest": [(name, _COUNTER.count[name], round(s, 1)) for name, s in _COUNTER.seconds.most_common(25)]}
    path = os.environ.get("EMBEDCORE_COUNT_COMPILES")
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    else:
        print(json.dumps(report, indent=1))
