"""How a conversion scales with cores: the same merge + verify units the flow runs, N at once.

    .venv/bin/python bench/scaling.py --params 2B --tasks 1,2,4,8,16
    taskset -c 0 .venv/bin/python bench/scaling.py --tasks 1        # one core

The flow `convert` runs up to `--parallel` merge tasks at once, each merging one output shard
and then verifying it (`zerosafe.pipeline.merge_unit`, `verify_unit`), as threads of one
process. This runs exactly those units on a thread pool of N workers over a forged ZeRO-3
checkpoint (bench/forge/), with the output cut into at least 2 x max(N) shards, warm cache (the
point is CPU: a GIL-bound hot loop would show up as no speed-up past one task), and prints, per
N: wall time, CPU seconds, fp32 throughput, the speed-up over N=1 and the parallel efficiency
(speed-up / N). No Prefect is needed (it measures the engine's units, not the scheduler), so it
runs on machines that have only torch, numpy, safetensors, pyarrow and xxhash.
Every output is checked against the forge's values before it is deleted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
if "--src" in sys.argv:  # measure another checkout's engine (its `zerosafe` comes first)
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--src") + 1]))

from bench._check import check_output  # noqa: E402


def _load_probe() -> Any:
    """This checkout's bench/_cpu_probe.py, also under `--src` (whose bench may predate it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_zerosafe_cpu_probe", os.path.join(REPO, "bench", "_cpu_probe.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_probe = _load_probe()
proc_stat, stat_cpus = _probe.proc_stat, _probe.stat_cpus
from bench._iolimit import fp32_ranges, measure_limit, warm_cache  # noqa: E402
from bench._membw import copy_scaling  # noqa: E402
from bench.run import _files, forge  # noqa: E402


