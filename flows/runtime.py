"""Running flows from a command, with no server to start by hand.

`configure_embedded_prefect` sets the environment Prefect reads at import. `local_server`
starts a private `prefect server start` on loopback for the command's lifetime, unless
`PREFECT_API_URL` already names a server. Prefect's own temporary server would do the same,
but it runs in the command's process group: a terminal's Ctrl-C reaches it too, and the
command then hangs retrying a dead API while its queued tasks drain. This one runs in a
session of its own (Ctrl-C reaches only the command, which stops cleanly and records the
interruption), and with a parent-death signal, so it ends with the command even when the
command is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from zerosafe.errors import ConversionError

__all__ = ["configure_embedded_prefect", "local_server"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def configure_embedded_prefect(*, verbose: int = 0) -> None:
    """Environment for an embedded run; call before the first `import prefect`.

    Args:
        verbose: The command's `-v` count. 0: Prefect says nothing (the command prints its
            own one-line errors). 1: Prefect's warnings and errors only, beside zerosafe's
            own INFO lines (a line per extract, merge and verify task); Prefect's INFO lines
            are 'Finished in state Completed()' per task and links to the embedded server,
            which is gone when the command ends. 2 (`-vv`): Prefect's INFO lines too.
    """
    # Offline, the analytics call makes the temporary server's database lock (DESIGN.md).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    level = "CRITICAL" if not verbose else "WARNING" if verbose == 1 else "INFO"
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", level)
    os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_LEVEL", level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: SIGTERM when the command's process exits.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@contextlib.contextmanager
def local_server(*, timeout_seconds: float = 120.0) -> Iterator[str | None]:
    """A private Prefect server for the block's duration; yields its API URL.

    Yields None (and starts nothing) when `PREFECT_API_URL` is set or the `prefect`
    command cannot be found; Prefect then uses that server or its own temporary one.

    Raises:
        ConversionError: If the server does not come up, with the end of its log.
    """
    prefect = Path(sys.executable).parent / "prefect"
    if os.environ.get("PREFECT_API_URL") or not prefect.exists():
        yield None
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(
        prefix="zerosafe-prefect-server-", suffix=".log", delete=False
    )  # noqa: SIM115
    env = {**os.environ, "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_LOGGING_LEVEL", None)
    proc = subprocess.Popen(
        [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True, preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads yet
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout_seconds
        while True:
            try:
                with urllib.request.urlopen(url + "/api/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text(errors="replace")[-2000:]
                raise ConversionError(
                    f"the local Prefect server did not start (log {log.name}):\n{tail}"
                )
            time.sleep(0.25)
        os.environ["PREFECT_API_URL"] = url + "/api"
        yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)
