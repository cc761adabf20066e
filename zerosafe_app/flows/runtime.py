"""Where `zerosafe convert` runs: in its own process, or as the Prefect flow on a server.

With no Prefect API configured (no `PREFECT_API_URL` in the environment, in the active
Prefect profile, or in a `prefect.toml` / `pyproject.toml` of the working folder), a
conversion runs the engine's lifecycle in the command's own process: no server to start,
nothing left running (`zerosafe.driver.convert_checkpoint`). `configured_api` says which
applies, without importing Prefect (an import alone costs about a second).

Where a Prefect API is configured, the command runs the flow `convert` against that server.
`--via prefect` without one starts a private server for the command (`private_server`): on
loopback, with a random auth string that only this command and the server hold (in their
environments, which only their user can read), ended with the command even if it is killed.
Nothing of it outlives the command but, after a SIGKILL, its temporary folder (the server's
log): the next private server removes those of commands that are gone, and `zerosafe clean`
lists them (`zerosafe.io.owned_folders`).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import tomllib

from zerosafe.config import environ_during
from zerosafe.errors import ConversionError
from zerosafe.io.owned_folders import PRIVATE_SERVER_PREFIX, owned_temp_folder

__all__ = [
    "configure_embedded_prefect",
    "configured_api",
    "private_server",
    "server_healthy",
    "use_api",
]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PORT_ATTEMPTS = 5


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
    # Prefect's own background services (its event and log senders) log to their own handler.
    os.environ.setdefault("PREFECT_INTERNAL_LOGGING_LEVEL", level)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dies_with(parent: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when `parent` exits, and exits at once if
    `parent` is already gone (killed between the fork and here)."""

    def preexec() -> None:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # libc, already loaded
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def configured_api(
    env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> tuple[str, str] | None:
    """The Prefect API this command's Prefect would use, and where it is set; None where none
    is (Prefect would run a temporary server of its own).

    Reads what Prefect reads for `PREFECT_API_URL`, without importing it: the environment,
    the active profile of `profiles.toml` (`PREFECT_PROFILE`, else the file's `active`), and a
    `prefect.toml` (`[api] url`) or `pyproject.toml` (`[tool.prefect.api] url`) in the working
    folder.
    """
    env = os.environ if env is None else env
    cwd = Path.cwd() if cwd is None else cwd
    if env.get("PREFECT_API_URL"):
        return env["PREFECT_API_URL"], "PREFECT_API_URL is set"
    with contextlib.suppress(OSError):  # a working folder that was deleted
        for name, table in (("prefect.toml", ()), ("pyproject.toml", ("tool", "prefect"))):
            config: Any = _toml(cwd / name)
            for key in (*table, "api"):
                config = config.get(key, {}) if isinstance(config, dict) else {}
            if isinstance(config, dict) and config.get("url"):
                return str(config["url"]), f"{cwd / name} sets the Prefect API URL"
    home = Path(env.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    profiles_path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    profiles = _toml(profiles_path)
    active = env.get("PREFECT_PROFILE") or profiles.get("active") or "ephemeral"
    profile = profiles.get("profiles", {}).get(active, {})
    if isinstance(profile, dict) and profile.get("PREFECT_API_URL"):
        return (
            str(profile["PREFECT_API_URL"]),
            f"the Prefect profile '{active}' ({profiles_path}) sets PREFECT_API_URL",
        )
    return None


def server_healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/api/health", timeout=timeout) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not server_healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise ConversionError(f"the local Prefect server did not start (log {log}):\n{tail}")
        time.sleep(0.1)


def _server_command(port: int) -> list[str]:
    prefect = Path(sys.executable).parent / "prefect"
    return [str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)]


LOCAL_RETENTION_SECONDS = 7 * 86400
"""How long the local server keeps finished flow runs (and their task runs, logs, artifacts)."""


def _server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        **(os.environ if base is None else base),
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    # The local database would otherwise grow with every run: Prefect's own vacuum service
    # deletes flow runs that ended more than a week ago, and old events (unless set already).
    env.setdefault("PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED", "events,flow_runs")
    env.setdefault(
        "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD", str(LOCAL_RETENTION_SECONDS)
    )
    env.pop("PREFECT_LOGGING_LEVEL", None)
    env.pop("PREFECT_API_URL", None)
    return env


def _status(url: str, auth: str | None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        token = base64.b64encode(auth.encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def _holds_auth(url: str, auth: str) -> bool:
    """Whether the server at `url` is the one started with `auth`: it refuses a request
    without it and answers one with it."""
    probe = f"{url}/api/admin/version"
    return _status(probe, None) == 401 and _status(probe, auth) == 200


@contextlib.contextmanager
def private_server(
    *, timeout_seconds: float = 120.0, env: Mapping[str, str] | None = None
) -> Iterator[tuple[str, str]]:
    """A Prefect server for one command (or one test session), for the block's duration;
    yields its API URL and its auth string (the client's `PREFECT_API_AUTH_STRING`).

    It listens on loopback and refuses every request without the auth string
    (`PREFECT_SERVER_API_AUTH_STRING`, random per server; only the health probe answers
    without it). It ends with the block, and with the process that started it even when that
    is killed (a parent-death signal). Its database is the one of `PREFECT_HOME`, so a
    `prefect server start` there later shows the runs.

    Args:
        env: The environment to start it in (default: this process's).

    Raises:
        ConversionError: If the server does not come up, with the end of its log.
    """
    auth = secrets.token_urlsafe(32)
    server_env = {**_server_env(env), "PREFECT_SERVER_API_AUTH_STRING": auth}
    # Mode 0700. A command killed with SIGKILL cannot remove its folder: the next one does.
    with owned_temp_folder(PRIVATE_SERVER_PREFIX) as private:
        log = Path(private) / "server.log"
        for attempt in range(_PORT_ATTEMPTS):
            # A free port can be taken by another process before the server binds it.
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    _server_command(port), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, env=server_env, start_new_session=True,
                    preexec_fn=_dies_with(os.getpid()),  # noqa: PLW1509 - no threads yet
                )  # fmt: skip
            try:
                _wait_healthy(url, proc, log, timeout_seconds)
                if not _holds_auth(url, auth):  # another server answered on that port
                    raise ConversionError(f"{url}: another server answers there")
                break
            except ConversionError:
                _stop(proc)
                taken = "already in use" in log.read_text(errors="replace") or proc.poll() is None
                if attempt + 1 == _PORT_ATTEMPTS or not taken:
                    raise
        try:
            yield url + "/api", auth
        finally:
            _stop(proc)


@contextlib.contextmanager
def use_api(url: str, auth: str | None) -> Iterator[None]:
    """Point this process's Prefect at `url` (with `auth`) for the block's duration."""
    with environ_during({"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth}):
        yield


def _stop(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