def _cpu_seconds() -> float:
    """User + system CPU of this process and of its live children (the worker processes of
    `--workers processes` live across the timed units, so `os.times()`'s reaped-children
    counters would miss them)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # exited between the listing and the read
            pass
    return total


def _busy(cpus: dict[str, float]) -> float:
    return sum(v for k, v in cpus.items() if k not in ("idle", "iowait", "steal"))


def run_once(
    ckpt: str, out: str, tasks: int, shard_bytes: int, dtype: str, workers: str = "threads"
) -> dict[str, Any]:
    """Plan, then merge + verify every shard with `tasks` workers, then publish."""
    from zerosafe.config import ConvertOptions
    from zerosafe.io.storage import Storage
    from zerosafe.pipeline import (
        WorkLayout,
        finish_job,
        hold_work,
        merge_unit,
        plan_job_and_load,
        publish_job,
        run_stats,
        verify_unit,
    )

    try:
        from zerosafe.cast import serial_torch
    except ImportError:  # a checkout from before zerosafe.cast
        try:
            from zerosafe.stages.streaming import serial_torch
        except ImportError:  # from before serial_torch
            serial_torch = None
    if serial_torch is not None:
        serial_torch()  # as the command and the flow's tasks do
    try:
        from zerosafe.pipeline import merge_streams
    except ImportError:  # a checkout from before merges in streams
        merge_streams = None
    copy: dict[str, Any] = {}
    try:  # as the command does: the run's copy policy goes with each unit
        from zerosafe.stages.streaming import CopyPolicy

        copy = {"copy": CopyPolicy(os.environ.get("ZEROSAFE_COPY") or "auto", tasks)}
    except ImportError:  # a checkout from before CopyPolicy: a setting of the process
        try:
            from zerosafe.stages.streaming import set_tasks_at_once

            set_tasks_at_once(tasks)
        except ImportError:  # a checkout from before the fused copy
            pass
    shutil.rmtree(out, ignore_errors=True)
    storage = Storage()
    options = ConvertOptions(
        dtype=dtype, max_shard_size=shard_bytes, memory=tasks * 2**30, max_parallel_tasks=tasks,
        direct=True,
    )  # fmt: skip
    job, plan = plan_job_and_load(storage, ckpt, out, options)
    assert plan is not None
    work = WorkLayout(job.work_url)
    pool = None
    if workers == "processes":  # the in-process command's worker processes, started first
        from zerosafe.run.workers import Shared, UnitPool

        pool = UnitPool(tasks, shared={"plan": plan})
        if hasattr(pool, "start"):
            pool.start()
        else:  # a checkout from before UnitPool.start: tasks calls at once start most workers
            with ThreadPoolExecutor(tasks) as starters:
                list(starters.map(lambda _: pool.run(time.sleep, 0.2), range(tasks)))
    stat0 = proc_stat()
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    with hold_work(storage, job):
        spans: list[tuple[float, float]] = []
        started = itertools.count()

        def streams(shard: int) -> dict[str, int]:
            """As the command gives them (`merge_streams`; a checkout from before: none)."""
            position = next(started)
            if merge_streams is None:
                return {}
            return {"streams": merge_streams(position, len(plan.shards), tasks, options)}

        def unit(shard: int) -> tuple[Any, Any]:
            begun = time.perf_counter()
            try:
                return run_unit(shard)
            finally:
                spans.append((begun - t0, time.perf_counter() - t0))

        def run_unit(shard: int) -> tuple[Any, Any]:
            extra = {**streams(shard), **copy}
            if pool is not None:
                merged = pool.run(
                    merge_unit, Shared("plan"), shard, storage, job.destination, work, options,
                    **extra,
                )  # fmt: skip
                return merged, pool.run(
                    verify_unit, Shared("plan"), shard, storage, job.destination, options,
                    expected=merged.tensors,
                )  # fmt: skip
            merged = merge_unit(plan, shard, storage, job.destination, work, options, **extra)
            verified = verify_unit(
                plan, shard, storage, job.destination, options, expected=merged.tensors
            )
            return merged, verified

        with ThreadPoolExecutor(max_workers=tasks) as runners:
            results = list(runners.map(unit, range(len(plan.shards))))
        units_s = time.perf_counter() - t0
        units_cpu_s = _cpu_seconds() - cpu0  # before the worker processes exit
        machine = stat_cpus(stat0, proc_stat(), units_s)
        if pool is not None:
            pool.close()
        merges = [m for m, _ in results]
        verifies = [v for _, v in results]
        stats = run_stats(
            job, options, extracts=[], merges=merges, verifies=verifies, seconds=units_s,
            tasks_executed={"merge": len(merges), "verify": len(verifies)}, peak_rss_bytes=0,
        )  # fmt: skip
        publish_job(
            plan, storage, job.destination, work, options, extracts=[], merges=merges,
            verifies=verifies, stats=stats,
        )  # fmt: skip
        finish_job(
            storage, destination=job.destination, job_key=job.job_key, work_url=job.work_url,
            keep_work=False,
        )  # fmt: skip
    spans.sort(key=lambda span: span[1])
    lengths = sorted(end - begin for begin, end in spans)
    # From when the first task found no unit left to start until the last unit ended.
    last_start = max(begin for begin, _ in spans)
    return {
        "unit_s_median": round(lengths[len(lengths) // 2], 3),
        "unit_s_max": round(lengths[-1], 3),
        "tail_s": round(spans[-1][1] - min(e for _, e in spans if e >= last_start), 3),
        "tasks": tasks,
        "workers": workers,
        "shards": len(plan.shards),
        "units_s": units_s,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": units_cpu_s,
        "machine_cpus": machine,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="2B")
    ap.add_argument("--tasks", default="1,2,4,8,16")
    ap.add_argument("--work-dir", default=os.path.join(REPO, "bench", "results", "work"))
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeat", type=int, default=2, help="runs per N (the best is kept)")
    ap.add_argument("--check", default="sample", choices=("full", "sample"))
    ap.add_argument("--src", help="a checkout whose engine to measure (default: this one)")
    ap.add_argument("--out-dir", help="where outputs go (default: in --work-dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--workers", default="threads", choices=("threads", "processes"),
        help="units as threads of this process, or in worker processes (zerosafe.run.workers)",
    )  # fmt: skip
    cfg = ap.parse_args(argv)
    counts = [int(x) for x in cfg.tasks.split(",")]
    ckpt = os.path.join(cfg.work_dir, f"ckpt-{cfg.params}-z3-ws8")
    out = os.path.join(cfg.out_dir or cfg.work_dir, "scaling-out")
    os.makedirs(cfg.work_dir, exist_ok=True)
    info = forge(ckpt, cfg.params, world_size=8, stage=3, seed=0)
    fp32 = sum(int(x) for x in [info.get("fp32_bytes", 0)]) or 4 * int(info["num_params"])
    out_bytes = fp32 // (2 if cfg.dtype in ("bf16", "fp16") else 1)
    shard_bytes = max(16 * 2**20, out_bytes // (2 * max(counts)))
    warm_cache(_files(ckpt))
    ranges, _ = fp32_ranges(ckpt)
    streams = min(8, max(counts))
    limit = measure_limit(ranges, out, out_bytes, overlapped=True, threads=8, writers=streams)
    shutil.rmtree(out, ignore_errors=True)
    print(
        f"I/O limit (overlapped, 8 reader threads, {streams} writer stream(s), warm): "
        f"{limit['total_s']:.2f} s",
        flush=True,
    )
    membw = copy_scaling(max(counts))
    print(
        f"memory copy: 1 process {membw['one_gbps']:.1f} GB/s, {membw['processes']} at once "
        f"{membw['many_gbps']:.1f} GB/s ({membw['scaling']:.2f}x): the ceiling on the speed-up "
        "of a memory-bound copy",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    for n in counts:
        best: dict[str, Any] | None = None
        for _ in range(cfg.repeat):
            row = run_once(ckpt, out, n, shard_bytes, cfg.dtype, cfg.workers)
            if best is None or row["units_s"] < best["units_s"]:
                best = row
        assert best is not None
        check = check_output(
            out, params={k: tuple(v) for k, v in info["params"].items()},
            buffers={k: (tuple(v[0]), v[1]) for k, v in info["buffers"].items()},
            seed=info["seed"], out_dtype=cfg.dtype, mode=cfg.check,
        )  # fmt: skip
        best["ok"] = bool(check["ok"])
        shutil.rmtree(out, ignore_errors=True)
        rows.append(best)
        print(json.dumps(best), flush=True)
    base = rows[0]["units_s"] * rows[0]["tasks"]
    print(
        f"\n{info['num_params'] / 1e9:.2f}B params, fp32 {fp32 / 1e9:.2f} GB -> {cfg.dtype}, "
        f"{rows[0]['shards']} shards; {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}); warm cache; "
        f"output in {os.path.dirname(out)}; I/O limit {limit['total_s']:.2f} s "
        f"({fp32 / limit['total_s'] / 1e9:.2f} GB/s of fp32)"
    )
    print(
        "tasks | merge+verify s | CPU s | fp32 GB/s | speed-up | efficiency | output ok "
        "| machine's CPUs busy / idle / steal | unit s median / max | tail s"
    )
    print("---|---|---|---|---|---|---|---|---|---")
    for r in rows:
        speedup = base / r["units_s"]
        r["speedup"], r["efficiency"] = speedup, speedup / r["tasks"]
        print(
            f"{r['tasks']} | {r['units_s']:.2f} | {r['cpu_s']:.1f} | {fp32 / r['units_s'] / 1e9:.2f} "
            f"| {speedup:.2f}x | {r['efficiency']:.2f} | {r['ok']} "
            f"| {_busy(r['machine_cpus']):.1f} / {r['machine_cpus']['idle']:.1f} / "
            f"{r['machine_cpus']['steal']:.1f} | {r['unit_s_median']:.2f} / {r['unit_s_max']:.2f} "
            f"| {r['tail_s']:.2f}"
        )
    if cfg.json:
        with open(cfg.json, "w") as f:
            json.dump(
                {
                    "params": cfg.params,
                    "fp32_bytes": fp32,
                    "cpus": os.cpu_count(),
                    "io_limit": limit,
                    "memory_copy": membw,
                    "rows": rows,
                },
                f,
                indent=1,
            )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
