"""The warm process beside the local server (`zerosafe_app.warm`): a command it serves behaves
as one run in-process (output, exit codes, messages, signals), and anything it cannot serve
exactly runs in-process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.flows.conftest import alive, run_cli
from tests.conftest import REPO, SAMPLE_CKPT
from zerosafe_app.flows.runtime import stop_local_server
from zerosafe_app.warm import socket_address

pytestmark = pytest.mark.slow


def _wait(condition: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _accepting(home: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(socket_address(home))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def warm_env(
    prefect_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, str]]:
    """A PREFECT_HOME whose first command ran in-process and left a warm process up."""
    home = tmp_path_factory.mktemp("warm-home")
    env = {**prefect_env, "PREFECT_HOME": str(home)}
    env.pop("ZEROSAFE_WARM", None)
    out = tmp_path_factory.mktemp("warm-first") / "out"
    stats = home / "first.stats"
    run_cli({**env, "ZEROSAFE_WARM_STATS": str(stats)}, "convert", str(SAMPLE_CKPT), str(out))
    assert not stats.exists(), "the first command had no warm process to use"
    _wait(lambda: _accepting(home), "the warm process")
    yield env
    stop_local_server(home)
    _wait(lambda: not _accepting(home), "the warm process to end with the server", 30)


def _served(
    env: dict[str, str], tmp_path: Path, *args: str, **kw: object
) -> tuple[subprocess.CompletedProcess[str], dict[str, object] | None]:
    stats = tmp_path / f"stats-{time.monotonic_ns()}"
    proc = run_cli({**env, "ZEROSAFE_WARM_STATS": str(stats)}, *args, **kw)  # type: ignore[arg-type]
    child = json.loads(stats.read_text()) if stats.exists() else None
    return proc, child


def test_a_served_command_writes_what_an_in_process_one_does(
    warm_env: dict[str, str], tmp_path: Path
) -> None:
    warm_out, here_out = tmp_path / "warm", tmp_path / "here"
    proc, child = _served(warm_env, tmp_path, "convert", str(SAMPLE_CKPT), str(warm_out))
    assert child is not None, "not served by the warm process"
    assert "converted 20 tensors" in proc.stdout and proc.returncode == 0
    cold, none = _served(
        {**warm_env, "ZEROSAFE_WARM": "0"}, tmp_path, "convert", str(SAMPLE_CKPT), str(here_out)
    )
    assert none is None and cold.returncode == 0
    names = sorted(p.name for p in here_out.iterdir())
    assert names == sorted(p.name for p in warm_out.iterdir())
    assert (warm_out / "model.safetensors").read_bytes() == (
        here_out / "model.safetensors"
    ).read_bytes()
    # the child's CPU and I/O, for the benchmark (the command's process tree lacks them)
    stats_files = list(tmp_path.glob("stats-*.child"))
    assert len(stats_files) == 1
    reported = json.loads(stats_files[0].read_text())
    assert reported["cpu_s"] > 0 and reported["io"]["rchar"] > 0


def test_errors_keep_their_message_and_exit_code(warm_env: dict[str, str], tmp_path: Path) -> None:
    proc, child = _served(
        warm_env, tmp_path, "convert", str(tmp_path / "missing"), str(tmp_path / "out"), check=False
    )
    assert child is not None
    assert proc.returncode == 2
    assert proc.stderr.startswith("zerosafe: error: ") and "missing" in proc.stderr


def test_what_it_cannot_serve_exactly_runs_in_process(
    warm_env: dict[str, str], tmp_path: Path
) -> None:
    # a setting Prefect reads at import, and -v (Prefect's log level): another process
    for env, extra in (({**warm_env, "PREFECT_LOGGING_LEVEL": "ERROR"}, ()), (warm_env, ("-v",))):
        proc, child = _served(
            env, tmp_path, "convert", *extra, str(SAMPLE_CKPT), str(tmp_path / f"o{len(extra)}")
        )
        assert proc.returncode == 0 and child is None


def _start_served(env: dict[str, str], tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A served conversion, its child stopped (SIGSTOP) as soon as it is known."""
    stats = tmp_path / "stats"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", str(SAMPLE_CKPT), str(tmp_path / "out")],
        env={**env, "ZEROSAFE_WARM_STATS": str(stats)}, cwd=REPO, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    _wait(stats.exists, "the served child", 30)
    child = int(json.loads(stats.read_text())["pid"])
    os.kill(child, signal.SIGSTOP)
    return proc, child


def test_sigint_reaches_the_child_which_stops_as_an_interrupted_run(
    warm_env: dict[str, str], tmp_path: Path
) -> None:
    proc, child = _start_served(warm_env, tmp_path)
    os.kill(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the command only
    time.sleep(0.5)
    os.kill(child, signal.SIGCONT)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert not alive(child)


def test_a_killed_command_takes_its_child_along(warm_env: dict[str, str], tmp_path: Path) -> None:
    proc, child = _start_served(warm_env, tmp_path)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    _wait(lambda: not alive(child), "the orphaned child to be killed", 10)
    # and the next command is served, and converts (resumes) the same output
    again, served = _served(
        warm_env, tmp_path, "convert", "--json", str(SAMPLE_CKPT), str(tmp_path / "out")
    )
    assert served is not None and json.loads(again.stdout)["status"] == "converted"


def test_a_warm_process_whose_code_changed_makes_way_for_a_new_one(
    warm_env: dict[str, str], tmp_path: Path
) -> None:
    import zerosafe_app.warm as warm

    source = Path(warm.__file__)
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # as an upgrade would
    try:
        proc, child = _served(warm_env, tmp_path, "convert", str(SAMPLE_CKPT), str(tmp_path / "a"))
        assert proc.returncode == 0 and child is None  # the old one refused: other code
        home = Path(warm_env["PREFECT_HOME"])
        _wait(lambda: _accepting(home), "a warm process of the new code")
        proc, child = _served(warm_env, tmp_path, "convert", str(SAMPLE_CKPT), str(tmp_path / "b"))
        assert proc.returncode == 0 and child is not None
    finally:
        os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
