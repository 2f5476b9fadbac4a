"""A one-line progress display on stderr, shown only once a run has lasted about a second."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int, *, enabled: bool = True, stream=None, delay: float = 1.0):
        self.total = max(1, total)
        self.done = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.delay = delay
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_line = 0.0
        self._width = 0
        self._text = ""

    def step(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        self._show()

    def note(self, text: str) -> None:
        self._text = text
        self._show()

    def _show(self) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.start < self.delay:
            return
        pct = 100 * self.done // self.total
        line = f"[{now - self.start:5.1f}s {pct:3d}%] {self._text}"
        if self.tty:
            pad = max(0, self._width - len(line))
            self.stream.write("\r" + line + " " * pad)
            self._width = len(line)
        elif now - self._last_line >= 2.0:  # a log file gets a line every couple of seconds at most
            self.stream.write(line + "\n")
            self._last_line = now
        else:
            return
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
