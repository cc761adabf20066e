"""Benchmark zerosafe against DeepSpeed's converter and against the machine's I/O limit.

    .venv/bin/python bench/run.py --size quick      # ~0.5B params, warm and cold, ~10 min
    .venv/bin/python bench/run.py --size 7b         # 7B: fp32 masters (28 GB) > RAM, cold
    .venv/bin/python bench/run.py --format dcp --size quick   # a DCP checkpoint (bench/run_dcp.py)
    .venv/bin/python bench/run.py --format hf-sharded --size quick   # torch's HF writer, against
        # torch's consolidation (also bytecheckpoint, safetensors: bench/run_hf.py)
    .venv/bin/python bench/run_quantize.py --size quick   # --quantize fp8-block against the
        # bf16 conversion and the two-step route (bf16, then transformers' quantizer)

One run forges a ZeRO-3 checkpoint (bench/forge/: deterministic values, Adam moments as
sparse holes), then, on the same files and in the same run, measures:

- `io-limit`: reading the fp32 master bytes once plus writing the output bytes once (fsynced);
  serial (the issue's definition) and overlapped (the two at once). See `bench/_iolimit.py`.
- `zerosafe direct` / `zerosafe staged`: the engine driver (`zerosafe convert --via local`).
- `cli default` / `cli direct` / `cli staged`: the real command line (`zerosafe convert`),
  with no mode flag (what a user types), `--direct` and `--mode staged`; `cli prefect` is the
  command with `--via prefect` (the Prefect flow, on a private server the command starts);
  `cli overhead` is the command on a tiny checkpoint: its fixed cost. Every command is a
  first command: a new `PREFECT_HOME` for each run, no `PREFECT_API_URL`, and nothing of
  zerosafe's running before it (a checkout from before 2026-11-26, `--before`, then starts
  its local Prefect server in that run, as a user's first command did).
- `deepspeed`: `deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_state_dict` with
  safetensors output, the same dtype and the same shard size, in a subprocess
  (DS_ACCELERATOR=cpu). It does not fsync; the harness times an fsync of its output after it
  exits (`+sync`), so all rows compare durable outputs.
- `baseline`: a process that only imports what a conversion imports (its RSS is the
  interpreter baseline the memory budget is added to).

Each command runs as a measured process tree (`bench/_measure.py`): wall time, peak RSS of the
tree sampled every 50 ms (all resident pages, and the anonymous part alone), bytes through
read/write calls and bytes at the block device; a watchdog kills it past `--mem-limit` of
anonymous memory (or when the machine runs short) and records that. Every output is checked
against the forge's values (`bench/_check.py`) and then deleted. `warm`: the checkpoint files
are read into the page cache first; `cold`: they are evicted with posix_fadvise(DONTNEED)
(per file, nothing system-wide); the fp32 masters of `7b` do not fit in RAM, so it runs cold.

Results: `bench/results/<size>.json` (all runs plus the summary table), and the table printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import forge as F  # noqa: E402
from bench._check import check_output  # noqa: E402
from bench._first_command import command_env, json_tail, stop_leftovers, sync_tree  # noqa: E402
from bench._iolimit import (  # noqa: E402
    drop_cache,
    fp32_ranges,
    measure_limit,
    residency,
    warm_cache,
)
from bench._measure import Measured, meminfo_bytes, run_measured  # noqa: E402

PY = sys.executable


def _zerosafe_command(src: str) -> list[str]:
    """The command, as `python -m` so that `--src`/`--before` checkouts run their own entry
    point (`zerosafe_app.cli`; `zerosafe.cli` in checkouts from before the package layout)."""
    new = os.path.exists(os.path.join(src, "zerosafe_app", "cli.py"))
    return [PY, "-m", "zerosafe_app.cli" if new else "zerosafe.cli"]


SIZES: dict[str, dict[str, Any]] = {
    # tests: seconds, exercises every kind of run
    "tiny": {"params": "20M", "repeat": 1, "caches": ["warm", "cold"]},
    "quick": {"params": "500M", "repeat": 3, "caches": ["warm", "cold"]},
    "2b": {"params": "2B", "repeat": 1, "caches": ["warm", "cold"]},
    # fp32 masters 28 GB > 24 GB of RAM: only cold makes sense; staged needs 28 GB more disk
    "7b": {"params": "7B", "repeat": 1, "caches": ["cold"]},
}
KINDS = [
    "io-limit",
    "zerosafe-direct",
    "zerosafe-staged",
    "cli-default",
    "cli-direct",
    "cli-staged",
    "cli-prefect",
    "deepspeed",
]
TABLE_KINDS = [
    "zerosafe-direct",
    "zerosafe-direct-before",
    "zerosafe-staged",
    "zerosafe-staged-before",
    "cli-default",
    "cli-default-before",
    "cli-direct",
    "cli-staged",
    "cli-prefect",
    "deepspeed",
]
BEFORE_KINDS = ("zerosafe-direct", "zerosafe-staged", "cli-default")
"""Kinds `--before` also runs from the other checkout, right after this one's."""
EXTRA = ["baseline", "cli-overhead"]
DEFAULT_KINDS = KINDS + EXTRA
DISK_BUDGET_BYTES = 45 * 10**9
FORMATS = ("deepspeed", "dcp", "hf-sharded", "bytecheckpoint", "safetensors")


