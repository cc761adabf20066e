"""Progress on long work: a one-line terminal bar with bytes, throughput and time left.

The engine reports bytes through `Progress.advance`; the CLI picks `TerminalProgress` on a
terminal and `NullProgress` otherwise (or with `-q`). Safe to call from several threads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Protocol, TextIO

from zerosafe.units import format_bytes

__all__ = ["NullProgress", "Progress", "TerminalProgress"]


class Progress(Protocol):
    def start(self, label: str, total_bytes: int) -> None: ...

    def advance(self, num_bytes: int) -> None: ...

    def finish(self) -> None: ...


class NullProgress:
    def start(self, label: str, total_bytes: int) -> None:
        pass

    def advance(self, num_bytes: int) -> None:
        pass

    def finish(self) -> None:
        pass


class TerminalProgress:
    """Redraws one line on `stream` at most `refresh_hz` times a second."""

    def __init__(self, stream: TextIO | None = None, refresh_hz: float = 8.0) -> None:
        self._stream = stream or sys.stderr
        self._interval = 1.0 / refresh_hz
        self._lock = threading.Lock()
        self._label = ""
        self._total = 0
        self._done = 0
        self._started = 0.0
        self._last_draw = 0.0

    def start(self, label: str, total_bytes: int) -> None:
        with self._lock:
            self._label, self._total, self._done = label, total_bytes, 0
            self._started = time.monotonic()
            self._draw(force=True)

    def advance(self, num_bytes: int) -> None:
        with self._lock:
            self._done += num_bytes
            self._draw()

    def finish(self) -> None:
        with self._lock:
            self._draw(force=True)
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_draw < self._interval:
            return
        self._last_draw = now
        elapsed = max(now - self._started, 1e-9)
        rate = self._done / elapsed
        frac = self._done / self._total if self._total else 1.0
        width = 24
        filled = int(width * min(frac, 1.0))
        eta = (self._total - self._done) / rate if rate > 0 and self._total else 0.0
        line = (
            f"\r{self._label:<8} [{'#' * filled}{'.' * (width - filled)}] {frac * 100:5.1f}% "
            f"{format_bytes(self._done)}/{format_bytes(self._total)} {format_bytes(rate)}/s "
            f"ETA {int(eta) // 60}:{int(eta) % 60:02d}"
        )
        self._stream.write(line)
        self._stream.flush()
