"""Where `zerosafe convert` runs (`zerosafe_app.flows.runtime`): in its own process unless a
Prefect API is configured; a private server for `--via prefect` that only its command can use
and that never outlives it. Nothing of a command stays running after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.app.flows.conftest import alive, convert_json, run_cli
from tests.conftest import REPO, SAMPLE_CKPT
from zerosafe_app.flows.runtime import configured_api, private_server

NOBODY = 65534


def _processes_with(env_entry: str) -> list[int]:
    """Pids of live processes whose environment holds `env_entry` (`NAME=value`)."""
    marker = env_entry.encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes() + b"\0"
        except OSError:
            continue
        if marker in environ and alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_configured_api_reads_env_profile_and_project_files(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    env = {"PREFECT_HOME": str(home)}
    assert configured_api(env, cwd) is None
    (home / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://team:4200/api"\n'
        '[profiles.ephemeral]\n'
    )  # fmt: skip
    assert configured_api(env, cwd) == (
        "http://team:4200/api",
        f"the Prefect profile 'team' ({home / 'profiles.toml'}) sets PREFECT_API_URL",
    )
    assert configured_api({**env, "PREFECT_PROFILE": "ephemeral"}, cwd) is None
    (cwd / "prefect.toml").write_text('[api]\nurl = "http://project:4200/api"\n')
    assert configured_api(env, cwd)[0] == "http://project:4200/api"  # type: ignore[index]
    (cwd / "prefect.toml").unlink()
    (cwd / "pyproject.toml").write_text('[tool.prefect.api]\nurl = "http://py:4200/api"\n')
    assert configured_api(env, cwd)[0] == "http://py:4200/api"  # type: ignore[index]
    assert configured_api({**env, "PREFECT_API_URL": "http://env/api"}, cwd) == (
        "http://env/api",
        "PREFECT_API_URL is set",
    )


def test_a_conversion_starts_nothing_and_leaves_nothing(
    local_env: dict[str, str], tmp_path: Path
) -> None:
    """No Prefect API configured: the command runs in its own process, imports no Prefect,
    creates no database, and leaves no process behind."""
    summary = convert_json(local_env, str(SAMPLE_CKPT), str(tmp_path / "out"))
    assert summary["status"] == "converted"
    assert summary["via"] == "local" and "no Prefect API configured" in summary["via_reason"]
    home = Path(local_env["PREFECT_HOME"])
    assert not (home / "prefect.db").exists()
    assert _processes_with(f"PREFECT_HOME={home}") == []


@pytest.mark.slow
def test_via_prefect_runs_the_flow_on_a_private_server_that_ends_with_it(
    local_env: dict[str, str], tmp_path: Path
) -> None:
    summary = convert_json(local_env, "--via", "prefect", str(SAMPLE_CKPT), str(tmp_path / "out"))
    assert summary["status"] == "converted" and summary["via"] == "prefect"
    home = Path(local_env["PREFECT_HOME"])
    assert (home / "prefect.db").exists()  # the flow ran on a server of that PREFECT_HOME
    assert _processes_with(f"PREFECT_HOME={home}") == []


def _get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth is not None:
        import base64

        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


_AS_NOBODY = """
import json, sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=10) as r:
        print(r.status)
except urllib.error.HTTPError as e:
    print(e.code)
