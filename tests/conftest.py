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
    """Environment for subprocesses that run flows embedded. They share one local Prefect
    server (the first command starts it; `zerosafe_app.flows.runtime`), stopped when the session ends."""
    from zerosafe_app.flows.runtime import stop_local_server

    home = tmp_path_factory.mktemp("prefect-home")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(REPO),
        PYTHONUNBUFFERED="1",
    )
    yield env
    stop_local_server(home)


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """A temporary Prefect server (SQLite) for flows run inside the test process."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
