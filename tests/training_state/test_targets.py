"""The output targets behind one contract (`zerosafe.targets`): `--to` from the registry, the
training-state lifecycle's destination lease, units at once within `--memory`, and the
Prefect flow path (`convert` with `to`), on forged ZeRO-3 checkpoints."""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.app.flows.conftest import convert_json, run_cli
from tests.conftest import REPO
from zerosafe.training_state import convert_to_dcp, convert_to_universal

sys.path.insert(0, str(REPO))

from bench import forge as F  # noqa: E402

CONVERT = {"universal": convert_to_universal, "dcp": convert_to_dcp}
MARKERS = {"universal": "zerosafe-universal-complete.json", "dcp": "zerosafe-dcp-complete.json"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ZeRO-3 at world size 3, about 30M params (360 MB of masters and moments: a second or
    more to convert, so a second command lands while the first holds the output)."""
    dest = tmp_path_factory.mktemp("targets") / "ckpt"
    F.forge_checkpoint(
        dest, shapes=F.transformer_shapes("30M"), stage=3, world_size=3, dtype="bf16",
        seed=7, threads=1, moments="zeros",
    )  # fmt: skip
    return dest


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("targets-small") / "ckpt"
    F.forge_checkpoint(
        dest, shapes=F.transformer_shapes(vocab=301, width=24, layers=2), stage=3, world_size=3,
        dtype="bf16", seed=5, threads=1, moments="zeros",
    )  # fmt: skip
    return dest


def _same_tree(a: Path, b: Path) -> None:
    """Every file of `a` in `b` with the same bytes, and no other."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    _, mismatch, errors = filecmp.cmpfiles(a, b, [str(p) for p in files_a], shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_to_takes_its_choices_from_the_registry() -> None:
    """`--to` is written out (the command's start-up imports no target); it must list exactly
    the registry's targets, and every entry's code must be there."""
    from zerosafe.targets.registry import TARGETS, target_names
    from zerosafe_app.option_table import TARGET_NAMES

    assert TARGET_NAMES == target_names()
    for t in TARGETS:
        assert callable(t.load())
        assert t.target is None or isinstance(t.load(t.target), type)


@pytest.mark.parametrize("to", ["universal", "dcp"])
def test_units_at_once_write_the_same_bytes(small_ckpt: Path, tmp_path: Path, to: str) -> None:
    """Four units at once, small chunks, give the bytes one unit at a time gives (into the
    same folder: `.metadata` names it)."""
    out = tmp_path / "out"
    one = CONVERT[to](str(small_ckpt), str(out), unit_bytes=4096, parallel=1)
    out.rename(tmp_path / "one")
    many = CONVERT[to](str(small_ckpt), str(out), unit_bytes=4096, parallel=4, chunk_bytes=64)
    assert one.parallel == 1 and many.parallel == 4 and many.units_run == one.units_run > 4
    assert many.chunk_bytes == 64 and one.chunk_bytes > 1 << 20  # from --memory
    _same_tree(tmp_path / "one", out)


SPAWN = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def test_peak_memory_stays_within_the_budget(
    local_env: dict[str, str], ckpt: Path, tmp_path: Path
) -> None:
    """360 MB of masters and moments through a 200 MB budget, two units at once: the whole
    process's peak stays within it (`--to dcp` imports torch to pickle `.metadata`, whose
    300 MB dwarf the budget: the benchmark reports its peak)."""
    argv = [
        sys.executable,
        "-m",
        "zerosafe_app.cli",
        "convert",
        "--json",
        str(ckpt),
        str(tmp_path / "out"),
        "--to",
        "universal",
        "--memory",
        "200MB",
        "--parallel",
        "2",
    ]
    # Started from a small process: Linux carries the peak RSS of the process that forks
    # into the child's `ru_maxrss` across exec, and this test process may hold torch.
    proc = subprocess.run(
        [sys.executable, "-c", SPAWN, *argv], env=local_env, cwd=REPO, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["status"] == "converted" and summary["via"] == "local"
    assert summary["parallel"] == 2 and summary["chunk_bytes"] >= 1 << 20
    assert summary["masters_bytes"] + summary["moments_bytes"] > 200 * 10**6
    assert summary["peak_rss_bytes"] <= 200 * 10**6, summary["peak_rss_bytes"]


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--json", *args],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("to", ["universal", "dcp"])
def test_a_second_command_on_one_output_is_refused_naming_the_holder(
    local_env: dict[str, str], ckpt: Path, tmp_path: Path, to: str
) -> None:
    """The first command holds the output folder (stopped with SIGSTOP once it does, so the
    second surely meets it); the second exits 2 with one line naming the first; the first,
    continued, completes."""
    out = tmp_path / "out"
    first = _start(local_env, str(ckpt), str(out), "--to", to, "--via", "local")
    try:
        _wait_for(lambda: (out / ".zerosafe-lease.json").exists(), 120, "the first to hold OUT")
        os.killpg(first.pid, signal.SIGSTOP)
        second = run_cli(local_env, "convert", str(ckpt), str(out), "--to", to, check=False)
        os.killpg(first.pid, signal.SIGCONT)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert "another conversion into this output folder is running" in lines[0]
        assert f"{ckpt} -> {out}" in lines[0] and f"pid {first.pid}" in lines[0], lines[0]
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert first.returncode == 0, stderr
    assert json.loads(stdout)["status"] == "converted" and (out / MARKERS[to]).exists()


@pytest.mark.slow
@pytest.mark.parametrize("to", ["universal", "dcp"])
def test_the_flow_path_writes_the_same_bytes_and_resumes_after_sigkill(
    prefect_env: dict[str, str], local_env: dict[str, str], ckpt: Path, tmp_path: Path, to: str
) -> None:
    """`convert --to ...` with a Prefect API configured runs the flow `convert` (`to`), each
    unit a cached task; killed once units are recorded, the same command keeps every one of
    them (their records untouched) and publishes the bytes the local run writes."""
    out, reference = tmp_path / "out", tmp_path / "local"  # one folder: `.metadata` names it
    args = (str(ckpt), str(out), "--to", to, "--parallel", "1")
    local = convert_json(local_env, *args)
    out.rename(reference)
    proc = _start(prefect_env, *args)
    units = out / ".zerosafe-work"

    def records() -> dict[str, int]:
        found = list(units.glob(f"*/units/{to}-*.json")) if units.exists() else []
        return {p.name: p.stat().st_mtime_ns for p in found}

    try:
        _wait_for(lambda: len(records()) >= 2, 600, "two units to finish")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = records()
    assert not (out / MARKERS[to]).exists()
    summary = convert_json(prefect_env, *args, "--keep-work")
    assert summary["via"] == "prefect" and summary["status"] == "converted"
    total = local["units_run"]
    assert summary["units_kept"] >= len(before) and summary["units_run"] < total
    assert summary["units_kept"] + summary["units_run"] == total
    after = records()
    assert {name: after[name] for name in before} == before  # a kept unit is not redone
    shutil.rmtree(out / ".zerosafe-work")  # kept (--keep-work) to read the records above
    _same_tree(reference, out)
    again = convert_json(prefect_env, *args)
    assert again["status"] == "already-complete"


def test_the_flow_refuses_the_weights_options_for_training_state(tmp_path: Path) -> None:
    """A deployment's `to: universal` with a weights-only field set fails in one line, before
    anything is read."""
    from zerosafe.errors import ConfigError
    from zerosafe_app.flows.config import JobConfig
    from zerosafe_app.flows.training_state import dispatch

    cfg = JobConfig(
        source=str(tmp_path / "ckpt"), destination=str(tmp_path / "out"), to="universal",
        dtype="bf16",
    )  # fmt: skip
    with pytest.raises(ConfigError, match="`dtype` does not apply with `to: universal`"):
        dispatch(cfg)
    assert not (tmp_path / "out").exists()
