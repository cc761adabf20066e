"""The flow under stress: a memory budget with parallel tasks, SIGKILL and resume, two runs of
one job at once, a full disk. Checkpoints come from the forge (DeepSpeed's exact format)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.forge import forge_checkpoint, transformer_shapes
from tests.app.flows.conftest import convert_json, journal, results_persisted, run_cli
from tests.conftest import REPO
from tests.helpers import load_output, same_bytes
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint

pytestmark = pytest.mark.slow

SHARDS = "48MB"
SMALL_SHARDS = "8MB"  # ~40 shards: a run long enough to be killed in the middle


@pytest.fixture(scope="module")
def medium_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 150 M params (600 MB of fp32 masters), ZeRO-3 at world size 2, bf16 training."""
    dest = tmp_path_factory.mktemp("medium") / "ckpt"
    info = forge_checkpoint(
        dest, shapes=transformer_shapes("150M"), stage=3, world_size=2, dtype="bf16"
    )
    assert info.fp32_bytes > 500e6
    return dest


@pytest.fixture(scope="module")
def reference(medium_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted conversion, by the engine driver, for byte comparisons."""
    out = tmp_path_factory.mktemp("reference") / "out"
    convert_checkpoint(
        str(medium_ckpt),
        str(out),
        ConvertOptions(dtype="bf16", max_shard_size=48 * 10**6, direct=True),
    )
    return out


@pytest.fixture(scope="module")
def reference_small_shards(medium_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference-small") / "out"
    convert_checkpoint(
        str(medium_ckpt),
        str(out),
        ConvertOptions(dtype="bf16", max_shard_size=8 * 10**6, direct=True),
    )
    return out


def _same_output(a: Path, b: Path) -> None:
    files_a = sorted(p.name for p in a.glob("model*"))
    assert files_a == sorted(p.name for p in b.glob("model*"))
    for name in files_a:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, ma = load_output(a)
    tb, mb = load_output(b)
    assert {k: v["xxh3_128"] for k, v in ma["tensors"].items()} == {
        k: v["xxh3_128"] for k, v in mb["tensors"].items()
    }
    for key in ta:
        assert same_bytes(ta[key], tb[key])


def test_parallel_tasks_stay_within_the_memory_budget(medium_ckpt: Path, tmp_path: Path) -> None:
    budget = 128 * 2**20
    out = tmp_path / "out"
    options = {
        "memory": str(budget),
        "max_parallel_tasks": 2,
        "dtype": "bf16",
        "max_shard_size": SHARDS,
        "keep_work": True,
    }
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "memory_probe.py"), "flow", str(medium_ckpt), str(out), json.dumps(options)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = result["peak_rss"] - result["baseline_rss"]
    fp32_bytes = (
        sum(f.stat().st_size for f in (medium_ckpt / "global_step1").glob("*optim*")) / 3
    )  # masters ~ 1/3
    (work,) = (out / ".zerosafe-work").iterdir()
    entries = [e for e in journal(work) if e["stage"] in ("extract", "merge", "verify")]
    spans = sorted((e["time"] - e["seconds"], e["time"]) for e in entries)
    overlaps = sum(1 for (_, end), (start, _) in zip(spans, spans[1:], strict=False) if start < end)
    print(
        f"\nflow with 2 parallel tasks, budget {budget / 2**20:.0f} MiB, model fp32 ~{fp32_bytes / 2**20:.0f} MiB "
        f"({fp32_bytes / budget:.1f}x): baseline {result['baseline_rss'] / 2**20:.0f} MiB, peak "
        f"{result['peak_rss'] / 2**20:.0f} MiB, grew {grew / 2**20:.1f} MiB; {len(entries)} tasks, {overlaps} overlapping"
    )
    assert fp32_bytes > 4 * budget
    assert overlaps >= 1, "tasks never ran in parallel"
    assert grew <= budget


def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _one_at_a_time(ckpt: Path, out: Path) -> tuple[str, ...]:
    """`convert` arguments for a bf16 conversion into ~40 shards, one task at a time."""
    args = ["--dtype", "bf16", "--max-shard-size", SMALL_SHARDS, "--parallel", "1"]
    return (str(ckpt), str(out), *args, "--memory", "256MB")


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", "--json", *args],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the embedded server dies with it
    )  # fmt: skip


def test_sigkill_during_merges_then_resume(
    prefect_env: dict[str, str], medium_ckpt: Path, reference_small_shards: Path, tmp_path: Path
) -> None:
    reference = reference_small_shards
    out = tmp_path / "out"
    args = _one_at_a_time(medium_ckpt, out)
    proc = _start(prefect_env, *args)
    work_root = out / ".zerosafe-work"

    def merges_done() -> int:
        works = list(work_root.iterdir()) if work_root.exists() else []
        return (
            sum(1 for e in journal(works[0]) if e["stage"] == "merge")
            if works and (works[0] / "journal").exists()
            else 0
        )

    def results_settled() -> bool:
        # Kill only once Prefect persisted a result for every task the journal says finished,
        # so "completed" below means completed and cached, not merely executed.
        (work,) = work_root.iterdir()
        return merges_done() >= 2 and results_persisted(work)

    _wait_for(lambda: merges_done() >= 2, 600, "two merges to finish")
    _wait_for(results_settled, 60, "results to be persisted")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    (work,) = work_root.iterdir()
    before = {(e["stage"], e["index"]) for e in journal(work)}
    total_merges = len(list(reference.glob("model-*")))
    assert ("publish", 0) not in before and not (out / "zerosafe-complete.json").exists()
    assert 2 <= sum(1 for s, _ in before if s == "merge") < total_merges, (
        "kill did not land while merges were in flight"
    )

    t0 = time.time()
    summary = convert_json(prefect_env, *args, "--keep-work")  # keep the journal to inspect
    rerun = {(e["stage"], e["index"]) for e in journal(work) if e["time"] >= t0}
    print(f"\nkilled after {sorted(before)}; second run executed {sorted(rerun)}")
    assert summary["status"] == "converted" and ("publish", 0) in rerun
    # every shard is verified again (a verify result never outlives its run); nothing else
    again = {(s, i) for s, i in rerun & before if s != "verify"}
    assert not again, f"re-executed tasks that had completed: {sorted(again)}"
    merged = {i for s, i in before | rerun if s == "merge"}
    assert merged == set(range(total_merges))
    assert summary["tasks_executed"]["merge"] == total_merges - sum(
        1 for s, _ in before if s == "merge"
    )
    _same_output(out, reference)


def test_sigkill_in_process_then_resume(
    local_env: dict[str, str], medium_ckpt: Path, reference_small_shards: Path, tmp_path: Path
) -> None:
    """No Prefect API: the command runs the engine in its own process. Killed mid-run, the
    next run keeps every unit it finds recorded with its output intact, and redoes the rest."""
    out = tmp_path / "out"
    args = _one_at_a_time(medium_ckpt, out)
    proc = _start(local_env, *args)
    work_root = out / ".zerosafe-work"

    def records(stage: str) -> dict[str, int]:
        works = list(work_root.iterdir()) if work_root.exists() else []
        units = works[0] / "units" if works else None
        if units is None or not units.exists():
            return {}
        return {p.name: p.stat().st_mtime_ns for p in units.glob(f"{stage}-*.json")}

    _wait_for(lambda: len(records("merge")) >= 2, 600, "two merges to finish")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    merged_before = records("merge")
    total_merges = len(list(reference_small_shards.glob("model-*")))
    assert not (out / "zerosafe-complete.json").exists()
    assert 2 <= len(merged_before) < total_merges, "kill did not land while merges were in flight"

    summary = convert_json(local_env, *args, "--keep-work")
    assert summary["status"] == "converted" and summary["via"] == "local"
    executed = summary["tasks_executed"]
    assert executed["merge"] == total_merges - len(merged_before)
    assert executed["verify"] == total_merges  # a verify is never kept from another run
    assert any(note.startswith("resumed:") for note in summary["notes"]), summary["notes"]
    after = records("merge")
    assert set(after) == {f"merge-{i:05d}.json" for i in range(total_merges)}
    # a kept unit's record is not written again
    assert {name: after[name] for name in merged_before} == merged_before
    _same_output(out, reference_small_shards)


def _job_work_dir(env: dict[str, str], ckpt: Path, out: Path, *args: str) -> Path:
    job_key = json.loads(run_cli(env, "inspect", "--json", str(ckpt), *args).stdout)["job_key"]
    return out / ".zerosafe-work" / job_key[:16]


def test_a_live_lease_is_refused_and_a_dead_one_taken_over(
    prefect_env: dict[str, str], medium_ckpt: Path, reference: Path, tmp_path: Path
) -> None:
    import socket

    out = tmp_path / "out"
    opts = ("--dtype", "bf16", "--max-shard-size", SHARDS)
    work = _job_work_dir(prefect_env, medium_ckpt, out, *opts)
    work.mkdir(parents=True)
    lease = {
        "run_id": "other",
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": time.time(),
    }
    (work / "lease.json").write_text(json.dumps(lease))
    (work / "plan").mkdir()
    proc = run_cli(prefect_env, "convert", str(medium_ckpt), str(out), *opts, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "another run of this job" in proc.stderr and str(work / "lease.json") in proc.stderr
    assert not (out / "zerosafe-complete.json").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (work / "lease.json").write_text(
        json.dumps({**lease, "pid": dead.pid})
    )  # a run killed with SIGKILL
    assert convert_json(prefect_env, str(medium_ckpt), str(out), *opts)["status"] == "converted"
    _same_output(out, reference)


def test_two_runs_of_one_job_started_together(
    prefect_env: dict[str, str], medium_ckpt: Path, reference_small_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = _one_at_a_time(medium_ckpt, out)
    runs = [_start(prefect_env, *args) for _ in range(2)]
    results = []
    for run in runs:
        stdout, stderr = run.communicate(timeout=900)
        results.append((run.returncode, stdout, stderr))
    outcomes = sorted(
        "converted" if code == 0 and json.loads(so)["status"] == "converted"
        else "complete" if code == 0 and json.loads(so)["status"] == "already-complete"
        else "refused" if code == 2 and "another conversion into this output folder" in se
        else f"unexpected exit {code}: {se[-2000:]}"
        for code, so, se in results
    )  # fmt: skip
    print(f"\ntwo runs at once: {outcomes}")
    assert outcomes in (["complete", "converted"], ["converted", "refused"]), outcomes
    _same_output(out, reference_small_shards)


@pytest.fixture
def small_tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk test did not run")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_full_disk_names_the_path_and_the_same_command_then_completes(
    prefect_env: dict[str, str], medium_ckpt: Path, reference: Path, small_tmpfs: Path
) -> None:
    out = small_tmpfs / "out"
    args = (
        str(medium_ckpt),
        str(out),
        "--dtype",
        "bf16",
        "--max-shard-size",
        SHARDS,
        "--mode",
        "direct",
        "--memory",
        "256MB",
    )
    proc = run_cli(prefect_env, "convert", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert str(out) in proc.stderr and "needs" in proc.stderr and "free" in proc.stderr
    assert not (out / "zerosafe-complete.json").exists()
    # Space is freed (the tmpfs grows), and the same command completes.
    subprocess.run(["mount", "-o", "remount,size=600m", str(small_tmpfs)], check=True)
    convert_json(prefect_env, *args)
    _same_output(out, reference)


def test_no_space_mid_write_is_a_clear_error(small_tmpfs: Path) -> None:
    from zerosafe.errors import StorageError
    from zerosafe.io.storage import Storage

    sink = Storage().open_sink(str(small_tmpfs / "big.bin"))
    with pytest.raises(StorageError, match=r"big\.bin: no space left on device .*free space there"):
        for _ in range(100):
            sink.write(b"\0" * 2**20)
    assert list(small_tmpfs.iterdir()) == [], "the partial file was left behind"


def test_ctrl_c_stops_cleanly_and_the_same_command_resumes(
    prefect_env: dict[str, str], medium_ckpt: Path, reference_small_shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = _one_at_a_time(medium_ckpt, out)
    proc = subprocess.Popen(
        [sys.executable, "-m", "zerosafe_app.cli", "convert", *args],
        env=prefect_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    work_root = out / ".zerosafe-work"
    _wait_for(lambda: any(work_root.glob("*/journal/merge-*")), 600, "merges to start")
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole group
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted; nothing was marked complete" in stderr and "Traceback" not in stderr
    assert (
        not (out / "zerosafe-complete.json").exists()
        and not (out / "model.safetensors.index.json").exists()
    )
    assert not list(out.glob(".*.partial")), "a temporary file was left behind"
    summary = convert_json(prefect_env, *args)
    assert summary["status"] == "converted" and summary["tasks_executed"]["extract"] == 0
    _same_output(out, reference_small_shards)
