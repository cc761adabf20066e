"""Peak RSS and peak anonymous RSS of this process while a block runs, for the load checks
(tests/lazy/resume_zero.py under bench/gpu_resume.sh and tests/lazy/test_resume.py;
bench/_cuda_load.py)."""

import gc
import threading
import time

import psutil


class RSSSampler:
    """Peak RSS and peak anonymous RSS (RSS less file-backed and shared pages) of this
    process while the block runs, sampled every millisecond."""

    def __init__(self) -> None:
        self.proc = psutil.Process()
        self.stop = threading.Event()
        self.peak_rss = self.peak_anon = 0

    def sample(self) -> None:
        info = self.proc.memory_info()
        self.peak_rss = max(self.peak_rss, info.rss)
        self.peak_anon = max(self.peak_anon, info.rss - info.shared)

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(0.001)

    def __enter__(self) -> "RSSSampler":
        gc.collect()
        info = self.proc.memory_info()
        self.base_rss, self.base_anon = info.rss, info.rss - info.shared
        self.peak_rss, self.peak_anon = self.base_rss, self.base_anon
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.started = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.monotonic() - self.started
        self.stop.set()
        self.thread.join()
        self.sample()
