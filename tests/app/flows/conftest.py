"""Helpers for the flow tests: run the command line, read a work area's journal.

The Prefect fixtures (`prefect_env`, `prefect_server`) live in tests/conftest.py, so that
every test directory shares one temporary server: a second one in the same process would
get the flow runs while Prefect's event client, a process singleton, still sent task runs
to the first."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.io.s3.support import run_zerosafe


def run_cli(
    env: dict[str, str],
    *args: str,
    timeout: int = 600,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return run_zerosafe(env, *args, timeout=timeout, check=check, cwd=cwd)


def convert_json(env: dict[str, str], *args: str, **kw: Any) -> dict[str, Any]:
    proc = run_cli(env, "convert", "--json", *args, **kw)
    return json.loads(proc.stdout)


def journal(work: Path) -> list[dict[str, Any]]:
    entries = [json.loads(p.read_text()) for p in (work / "journal").glob("*.json")]
    return sorted(entries, key=lambda e: e["time"])


def results_persisted(work: Path) -> bool:
    """Whether Prefect persisted a result for every unit the journal says finished, counted
    per stage by the cache key's `zerosafe-<stage>-` prefix: a test that kills a run once this
    holds knows "completed" means completed and cached, not merely executed. (Other tasks
    persist results too, so comparing totals lets a unit whose result is still being written
    pass when the machine is loaded.)"""
    entries = journal(work)
    for stage in ("extract", "merge", "verify"):
        done = sum(1 for e in entries if e["stage"] == stage)
        if len(list((work / "results").glob(f"zerosafe-{stage}-*"))) < done:
            return False
    return True


def work_dir(out: Path) -> Path:
    (work,) = (out / ".zerosafe-work").iterdir()
    return work


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, OSError):
        return False
    return state != "Z"
