"""A measured command run as a user's first command, shared by `bench/run.py` and
`bench/run_hf.py`: its environment (a new, empty `PREFECT_HOME`, no `PREFECT_API_URL`, the
measured checkout first on `PYTHONPATH`), what is stopped after it, and its `--json` summary.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import time
from typing import Any

__all__ = ["command_env", "json_tail", "stop_leftovers", "sync_tree"]


def command_env(*, src: str, repo: str, prefect_home: str | None = None) -> dict[str, str]:
    """The environment of a measured command importing zerosafe from the checkout `src`
    (bench code from `repo`); `prefect_home`: a new, empty `PREFECT_HOME`."""
    env = dict(os.environ)
    if prefect_home is not None:
        env["PREFECT_HOME"] = prefect_home
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([src, repo, env.get("PYTHONPATH", "")]))
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.pop("PREFECT_API_URL", None)  # the CLI's embedded mode, as a user runs it
    return env


def json_tail(text: str) -> dict[str, Any] | None:
    """The JSON object a `--json` command printed (from its first line that opens one)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("{"):
            try:
                return dict(json.loads("\n".join(lines[i:])))
            except ValueError:
                continue
    return None


def sync_tree(out: str) -> float:
    """fsync every file under `out` (for tools that do not); returns the seconds it took."""
    t = time.perf_counter()
    for root, _, files in os.walk(out):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def stop_leftovers(prefect_home: str) -> None:
    """After a measured command: stop what a checkout from before 2026-11-26 left running on
    that `PREFECT_HOME` (its local server and warm process), so the next run starts from
    nothing too; then remove the folder."""
    marker = f"PREFECT_HOME={prefect_home}".encode()
    for environ in glob.glob("/proc/[0-9]*/environ"):
        if marker + b"\0" in _read(environ) + b"\0":
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(environ.split("/")[2]), signal.SIGKILL)
    shutil.rmtree(prefect_home, ignore_errors=True)
