"""Shared test fixtures: the shipped sample checkpoint, the shared DeepSpeed fixtures."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE_CKPT = REPO / "examples" / "zero3-bf16-ws3"
SAMPLE_LIVE = REPO / "examples" / "zero3-bf16-ws3-live-weights.safetensors"
SHARED_FIXTURES = Path(
    os.environ.get("ZEROSAFE_SHARED_FIXTURES", REPO.parent / "shared" / "fixtures" / "deepspeed")
)


def shared_fixture_names() -> list[str]:
    """Names of the checkpoints in ../shared/fixtures/deepspeed (empty if it is absent)."""
    if not SHARED_FIXTURES.is_dir():
        return []
    return sorted(p.name for p in SHARED_FIXTURES.iterdir() if (p / "checkpoint").is_dir())


@pytest.fixture
def sample_ckpt(tmp_path: Path) -> Path:
    """A writable copy of the shipped ZeRO-3 sample checkpoint."""
    dest = tmp_path / "ckpt"
    shutil.copytree(SAMPLE_CKPT, dest)
    for f in dest.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)
    return dest


@pytest.fixture(scope="session")
def prefect_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Environment for subprocess commands that run the flow: `PREFECT_API_URL` names a
    Prefect server of this test session (loopback, with an auth string), so `zerosafe
    convert` runs the flow `convert` against it, as on a team's server."""
    from zerosafe_app.flows.runtime import private_server

    home = tmp_path_factory.mktemp("prefect-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    with private_server(env=env) as (url, auth):
        yield {**env, "PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth}


@pytest.fixture
def local_env(tmp_path: Path) -> dict[str, str]:
    """Environment for subprocess commands with no Prefect API configured (a new, empty
    `PREFECT_HOME`): `zerosafe convert` runs in its own process, as a user's first command."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1"
    )
    return env


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """A temporary Prefect server (SQLite) for flows run inside the test process."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
