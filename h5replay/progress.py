"""Progress of long commands (export, compact, import, the demo) on a terminal: done of total,
rate and time left, redrawn in place; silent when the stream is not a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress on stderr with rate and time left, redrawn in place at most 10 times a second on
    a terminal; silent otherwise (a log or a pipe gets only the command's result)."""

    def __init__(self, label: str, unit: str = "rows", stream: TextIO | None = None) -> None:
        self.label, self.unit = label, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self.drawn = 0.0

    def line(self, done: int, total: int, now: float) -> str:
        """What is shown for `done` of `total` at `now` (time.monotonic())."""
        fraction = done / total if total else 1.0
        elapsed = max(now - self.started, 1e-9)
        rate = done / elapsed
        left = (total - done) / rate if rate > 0 else float("inf")
        eta = "done" if done >= total else ("?" if left == float("inf") else f"{_duration(left)} left")
        bar = "#" * int(fraction * 30)
        return (f"{self.label} [{bar:<30}] {fraction:4.0%} {done:,}/{total:,} {self.unit}, "
                f"{rate:,.0f} {self.unit}/s, {eta} ({_duration(elapsed)})")

    def __call__(self, done: int, total: int) -> None:
        if not self.tty:
            return
        now = time.monotonic()
        finished = done >= total
        if not finished and now - self.drawn < 0.1:
            return
        self.drawn = now
        print(f"\r\x1b[K{self.line(done, total, now)}", end="\n" if finished else "", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
