"""Running flows from a command, with no server to start by hand.

`configure_embedded_prefect` sets the environment Prefect reads at import. `local_server`
gives the command a Prefect server on loopback, unless `PREFECT_API_URL` already names one.

Starting a Prefect server costs seconds (7-13 s measured here: its import, its database, its
app), which used to be paid by every `zerosafe convert`, however small the checkpoint. So the
server outlives the command: the first command starts it, detached, under a small keeper
process (`python -m zerosafe_app.flows.runtime keep ...`), and records it in `$PREFECT_HOME/zerosafe-
local-server.json`; later commands with the same `PREFECT_HOME` find it there and reuse it.
The keeper stops the server once no command has used it for `ZEROSAFE_SERVER_IDLE_SECONDS`
(default 600), or when `PREFECT_HOME` is removed. Each command registers itself while it
runs, so an idle timeout never cuts a run short.

The server runs in a session of its own: a terminal's Ctrl-C reaches only the command, which
stops cleanly and records the interruption, instead of also killing the API the command
still needs. `ZEROSAFE_SERVER_IDLE_SECONDS=0` keeps the old behaviour: a private server that
ends with the command.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
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
from typing import Any

from zerosafe.errors import ConversionError
from zerosafe.io.lease import pid_alive

__all__ = [
    "configure_embedded_prefect",
    "local_server",
    "recorded_server",
    "server_healthy",
    "stop_local_server",
]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
DEFAULT_IDLE_SECONDS = 600.0
STATE_NAME = "zerosafe-local-server.json"
LOCK_NAME = "zerosafe-local-server.lock"
CLIENTS_DIR = "zerosafe-local-server-clients"


def configure_embedded_prefect(*, verbose: int = 0) -> None:
    """Environment for an embedded run; call before the first `import prefect`.

    Args:
        verbose: The command's `-v` count. 0: Prefect says nothing (the command prints its
            own one-line errors). 1: Prefect's warnings and errors only, beside zerosafe's
            own INFO lines (a line per extract, merge and verify task); Prefect's INFO lines
            are 'Finished in state Completed()' per task and links to the embedded server,
            which is gone when the command ends. 2 (`-vv`): Prefect's INFO lines too.
    """
    # Offline, the analytics call makes the temporary server's database lock.
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
    # Runs in the child between fork and exec: SIGTERM when its parent exits.
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _home() -> Path:
    return Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()


def _idle_seconds() -> float:
    try:
        return float(os.environ.get("ZEROSAFE_SERVER_IDLE_SECONDS", DEFAULT_IDLE_SECONDS))
    except ValueError:
        return DEFAULT_IDLE_SECONDS


def server_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/api/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _read_state(home: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((home / STATE_NAME).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def recorded_server(home: Path) -> str | None:
    """The URL this `PREFECT_HOME` records for its shared server, while its keeper lives (no
    request is made: see `_running`)."""
    state = _read_state(home)
    if not state or not pid_alive(int(state.get("pid", -1))):
        return None
    return str(state.get("url", "")) or None


def _running(home: Path) -> str | None:
    """The URL of this `PREFECT_HOME`'s shared server, if it is up."""
    url = recorded_server(home)
    return url if url and server_healthy(url) else None


@contextlib.contextmanager
def _locked(home: Path) -> Iterator[None]:
    home.mkdir(parents=True, exist_ok=True)
    with open(home / LOCK_NAME, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ConversionError(f"the local Prefect server did not start (log {log}):\n{tail}")
        time.sleep(0.1)


def _spawn_shared(home: Path, timeout: float) -> str:
    """Start a keeper (and its server) detached from this command; returns the server URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = home / "zerosafe-local-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerosafe_app.flows.runtime", "keep", "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": _import_path()}, start_new_session=True,
        )  # fmt: skip
    _wait_healthy(url, proc, log, timeout)
    return url


def _import_path() -> str:
    """PYTHONPATH for the keeper: where `flows` is importable from, then the caller's."""
    root = str(Path(__file__).resolve().parents[1])
    rest = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + rest if rest else "")


def _server_command(port: int) -> list[str]:
    prefect = Path(sys.executable).parent / "prefect"
    return [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]


LOCAL_RETENTION_SECONDS = 7 * 86400
"""How long the local server keeps finished flow runs (and their task runs, logs, artifacts)."""