def _parse_size(text: str) -> int:
    from zerosafe.units import parse_size

    return parse_size(text)


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _du(path: str) -> int:
    """Bytes allocated on disk under `path` (sparse holes excluded)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _files(ckpt: str) -> list[str]:
    out = []
    for root, _, files in os.walk(ckpt):
        out += [os.path.join(root, f) for f in files if f.endswith(".pt")]
    return sorted(out)


SRC = REPO
"""Where the measured zerosafe is imported from (`--src`: compare another checkout)."""


def _env(prefect_home: str | None = None) -> dict[str, str]:
    """The environment of a measured command; `prefect_home`: a new, empty `PREFECT_HOME`."""
    return command_env(src=SRC, repo=REPO, prefect_home=prefect_home)


# -- forging -------------------------------------------------------------------------------------


def forge(ckpt: str, params: str, *, world_size: int, stage: int, seed: int) -> dict[str, Any]:
    """Forge (or reuse) the checkpoint; its ForgeInfo is kept beside it as JSON."""
    info_path = ckpt + ".forge.json"
    want = {"params": params, "world_size": world_size, "stage": stage, "seed": seed}
    if os.path.exists(info_path):
        with open(info_path) as f:
            saved = json.load(f)
        if saved.get("request") == want and os.path.exists(os.path.join(ckpt, "latest")):
            saved["reused"] = True
            return saved
    shutil.rmtree(ckpt, ignore_errors=True)
    shapes = F.transformer_shapes(params, tied=False)
    info = F.forge_checkpoint(
        ckpt, shapes=shapes, stage=stage, world_size=world_size, dtype="bf16",
        tied=False, seed=seed, moments="sparse",
    )  # fmt: skip
    t = time.perf_counter()
    for path in _files(ckpt):  # make them durable so a cold run can evict every page
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    data = dataclasses.asdict(info)
    data["seconds"] += time.perf_counter() - t
    data["request"] = want
    data["num_params"] = sum(math.prod(s) for s in info.params.values())
    with open(info_path, "w") as f:
        json.dump(data, f)
    data["reused"] = False
    return data


# -- one run -------------------------------------------------------------------------------------


def _result_line(text: str, prefix: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            return dict(json.loads(line[len(prefix) :]))
    return None


def run_tool(
    kind: str,
    ckpt: str,
    out: str,
    cfg: argparse.Namespace,
    forged: dict[str, Any],
    *,
    src: str | None = None,
) -> dict[str, Any]:
    """Run one converter as a measured process, check its output, delete it.

    `src`: import zerosafe from this checkout instead of `--src` (the `before` variants).
    """
    global SRC
    saved, SRC = SRC, src or SRC
    try:
        row = _run_tool(kind, ckpt, out, cfg, forged)
    finally:
        SRC = saved
    return row


def _run_tool(
    kind: str, ckpt: str, out: str, cfg: argparse.Namespace, forged: dict[str, Any]
) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    common = ["--dtype", cfg.dtype, "--max-shard-size", cfg.max_shard_size]
    if kind == "deepspeed":
        argv = [PY, os.path.join(REPO, "bench", "_ds_convert.py"), ckpt, out, *common]
        env = {**_env(), "DS_ACCELERATOR": "cpu"}
    else:
        argv = [*_zerosafe_command(SRC), "convert", ckpt, out, *common, "--json", "--quiet"]
        # `cli-default` is the command as a user types it: no mode flag. The others name
        # their mode; a checkout from before `--mode` existed takes `--direct` (its only form
        # there) or nothing.
        if "direct" in kind:
            argv += ["--mode", "direct"] if _has_mode_flag(SRC) else ["--direct"]
        elif "staged" in kind and _has_mode_flag(SRC):
            argv += ["--mode", "staged"]
        if kind.startswith("zerosafe"):
            argv += ["--via", "local"] if _has_flag(SRC, '"--via"') else ["--no-flow"]
        elif kind == "cli-prefect":
            argv += ["--via", "prefect"]
        env = _env(prefect_home=tempfile.mkdtemp(prefix="zerosafe-bench-prefect-home-"))
    # `python -m` imports from the working directory first: run in the measured checkout.
    cwd = REPO if kind == "deepspeed" else SRC
    try:
        m: Measured = run_measured(
            argv, env=env, cwd=cwd, limit_bytes=cfg.mem_limit, timeout_s=cfg.timeout
        )
    finally:
        if kind != "deepspeed":
            stop_leftovers(env["PREFECT_HOME"])
    row: dict[str, Any] = {"kind": kind, **m.as_dict(tail=1500)}
    row["out_bytes_on_disk"] = _du(out) if os.path.isdir(out) else 0
    if kind == "deepspeed":
        res = _result_line(m.stdout, "RESULT ") or {}
        row["tool"] = res
        row["internal_s"] = res.get("convert_s")
        row["ok"] = bool(res.get("ok")) and m.returncode == 0 and m.killed is None
        if not row["ok"] and m.killed is None:
            row["error"] = res.get("error") or m.stderr[-800:]
        if row["ok"]:
            row["sync_s"] = sync_tree(out)
            row["internal_s"] = res["convert_s"] + row["sync_s"]
    else:
        summary = json_tail(m.stdout) or {}
        row["tool"] = {
            k: summary.get(k)
            for k in ("seconds", "bytes_read", "source_bytes_read", "fp32_bytes", "bytes_written",
                      "peak_rss_bytes", "mode", "status")
        }  # fmt: skip
        row["internal_s"] = summary.get("seconds")
        row["ok"] = m.returncode == 0 and summary.get("status") == "converted"
        if not row["ok"]:
            row["error"] = m.killed or m.stderr[-800:]
    if row["ok"]:
        t = time.perf_counter()
        row["check"] = check_output(
            out, params={k: tuple(v) for k, v in forged["params"].items()},
            buffers={k: (tuple(v[0]), v[1]) for k, v in forged["buffers"].items()},
            seed=forged["seed"], out_dtype=cfg.dtype, mode=cfg.check,
        )  # fmt: skip
        row["check"]["seconds"] = round(time.perf_counter() - t, 2)
        row["ok"] = row["check"]["ok"]
    shutil.rmtree(out, ignore_errors=True)
    return row


def _has_flag(src: str, flag: str) -> bool:
    """Whether the command line of the checkout at `src` defines `flag` (quoted): in its
    parser, or in the option table the parser's flags come from."""
    for cli in ("zerosafe_app/cli.py", "zerosafe_app/option_table.py", "zerosafe/cli.py"):
        with contextlib.suppress(OSError), open(os.path.join(src, cli)) as f:
            if flag in f.read():
                return True
    return False


