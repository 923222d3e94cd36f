"""Say on stderr when embedcore is compiling kernels, wherever it happens (building an engine, the first
lookup, the first update of a new gradient format): a first run on a new machine compiles for seconds, and
a silent wait looks like a hang.

Numba announces every compilation (``numba.core.event``); :func:`watch` registers a listener that follows
the compilations of embedcore's kernels (its modules' functions and the kernels it generates). Once they
have gone on for ``after`` seconds it writes one line, then one every ``every`` seconds while they go on,
and a last line with the time they took once none has run for ``quiet`` seconds. Compilations of other
code (a user's own ``numba.njit`` functions) are not reported, nor those nested in a reported one.
``EMBEDCORE_PROGRESS=0`` silences it.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from numba.core import event

__all__ = ["watch", "Reporter"]

_OWN_MODULES = ("embedcore", "embedcore_generated_")


def _silenced() -> bool:
    return os.environ.get("EMBEDCORE_PROGRESS", "1").strip().lower() in ("0", "off", "no", "false")


def _is_own(data) -> bool:
    dispatcher = data.get("dispatcher") if isinstance(data, dict) else None
    module = getattr(getattr(dispatcher, "py_func", None), "__module__", None) or ""
    return module.startswith(_OWN_MODULES)


class Reporter(event.Listener):
    """The listener: reports embedcore's compilations on ``stream`` (stderr by default) as the module says."""

    def __init__(self, after: float = 1.0, every: float = 5.0, quiet: float = 0.5, stream=None):
        self.after, self.every, self.quiet, self._stream = after, every, quiet, stream
        self._lock = threading.Lock()
        self._depth = threading.local()  # per thread: compilations open, and whether the outer one is ours
        self._running = 0                # our outermost compilations in progress, all threads
        self._started = self._last_end = 0.0
        self._thread = None

    @property
    def stream(self):
        return self._stream or sys.stderr

    def on_start(self, ev):
        stack = self._depth.__dict__.setdefault("stack", [])
        ours = not stack and _is_own(ev.data) and not _silenced()
        stack.append(ours)
        if ours:
            with self._lock:
                self._running += 1
                if self._thread is None:
                    self._started = time.monotonic()
                    self._thread = threading.Thread(target=self._report, name="embedcore-compile-progress",
                                                    daemon=True)
                    self._thread.start()

    def on_end(self, ev):
        stack = self._depth.__dict__.setdefault("stack", [])
        if stack and stack.pop():
            with self._lock:
                self._running -= 1
                self._last_end = time.monotonic()

    def _write(self, text):
        try:
            self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream: nothing to say it on
            pass

    def _report(self):
        shown = False
        next_line = self._started + self.after
        while True:
            time.sleep(min(0.05, self.quiet / 4))
            now = time.monotonic()
            with self._lock:
                idle = self._running == 0 and now - self._last_end >= self.quiet
                if idle:
                    self._thread = None
                    elapsed = self._last_end - self._started
            if idle:
                if shown:
                    self._write(f"embedcore: kernels ready ({elapsed:.1f} s of compiling)")
                return
            if now >= next_line:
                if not shown:
                    self._write("embedcore: compiling kernels with Numba (once per machine and kernel: later runs load "
                                "them from the caches, $EMBEDCORE_CACHE_DIR or ~/.cache/embedcore and __pycache__)...")
                    shown = True
                else:
                    self._write(f"embedcore: still compiling, {now - self._started:.0f} s")
                next_line = now + self.every


_REPORTER: Reporter | None = None


def watch() -> Reporter:
    """Register the process's reporter (once; later calls return it)."""
    global _REPORTER
    if _REPORTER is None:
        _REPORTER = Reporter()
        event.register("numba:compile", _REPORTER)
    return _REPORTER