def _server_env() -> dict[str, str]:
    env = {**os.environ, "PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    # The local database would otherwise grow with every run: Prefect's own vacuum service
    # deletes flow runs that ended more than a week ago, and old events (unless set already).
    env.setdefault("PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED", "events,flow_runs")
    env.setdefault(
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD", str(LOCAL_RETENTION_SECONDS)
    )
    env.pop("PREFECT_LOGGING_LEVEL", None)
    env.pop("PREFECT_API_URL", None)
    return env


@contextlib.contextmanager
def _private_server(timeout_seconds: float) -> Iterator[str]:
    """A server that lives exactly as long as this command (and dies with it, even on
    SIGKILL, through a parent-death signal)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(
        prefix="zerosafe-prefect-server-", suffix=".log", delete=False
    )  # noqa: SIM115
    proc = subprocess.Popen(
        _server_command(port), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=_server_env(), start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads yet
    )  # fmt: skip
    try:
        _wait_healthy(url, proc, Path(log.name), timeout_seconds)
        yield url
    finally:
        _stop(proc)
        log.close()
        with contextlib.suppress(OSError):
            os.unlink(log.name)


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def local_server(*, timeout_seconds: float = 120.0) -> Iterator[str | None]:
    """A Prefect server for the block's duration; yields its URL and sets `PREFECT_API_URL`.

    Yields None (and starts nothing) when `PREFECT_API_URL` is set or the `prefect`
    command cannot be found; Prefect then uses that server or its own temporary one.

    Raises:
        ConversionError: If the server does not come up, with the end of its log.
    """
    prefect = Path(sys.executable).parent / "prefect"
    if os.environ.get("PREFECT_API_URL") or not prefect.exists():
        yield None
        return
    if _idle_seconds() <= 0:
        with _private_server(timeout_seconds) as url:
            with _api_url(url):
                yield url
        return
    home = _home()
    clients = home / CLIENTS_DIR
    mine = clients / str(os.getpid())
    with _locked(home):
        clients.mkdir(exist_ok=True)
        mine.touch()  # the keeper stays up while this file names a live process
        try:
            url = _running(home) or _spawn_shared(home, timeout_seconds)
        except BaseException:
            with contextlib.suppress(OSError):
                mine.unlink()
            raise
    try:
        with _api_url(url):
            yield url
    finally:
        with contextlib.suppress(OSError):
            mine.unlink()
        with contextlib.suppress(OSError):
            os.utime(home / STATE_NAME)  # idle from now on


@contextlib.contextmanager
def _api_url(url: str) -> Iterator[None]:
    os.environ["PREFECT_API_URL"] = url + "/api"
    try:
        yield
    finally:
        os.environ.pop("PREFECT_API_URL", None)


def stop_local_server(home: Path | None = None) -> bool:
    """Stop the shared server of `home` (default: `PREFECT_HOME`); True if one was running."""
    home = home or _home()
    state = _read_state(home)
    if not state or not pid_alive(int(state.get("pid", -1))):
        return False
    os.kill(int(state["pid"]), signal.SIGTERM)
    deadline = time.monotonic() + 20
    while pid_alive(int(state["pid"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def _busy(clients: Path) -> bool:
    busy = False
    for entry in clients.glob("*") if clients.is_dir() else []:
        try:
            pid = int(entry.name)
        except ValueError:
            continue
        if pid_alive(pid):
            busy = True
        else:
            with contextlib.suppress(OSError):
                entry.unlink()  # a command killed before it could deregister
    return busy


def keep(port: int) -> int:
    """The keeper: run the server, stop it once idle. Runs as `python -m zerosafe_app.flows.runtime keep`."""
    home = _home()
    idle = _idle_seconds()
    url = f"http://127.0.0.1:{port}"
    stopping = False

    def on_term(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    proc = subprocess.Popen(
        _server_command(port), env=_server_env(), stdin=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads here
    )  # fmt: skip
    state = home / STATE_NAME
    state.write_text(json.dumps({"url": url, "pid": os.getpid(), "server_pid": proc.pid}))
    try:
        while not stopping and proc.poll() is None and not server_healthy(url):
            time.sleep(0.2)  # idle time counts from when the server is up
        last_used = time.monotonic()
        while not stopping and proc.poll() is None and home.is_dir():
            if _busy(home / CLIENTS_DIR):
                last_used = time.monotonic()
            with contextlib.suppress(OSError):
                touched = time.time() - state.stat().st_mtime
                last_used = max(last_used, time.monotonic() - touched)
            if time.monotonic() - last_used > idle:
                break
            time.sleep(1.0)
    finally:
        current = _read_state(home)
        if current and current.get("pid") == os.getpid():
            with contextlib.suppress(OSError):
                state.unlink()
        _stop(proc)
    return 0


if __name__ == "__main__":  # the keeper
    import argparse

    parser = argparse.ArgumentParser(prog="python -m zerosafe_app.flows.runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    k = sub.add_parser("keep", help="run a shared local Prefect server until it is idle")
    k.add_argument("--port", type=int, required=True)
    sys.exit(keep(parser.parse_args().port))