def _has_mode_flag(src: str) -> bool:
    """Whether the checkout at `src` has `zerosafe convert --mode` (staged is not its default)."""
    return _has_flag(src, '"--mode"')


def run_limit(
    ranges: list[tuple[str, int, int]], out_bytes: int, out: str, overlapped: bool
) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    res = measure_limit(ranges, out, out_bytes, overlapped=overlapped)
    shutil.rmtree(out, ignore_errors=True)
    return {"kind": "io-limit", "ok": True, **res, "wall_s": res["total_s"],
            "internal_s": res["total_s"]}  # fmt: skip


def run_baseline(cfg: argparse.Namespace) -> dict[str, Any]:
    code = (
        "import torch, numpy, safetensors, pyarrow.parquet, zerosafe.pipeline, zerosafe.verify.tensors, "
        "zerosafe_app.cli, time; time.sleep(0.5)"
    )
    m = run_measured([PY, "-c", code], env=_env(), cwd=REPO, limit_bytes=cfg.mem_limit)
    return {"kind": "baseline", "ok": m.returncode == 0, **m.as_dict(tail=500)}


# -- the table -----------------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(
    runs: list[dict[str, Any]], forged: dict[str, Any], cfg: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    caches = sorted({r["cache"] for r in runs if r.get("cache")}, key=["warm", "cold"].index)
    for cache in caches:
        limits = [r for r in runs if r["kind"] == "io-limit" and r["cache"] == cache]
        serial = [r for r in limits if r["mode"] == "serial"]
        over = [r for r in limits if r["mode"] == "overlapped"]
        limit_s = _median(serial, "total_s")
        over_s = _median(over, "total_s")
        for label, group in (("io-limit serial", serial), ("io-limit overlapped", over)):
            if group:
                rows.append({
                    "tool": label, "cache": cache, "runs": len(group), "ok": True,
                    "seconds": _median(group, "total_s"),
                    "read_s": _median(group, "read_s"), "write_s": _median(group, "write_s"),
                    "write_plain_s": _median(group, "write_plain_s"),
                    "write_early_writeback_s": _median(group, "write_early_writeback_s"),
                })  # fmt: skip
        for kind in TABLE_KINDS:
            group = [r for r in runs if r["kind"] == kind and r.get("cache") == cache]
            if not group:
                continue
            good = [r for r in group if r.get("ok")]
            row: dict[str, Any] = {
                "tool": kind, "cache": cache, "runs": len(group), "ok": len(good) == len(group),
                "wall_s": _median(group, "wall_s"),
                "seconds": _median(good, "internal_s") if good else None,
                "peak_rss_bytes": max(r["peak_rss_bytes"] for r in group),
                "peak_anon_bytes": max(r["peak_anon_bytes"] for r in group),
                "cpu_s": _median(group, "cpu_s"),
                "load": _median(group, "load_before"),
                "rchar": _median(group, "rchar"), "wchar": _median(group, "wchar"),
                "read_bytes": _median(group, "read_bytes"),
                "write_bytes": _median(group, "write_bytes"),
                "killed": next((r["killed"] for r in group if r.get("killed")), None),
                "error": next((r["error"][-300:] for r in group if r.get("error")), None),
                "checked": [r["check"]["mode"] + (" ok" if r["check"]["ok"] else " FAILED")
                            for r in group if "check" in r][:1],
            }  # fmt: skip
            if row["seconds"] and limit_s:
                row["time_over_limit"] = row["seconds"] / limit_s
                row["speed_vs_limit"] = limit_s / row["seconds"]
                if over_s:
                    row["speed_vs_overlapped_limit"] = over_s / row["seconds"]
            if row["wall_s"] and limit_s:
                row["wall_speed_vs_limit"] = limit_s / row["wall_s"]
            rows.append(row)
    zs = {r["cache"]: r for r in rows if r["tool"] == "zerosafe-direct"}
    for r in rows:
        if r["tool"] == "deepspeed" and r["cache"] in zs:
            z = zs[r["cache"]]
            if z.get("seconds") and r.get("seconds"):
                r["deepspeed_over_zerosafe_time"] = r["seconds"] / z["seconds"]
            if z.get("wall_s") and r.get("wall_s") and r["ok"]:
                r["deepspeed_over_zerosafe_wall"] = r["wall_s"] / z["wall_s"]
            r["memory_ratio"] = r["peak_rss_bytes"] / max(z["peak_rss_bytes"], 1)
            r["anon_memory_ratio"] = r["peak_anon_bytes"] / max(z["peak_anon_bytes"], 1)
    return rows


