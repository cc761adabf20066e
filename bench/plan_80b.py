"""The 80B plan on paper: `zerosafe inspect --simulate` at world sizes 64 and 256, as Markdown.

    .venv/bin/python bench/plan_80b.py [--spec conf/simulate-80b.yaml] [--out bench/reported/plan-80b.md]

Builds the real plan (zerosafe's own `build_plan`) for the metadata-only spec, with the
options of the `convert/80b` deployment (conf/80b.yaml: bf16, 5 GB shards, an 8 GB worker
budget, 4 tasks per worker, 4 GB extract parts), in staged mode (the deployment's, for S3) and
direct mode (local or NFS), and writes the task table and the predicted wall times.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from zerosafe.config import ConvertOptions  # noqa: E402
from zerosafe.formats.deepspeed.simulate import (  # noqa: E402
    DEFAULT_TASK_RATE_BYTES,
    load_spec,
    simulate_plan,
    simulation_report,
)
from zerosafe.units import format_bytes  # noqa: E402

WORKERS = (1, 4, 16, 64)
STORAGE = (  # (label, aggregate bytes/s, seconds per ranged read)
    ("local/NFS, 1 GB/s", 1e9, 0.0),
    ("S3, 10 GB/s, 30 ms per read", 10e9, 0.03),
    ("S3, 40 GB/s, 30 ms per read", 40e9, 0.03),
)


def _t(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s >= 600 else f"{s / 60:.1f} min"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=os.path.join(REPO, "conf", "simulate-80b.yaml"))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "reported", "plan-80b.md"))
    ap.add_argument("--task-rate", type=float, default=DEFAULT_TASK_RATE_BYTES)
    args = ap.parse_args(argv)
    reports = []  # (report per storage profile) per (world size, mode)
    for ws in (64, 256):
        spec = load_spec(args.spec, world_size=ws)
        for direct in (False, True):
            options = ConvertOptions(
                dtype="bf16", max_shard_size=5 * 10**9, memory=8 * 10**9,
                max_parallel_tasks=4, extract_part_size=4 * 10**9, direct=direct,
            )  # fmt: skip
            _, plan = simulate_plan(spec, options)
            reports.append([
                simulation_report(
                    spec, plan, options, workers=WORKERS, bandwidths=[bandwidth],
                    task_rate=args.task_rate, request_latency=latency,
                )
                # direct mode reads the checkpoint's own files: a local or NFS source
                for _, bandwidth, latency in (STORAGE[:1] if direct else STORAGE)
            ])  # fmt: skip
    r0 = reports[0][0]
    lines = [
        f"### The 80B plan, on paper (`zerosafe inspect --simulate {os.path.relpath(args.spec, REPO)}`)",
        "",
        f"{r0['name']}: {r0['num_params'] / 1e9:.1f}B parameters (Llama-style: hidden 8192, 92 "
        "layers, GQA with 8 KV heads, vocab 128256, untied), ZeRO-3, trained in bf16. fp32 "
        f"masters {format_bytes(r0['fp32_bytes'])}, checkpoint {format_bytes(r0['checkpoint_bytes'])} "
        f"(with Adam's moments); output bf16 {format_bytes(r0['output_bytes'])} in "
        f"{r0['tasks']['merge_output_bytes']['count']} shards of at most 5 GB. Options as "
        "conf/80b.yaml: an 8 GB worker budget, 4 tasks per worker, 4 GB extract parts. The plan "
        "is zerosafe's own (`build_plan` on a checkpoint laid out from shapes, no file read); "
        "the plan of a forged checkpoint of the same shapes is identical "
        "(tests/bench/test_simulate.py).",
        "",
        "| world size | mode | files | fragments | extract tasks (bytes each) | merge tasks: reads each "
        "(ranged reads) | writes each | verify tasks | memory per task |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r, *rest in reports:
        t = r["tasks"]
        s3 = rest[0]["tasks"]["requests_per_merge"] if rest else None
        coalesced = f"; {s3['median']:,} requests from S3" if s3 and s3["count"] else ""
        extract = (
            f"{t['extract']['count']} ({format_bytes(t['extract']['median'])})"
            if t["extract"]["count"]
            else "none"
        )
        lines.append(
            f"| {r['world_size']} | {r['mode']} | {r['files']} | {r['num_fragments']:,} | {extract} | "
            f"{t['merge_source_bytes']['count']}: {format_bytes(t['merge_source_bytes']['median'])} "
            f"(max {format_bytes(t['merge_source_bytes']['max'])}; ~{t['reads_per_merge']['median']:,} reads{coalesced}) | "
            f"{format_bytes(t['merge_output_bytes']['median'])} | {t['verify']['count']} | "
            f"{format_bytes(r['memory']['task_bytes'])} ({format_bytes(r['memory']['chunk_bytes'])} chunks) |"
        )
    lines += [
        "",
        f"Predicted wall time (model in `zerosafe/formats/deepspeed/simulate.py`: every running task moves its bytes "
        f"at min({format_bytes(args.task_rate)}/s, aggregate bandwidth / running tasks); 4 tasks "
        "per worker; staged runs every extract before the merges, as ZeRO-3 shards need every "
        f"rank). {format_bytes(args.task_rate)}/s per task is about what one task moved on the "
        "2-core benchmark machine (bench/reported/7b.json). From S3 each merge's reads are "
        "coalesced (`zerosafe.io.coalesce`): the requests are the engine's own plan of the "
        "fragments within the task's prefetch budget, 8 in flight, each waiting the latency "
        "(measured: bench/reported/s3-requests.json).",
        "",
        "| world size | mode | storage | "
        + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in WORKERS)
        + " |",
        "|---|---|---|" + "---|" * len(WORKERS),
    ]
    for group in reports:
        for (label, _, _), r in zip(STORAGE, group, strict=False):
            cells = [_t(p["seconds"]) for p in r["predictions"]]
            lines.append(
                f"| {r['world_size']} | {r['mode']} | {label} | " + " | ".join(cells) + " |"
            )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
