"""Peak RSS of this process while a block runs, sampled on a thread every few ms."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import psutil


class PeakRSS:
    """`with PeakRSS() as m: work()`, then `m.baseline` (RSS on entry), `m.peak`, `m.seconds`."""

    def __init__(self, every_s: float = 0.002) -> None:
        self._every_s = every_s
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = self.peak = 0
        self.seconds = 0.0

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._every_s)

    def __enter__(self) -> PeakRSS:
        self.baseline = self.peak = self._proc.memory_info().rss
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.seconds = time.monotonic() - self._started
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)