def render(
    rows: list[dict[str, Any]],
    extra: dict[str, Any],
    forged: dict[str, Any],
    cfg: argparse.Namespace,
) -> str:
    head = (
        f"{cfg.size}: {forged['num_params'] / 1e9:.2f}B params, ZeRO-{forged['stage']} ws "
        f"{forged['world_size']}, fp32 masters {_gb(forged['fp32_bytes'])} GB -> {cfg.dtype} "
        f"({_gb(extra['out_bytes'])} GB), shards of {cfg.max_shard_size}; {cfg.check} output check"
    )
    cols = ("tool", "cache", "n", "wall s", "conv s", "speed/limit", "t/limit", "cpu s", "load",
            "peak RSS GB", "anon GB", "rchar GB", "disk rd GB", "wchar GB", "ok")  # fmt: skip
    lines = [head, " | ".join(cols)]
    for r in rows:
        if r["tool"].startswith("io-limit"):
            cells = [r["tool"], r["cache"], str(r["runs"]), "-", f"{r['seconds']:.2f}",
                     "1.00" if "serial" in r["tool"] else "-", "-", "-", "-", "-", "-", "-", "-",
                     "-",
                     f"read {r['read_s']:.2f} s + write {r['write_s']:.2f} s"
                     + (f" (plain {r['write_plain_s']:.2f} s, early writeback "
                        f"{r['write_early_writeback_s']:.2f} s)" if r.get("write_plain_s") else "")]  # fmt: skip
        else:
            ok = "yes" if r["ok"] else ("KILLED: " + r["killed"] if r.get("killed") else "FAILED")
            cells = [
                r["tool"], r["cache"], str(r["runs"]), f"{r['wall_s']:.2f}",
                "-" if r.get("seconds") is None else f"{r['seconds']:.2f}",
                f"{r['speed_vs_limit']:.2f}" if r.get("speed_vs_limit") else "-",
                f"{r['time_over_limit']:.2f}" if r.get("time_over_limit") else "-",
                f"{r['cpu_s']:.1f}", f"{r['load']:.1f}",
                _gb(r["peak_rss_bytes"]), _gb(r["peak_anon_bytes"]), _gb(r["rchar"]),
                _gb(r["read_bytes"]), _gb(r["wchar"]), ok,
            ]  # fmt: skip
        lines.append(" | ".join(cells))
    for r in rows:
        if r["tool"] == "deepspeed" and r.get("deepspeed_over_zerosafe_time"):
            lines.append(
                f"deepspeed/zerosafe-direct ({r['cache']}): wall x{r.get('deepspeed_over_zerosafe_wall', 0):.2f}, "
                f"conversion x{r['deepspeed_over_zerosafe_time']:.2f}, "
                f"peak RSS x{r['memory_ratio']:.2f} (anonymous x{r['anon_memory_ratio']:.2f})"
            )
    if extra.get("baseline_rss_bytes"):
        lines.append(
            f"interpreter baseline (imports of a conversion): RSS {_gb(extra['baseline_rss_bytes'])} GB; "
            f"budget {_gb(_parse_size('1GB'))} GB -> bound {_gb(extra['baseline_rss_bytes'] + _parse_size('1GB'))} GB"
        )
    if extra.get("cli_overhead"):
        o = extra["cli_overhead"]
        lines.append(
            f"cli fixed overhead (tiny checkpoint, embedded Prefect): wall {o['wall_s']:.1f} s, "
            f"flow body {o.get('seconds') or 0:.1f} s, peak RSS {_gb(o['peak_rss_bytes'])} GB"
        )
    for note in extra.get("notes", []):
        lines.append("note: " + note)
    return "\n".join(lines)


