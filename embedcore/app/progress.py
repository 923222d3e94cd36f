"""A dependency-free progress bar: steps done, live loss and throughput, redrawn in place on a terminal.

On a terminal the bar is redrawn at most ``redraw`` times a second; elsewhere (a log file, CI) it prints a
plain line every ``every`` steps, so logs stay readable.
"""

from __future__ import annotations

import sys
import time

__all__ = ["ProgressBar"]


class ProgressBar:
    def __init__(self, total: int, label: str = "", stream=None, width: int = 28, every: int = 0,
                 redraw: float = 8.0):
        self.total, self.label, self.width = max(int(total), 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every or max(self.total // 10, 1)
        self.interval = 1.0 / redraw
        self.done, self.samples = 0, 0
        self.loss = None
        self.start = self.last_draw = time.perf_counter()

    def update(self, samples: int, loss: float, steps: int = 1) -> None:
        self.done += steps
        self.samples += samples
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss  # smoothed for display
        now = time.perf_counter()
        if self.tty and (now - self.last_draw >= self.interval or self.done >= self.total):
            self.last_draw = now
            self.stream.write("\r" + self.line())
            self.stream.flush()
        elif not self.tty and (self.done % self.every == 0 or self.done == self.total):
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def rate(self) -> float:
        return self.samples / max(time.perf_counter() - self.start, 1e-9)

    def line(self) -> str:
        filled = int(self.width * min(self.done / self.total, 1.0))
        bar = "#" * filled + "-" * (self.width - filled)
        loss = f"loss {self.loss:.4f}" if self.loss is not None else ""
        return (f"{self.label} [{bar}] {self.done}/{self.total} {loss}  {self.rate():,.0f} samples/s "
                f"{time.perf_counter() - self.start:5.1f}s")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