"""


@pytest.mark.slow
def test_a_private_server_answers_only_its_auth_string(
    local_env: dict[str, str], tmp_path: Path
) -> None:
    """Another local user reaches the port (loopback) but reads nothing from it."""
    if os.geteuid() != 0 or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root and the system python3 to run a probe as a second user")
    with private_server(env=local_env) as (url, auth):
        runs = f"{url}/flows/filter"
        host = url.split("//", 1)[1].split(":", 1)[0]
        assert host == "127.0.0.1"
        assert _get(f"{url}/health") == 200  # the health probe is open, as Prefect's own
        req = urllib.request.Request(runs, data=b"{}", method="POST")
        req.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=10)
        assert refused.value.code == 401
        import base64

        req.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
        with urllib.request.urlopen(req, timeout=10) as response:
            assert response.status == 200
        as_nobody = subprocess.run(
            ["/usr/bin/python3", "-c", _AS_NOBODY, f"{url}/flows/{'0' * 8}-0000-0000-0000-{'0' * 12}"],
            capture_output=True, text=True, timeout=60, user=NOBODY, group=NOBODY,
            env={"PATH": os.environ.get("PATH", "")},
        )  # fmt: skip
        assert as_nobody.stdout.strip() == "401", as_nobody.stderr


@pytest.mark.slow
def test_a_killed_command_takes_its_private_server_along(
    local_env: dict[str, str], tmp_path: Path
) -> None:
    """The server ends with its command; the server's temporary folder, which the command
    had no chance to remove, is listed and removed by `zerosafe clean` (issue 37 item 9; the
    next private server removes it too: tests/io/test_owned_folders.py)."""
    home = Path(local_env["PREFECT_HOME"])
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**local_env, "TMPDIR": str(tmp)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--via", "prefect",
         str(SAMPLE_CKPT), str(tmp_path / "out")],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not [p for p in _processes_with(f"PREFECT_HOME={home}") if p != proc.pid]:
        assert proc.poll() is None, "the command ended before its server was seen"
        assert time.monotonic() < deadline, "no server started"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)  # only the command: its server must follow by itself
    proc.wait()
    deadline = time.monotonic() + 30
    while _processes_with(f"PREFECT_HOME={home}"):
        assert time.monotonic() < deadline, "the private server outlived its command"
        time.sleep(0.2)
    (left,) = tmp.glob("zerosafe-prefect-*")
    assert (left / "server.log").exists()
    clean = ["clean", str(tmp_path / "out"), "--older-than", "0", "--json"]
    listed = json.loads(run_cli(env, *clean).stdout)
    assert [(x["kind"], x["url"], x["action"]) for x in listed if x["kind"] == "server-folder"] == [
        ("server-folder", str(left), "remove")
    ], listed
    run_cli(env, *clean, "--apply")
    assert not left.exists()


def test_a_no_op_is_answered_without_the_flow(prefect_env: dict[str, str], tmp_path: Path) -> None:
    """A complete output is recognised from file stats: nothing else runs, even with a
    Prefect API configured."""
    out = tmp_path / "out"
    assert convert_json(prefect_env, str(SAMPLE_CKPT), str(out))["via"] == "prefect"
    again = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "zerosafe_app.cli", "convert",
         str(SAMPLE_CKPT), str(out)],
        env=prefect_env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and "nothing to do" in again.stdout
    imported = {line.split("|")[-1].strip() for line in again.stderr.splitlines()}
    assert "prefect" not in imported and "torch" not in imported


@pytest.mark.slow
def test_a_server_lost_mid_run_gives_one_line(local_env: dict[str, str], tmp_path: Path) -> None:
    """The Prefect API going away under a running flow: exit 2 and one line saying what to
    do, not pages of traceback; the rerun (here in-process) completes."""
    from bench.forge import forge_checkpoint, transformer_shapes

    ckpt = tmp_path / "ckpt"
    forge_checkpoint(ckpt, shapes=transformer_shapes("20M"), stage=3, world_size=2, dtype="bf16")
    out = tmp_path / "out"
    args = [str(ckpt), str(out), "--max-shard-size", "2MB", "--parallel", "1"]
    with private_server(env=local_env) as (url, auth):
        env = {**local_env, "PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth}
        env["PREFECT_CLIENT_MAX_RETRIES"] = "1"  # give up on the lost server sooner
        proc = subprocess.Popen(
            [sys.executable, "-m", "zerosafe_app.cli", "convert", *args],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not list(out.glob(".zerosafe-work/*/pending/model-*")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no shard was written"
            time.sleep(0.05)
    # the server is stopped here, mid-run
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "stopped answering" in lines[0], err[-3000:]
    assert convert_json(local_env, *args)["status"] == "converted"