def rerender(path: str) -> int:
    """Rebuild `summary` and `table` of a results file from its runs (after a table change)."""
    with open(path) as f:
        result = json.load(f)
    cfg = argparse.Namespace(**result["config"])
    forged = {**result["checkpoint"], "fp32_bytes": result["plan"]["fp32_bytes"]}
    result["summary"] = summarize(result["runs"], forged, cfg)
    result["table"] = render(result["summary"], result["extra"], forged, cfg)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(result["table"])
    return 0


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--format", default="deepspeed", choices=FORMATS)
    known, rest = first.parse_known_args(argv)
    if known.format == "dcp":  # a forged DCP checkpoint: bench/run_dcp.py
        from bench import run_dcp

        return run_dcp.main(rest)
    if known.format != "deepspeed":  # a save by torch or ByteCheckpoint: bench/run_hf.py
        from bench import run_hf

        return run_hf.main(["--layouts", known.format, *rest])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", default="deepspeed", choices=FORMATS,
                    help="dcp: a forged PyTorch DCP checkpoint instead (bench/run_dcp.py); "
                    "hf-sharded, bytecheckpoint, safetensors: a save by torch or ByteCheckpoint "
                    "against the framework's own tool (bench/run_hf.py)")  # fmt: skip
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--params", help="override the size's param count (e.g. 1B)")
    ap.add_argument("--work-dir", default=os.path.join(REPO, "bench", "results", "work"))
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--repeat", type=int, help="runs of each kind per cache state (median)")
    ap.add_argument("--cache", help="comma list of warm, cold (default: the size's)")
    ap.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                    help=f"comma list of {', '.join(KINDS + EXTRA)}")  # fmt: skip
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--max-shard-size", default="5GB")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", default="full", choices=("full", "sample"))
    ap.add_argument("--mem-limit", type=_parse_size, default=18 * 10**9)
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds to wait after deleting an output before the next run")  # fmt: skip
    ap.add_argument("--clean", action="store_true", help="delete the forged checkpoint at the end")
    ap.add_argument("--name", help="results file name (default: the size)")
    ap.add_argument("--src", default=REPO, help="import the measured zerosafe from this checkout")
    ap.add_argument(
        "--before",
        help="also run the engine kinds and the default command from this checkout, right "
        "after (before/after)",
    )
    ap.add_argument(
        "--render", metavar="JSON", help="recompute the summary and table of a results file"
    )
    cfg = ap.parse_args(argv)
    if cfg.render:
        return rerender(cfg.render)
    global SRC
    SRC = os.path.abspath(cfg.src)
    size = SIZES[cfg.size]
    params = cfg.params or size["params"]
    repeat = cfg.repeat or size["repeat"]
    caches = cfg.cache.split(",") if cfg.cache else size["caches"]
    kinds = cfg.kinds.split(",")
    name = cfg.name or cfg.size
    os.makedirs(cfg.work_dir, exist_ok=True)
    os.makedirs(cfg.results, exist_ok=True)
    ckpt = os.path.join(cfg.work_dir, f"ckpt-{params}-z{cfg.stage}-ws{cfg.world_size}")
    out = os.path.join(cfg.work_dir, "out")
    notes: list[str] = []

    print(f"forging {params} ZeRO-{cfg.stage} ws {cfg.world_size} into {ckpt} ...", flush=True)
    forged = forge(ckpt, params, world_size=cfg.world_size, stage=cfg.stage, seed=cfg.seed)
    print(
        f"  {'reused' if forged['reused'] else 'forged'}: {forged['num_params']:,} params, "
        f"fp32 {_gb(forged['fp32_bytes'])} GB, {_gb(_du(ckpt))} GB on disk, "
        f"{forged['seconds']:.1f} s",
        flush=True,
    )
    ranges, fp32_bytes = fp32_ranges(ckpt)
    from zerosafe.config import ConvertOptions
    from zerosafe.formats.deepspeed.checkpoint import build_plan, open_zero_checkpoint
    from zerosafe.io.storage import Storage

    plan = build_plan(
        open_zero_checkpoint(Storage(), ckpt),
        ConvertOptions(dtype=cfg.dtype, max_shard_size=_parse_size(cfg.max_shard_size)),
    )
    out_bytes = sum(s.data_bytes for s in plan.shards)
    files = _files(ckpt)
    ckpt_disk = _du(ckpt)
    staged_need = ckpt_disk + out_bytes + plan.slot_bytes
    staged_fits = True
    if staged_need > DISK_BUDGET_BYTES or staged_need > shutil.disk_usage(cfg.work_dir).free:
        staged_fits = False  # the old default (`cli-default-before`) was staged too
        for k in ("zerosafe-staged", "cli-staged"):
            if k in kinds:
                kinds.remove(k)
        notes.append(
            f"staged runs skipped: checkpoint {_gb(ckpt_disk)} GB + intermediates "
            f"{_gb(plan.slot_bytes)} GB + output {_gb(out_bytes)} GB = {_gb(staged_need)} GB is "
            f"over this benchmark's disk budget ({_gb(DISK_BUDGET_BYTES)} GB); direct mode is "
            "the one to use when intermediates do not fit"
        )
    if fp32_bytes > meminfo_bytes("MemTotal") * 0.6 and "warm" in caches:
        caches.remove("warm")
        notes.append("warm runs skipped: the fp32 masters do not fit in the page cache")

    extra: dict[str, Any] = {"out_bytes": out_bytes, "notes": notes}
    runs: list[dict[str, Any]] = []
    if "baseline" in kinds:
        b = run_baseline(cfg)
        runs.append(b)
        extra["baseline_rss_bytes"] = b["peak_rss_bytes"]
        print(f"baseline RSS {_gb(b['peak_rss_bytes'])} GB", flush=True)
    if "cli-overhead" in kinds:
        tiny = os.path.join(cfg.work_dir, "ckpt-tiny")
        tiny_info = forge(tiny, "2M", world_size=cfg.world_size, stage=cfg.stage, seed=cfg.seed)
        r = run_tool("cli-direct", tiny, out, cfg, tiny_info)
        r["kind"] = "cli-overhead"
        runs.append(r)
        extra["cli_overhead"] = {
            "wall_s": r["wall_s"], "seconds": r.get("internal_s"),
            "peak_rss_bytes": r["peak_rss_bytes"], "ok": r["ok"],
        }  # fmt: skip
        print(f"cli overhead: wall {r['wall_s']:.1f} s, ok={r['ok']}", flush=True)

    for cache in caches:
        for rep in range(repeat):
            for kind in [k for k in KINDS if k in kinds]:
                if cache == "warm":
                    warm_cache(files)
                else:
                    drop_cache(files)
                resident = residency(files)
                variants: list[Any] = [False, True] if kind == "io-limit" else [None]
                if cfg.before and kind in BEFORE_KINDS and (staged_fits or kind != "cli-default"):
                    variants.append("before")
                for variant in variants:
                    if variant is not None and cache == "cold":
                        drop_cache(files)
                    if variant == "before":
                        resident = residency(files)
                        row = run_tool(kind, ckpt, out, cfg, forged, src=cfg.before)
                        row["kind"] = kind + "-before"
                    elif variant is not None:
                        row = run_limit(ranges, out_bytes, out, variant)
                    else:
                        row = run_tool(kind, ckpt, out, cfg, forged)
                    row.update(cache=cache, rep=rep, resident_before_bytes=resident)
                    runs.append(row)
                    print(
                        f"[{cache} {rep}] {row['kind']}{' ' + row['mode'] if 'mode' in row else ''}: "
                        f"wall {row['wall_s']:.2f} s, conv {row.get('internal_s') or 0:.2f} s, "
                        f"RSS {_gb(row.get('peak_rss_bytes'))} GB, ok={row['ok']}"
                        + (f" ({row.get('killed') or row.get('error', '')[-200:]})" if not row["ok"] else "")
                        + (f" check={row['check']['mode']}:{row['check']['elements']:,}" if "check" in row else ""),
                        flush=True,
                    )  # fmt: skip
                    time.sleep(cfg.settle)

    rows = summarize(runs, forged, cfg)
    table = render(rows, extra, forged, cfg)
    result = {
        "name": name,
        "size": cfg.size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_total_bytes": meminfo_bytes("MemTotal"),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "config": {
            **vars(cfg),
            "params": params,
            "repeat": repeat,
            "caches": caches,
            "kinds": kinds,
        },
        "checkpoint": {
            k: forged[k]
            for k in (
                "num_params",
                "stage",
                "world_size",
                "dtype",
                "fp32_bytes",
                "apparent_bytes",
                "written_bytes",
                "seconds",
                "reused",
            )
        },  # fmt: skip
        "plan": {
            "num_tensors": len(plan.tensors),
            "num_shards": len(plan.shards),
            "fp32_bytes": fp32_bytes,
            "out_bytes": out_bytes,
            "slot_bytes": plan.slot_bytes,
        },  # fmt: skip
        "extra": extra,
        "summary": rows,
        "table": table,
        "runs": runs,
    }
    path = os.path.join(cfg.results, f"{name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print()
    print(table)
    print(f"\nwritten {path}")
    if cfg.clean:
        shutil.rmtree(ckpt, ignore_errors=True)
        os.unlink(ckpt + ".forge.json")
    return 0 if all(r.get("ok", True) or r["kind"] == "deepspeed" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
