"""A dependency-free progress bar for long CLI runs (``kvcoord up``, ``kvcoord simulate``).

On a TTY it redraws one line in place (carriage return, at most ``redraw_hz`` times a second);
elsewhere (CI logs, pipes) it prints a plain line at every ``line_every`` fraction of the total
or when the phase changes, so logs stay short. Thread-safe: workload threads call ``advance``.
Writes only to its stream (stderr by default), never to stdout, so reports stay clean.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class Progress:
    """``done``/``total`` with a phase label; ``close()`` ends the line (idempotent)."""

    def __init__(self, total: int, *, stream: TextIO | None = None, width: int = 30,
                 redraw_hz: float = 10.0, line_every: float = 0.25) -> None:
        self.total = max(1, total)
        self.done = 0
        self.phase = ""
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._width = width
        self._min_interval = 1.0 / redraw_hz
        self._line_every = max(1, int(self.total * line_every))
        self._last_draw = 0.0
        self._last_line_at = 0
        self._last_line: tuple[int, str] | None = None
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False

    def set_phase(self, phase: str) -> None:
        """Name what is running now (``kv_aware: chats``); always shown at once."""
        with self._lock:
            self.phase = phase
            self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done = min(self.total, self.done + n)
            self._draw(force=self.done == self.total)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._draw(force=True)
            if self._tty:
                self._stream.write("\n")
                self._stream.flush()

    def render(self) -> str:
        """The line as drawn (no carriage return)."""
        filled = self._width * self.done // self.total
        bar = "#" * filled + "." * (self._width - filled)
        elapsed = time.monotonic() - self._started
        return (f"[{bar}] {self.done}/{self.total} {100 * self.done // self.total:3d}%  "
                f"{elapsed:5.1f}s  {self.phase}")

    def _draw(self, force: bool) -> None:
        if self._closed and not force:
            return
        now = time.monotonic()
        if self._tty:
            if not force and now - self._last_draw < self._min_interval:
                return
            # \x1b[K clears what a longer previous line left on the right.
            self._stream.write("\r" + self.render() + "\x1b[K")
        else:
            if not force and self.done - self._last_line_at < self._line_every:
                return
            if (self.done, self.phase) == self._last_line:
                return  # a forced redraw with nothing new: keep logs short
            self._last_line_at = self.done
            self._last_line = (self.done, self.phase)
            self._stream.write(self.render() + "\n")
        self._last_draw = now
        self._stream.flush()
