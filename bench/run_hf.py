"""Benchmark zerosafe's first command on saves that torch and ByteCheckpoint write, against
the framework's own consolidation tool on the same save, and the I/O limit (issue 39).

    .venv/bin/python bench/run.py --format hf-sharded --size quick      # 0.5B, this module
    .venv/bin/python bench/run_hf.py --size quick                       # every layout, one run
    .venv/bin/python bench/run_hf.py --size tiny --repeat 1             # seconds: a smoke run

One run writes each layout's save once, into a temporary folder, with the framework's own save
code on 2 gloo CPU ranks (`bench/forge_hf.py`: an FSDP2 model, fp32, values set without
training), then, on the same
files and in the same run, measures for each layout, warm and cold, `--repeat` times:

- `io-limit`: reading the bytes the conversion reads once plus writing the output once
  (fsynced), serial (`bench/_iolimit.py`);
- `zerosafe`: `zerosafe convert SAVE OUT` as a user's first command: default options, a new
  `PREFECT_HOME`, no `PREFECT_API_URL` (`bench/_first_command.py`);
- the framework's tool, as a user runs it, with its defaults (`bench/_hf_tool_convert.py`):
  - `hf-sharded` (`HuggingFaceStorageWriter(save_distributed=True)` rank files): torch's
    `consolidate_safetensors_files`;
  - `bytecheckpoint` (`bytecheckpoint.save`, verl's backend): ByteCheckpoint's merge tool
    `bytecheckpoint_ckpt_to_pytorch_ckpt` on `global_step_N/` (it reads in worker
    processes, counted in the tree);
  - `safetensors` (a Hugging Face model folder: torch's consolidated output of the
    `hf-sharded` save, made once, untimed): no tool consolidates it; zerosafe against the
    I/O limit only, its output checked against the folder's tensors.
  Neither tool fsyncs; the harness times an fsync of its output after it exits, added to its
  wall and conversion times (`sync_s`), so every row compares durable outputs.

Each runs as a measured process tree (`bench/_measure.py`: wall time, peak RSS and anonymous
memory sampled every 50 ms). In every repetition zerosafe's output and the tool's are compared
tensor by tensor, bit for bit (names, dtypes, shapes, bytes). `baseline` is a process that only
imports what a conversion imports: zerosafe's peak anonymous memory is within `--memory`
(1 GB by default) when it is under baseline + 1 GB. Results: `bench/results/hf-<size>.json`
(every run, the summary, the table, the load average before and after), and the table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench._first_command import command_env, json_tail, stop_leftovers, sync_tree  # noqa: E402
from bench._iolimit import drop_cache, measure_limit, plan_ranges, warm_cache  # noqa: E402
from bench._measure import meminfo_bytes, run_measured  # noqa: E402

PY = sys.executable
SIZES = {"tiny": "20M", "quick": "500M"}
TOOLS: dict[str, str | None] = {
    "hf-sharded": "torch",
    "bytecheckpoint": "bytecheckpoint",
    "safetensors": None,
}
"""Each layout and the framework's own consolidation tool for it (`bench/_hf_tool_convert.py`)."""
TOOL_LABELS = {
    "torch": "torch consolidate_safetensors_files",
    "bytecheckpoint": "ByteCheckpoint merge tool",
}
MEMORY_BUDGET_BYTES = 10**9
"""`zerosafe convert`'s default `--memory`."""


def _env(prefect_home: str | None = None) -> dict[str, str]:
    return command_env(src=REPO, repo=REPO, prefect_home=prefect_home)


# -- the saves -----------------------------------------------------------------------------------


def forge(work_dir: str, layout: str, params: str) -> tuple[str, dict[str, Any]]:
    """The save of `layout` (reused when its record matches): `(folder to convert, record)`."""
    base = "hf-sharded" if layout == "safetensors" else layout
    save = os.path.join(work_dir, f"{base}-{params}")
    info_path = save + ".forge.json"
    info: dict[str, Any] | None = None
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        info["reused"] = True
    if info is None or info.get("params") != params:
        shutil.rmtree(save, ignore_errors=True)
        proc = subprocess.run(
            [PY, "-m", "bench.forge_hf", save, "--layout", base, "--params", params],
            cwd=REPO, env={**_env(), "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"writing the {base} save failed:\n{proc.stderr[-3000:]}")
        with open(info_path) as f:
            info = json.load(f)
        info["reused"] = False
    if layout != "safetensors":
        return save, info
    folder = os.path.join(work_dir, f"safetensors-{params}")
    if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run(
            [PY, os.path.join(REPO, "bench", "_hf_tool_convert.py"), "torch", save, folder],
            check=True, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
        )  # fmt: skip
        sync_tree(folder)
    return folder, {**info, "layout": "safetensors", "made_from": save}


def _tool_source(layout: str, save: str) -> str:
    """What the tool is given: ByteCheckpoint's merge tool takes the step folder."""
    if layout != "bytecheckpoint":
        return save
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(save, f"global_step_{f.read().strip()}")


# -- one run -------------------------------------------------------------------------------------


def run_tool(kind: str, layout: str, save: str, out: str, mem_limit: int) -> dict[str, Any]:
    """Run `zerosafe` or the layout's tool as a measured process; its output is kept."""
    shutil.rmtree(out, ignore_errors=True)
    home = None
    if kind == "zerosafe":
        home = tempfile.mkdtemp(prefix="zerosafe-bench-prefect-home-")
        argv = [PY, "-m", "zerosafe_app.cli", "convert", save, out, "--json", "--quiet"]
        env = _env(prefect_home=home)
    else:
        script = os.path.join(REPO, "bench", "_hf_tool_convert.py")
        argv = [PY, script, kind, _tool_source(layout, save), out]
        env = _env()
    try:
        m = run_measured(argv, env=env, cwd=REPO, limit_bytes=mem_limit)
    finally:
        if home is not None:
            stop_leftovers(home)
    row: dict[str, Any] = {"kind": kind, "layout": layout, **m.as_dict(tail=1500)}
    if kind == "zerosafe":
        summary = json_tail(m.stdout) or {}
        row["internal_s"] = summary.get("seconds")
        row["ok"] = m.returncode == 0 and summary.get("status") == "converted"
    else:
        res: dict[str, Any] = next(
            (json.loads(x[7:]) for x in reversed(m.stdout.splitlines()) if x.startswith("RESULT ")),
            {},
        )
        row["ok"] = m.returncode == 0 and m.killed is None and "convert_s" in res
        if row["ok"]:
            row["sync_s"] = sync_tree(out)
            row["wall_s"] += row["sync_s"]
            row["internal_s"] = res["convert_s"] + row["sync_s"]
    if not row["ok"]:
        row["error"] = m.killed or m.stderr[-800:]
    return row


def same_tensors(a: str, b: str) -> tuple[bool, str]:
    """Whether the `*.safetensors` files under folders `a` and `b` hold the same tensors (names,
    dtypes, shapes and bytes), however they are split into files; and the first difference."""
    from safetensors import safe_open

    def index(folder: str) -> dict[str, str]:
        names: dict[str, str] = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(folder, name), "pt") as f:
                    names.update(dict.fromkeys(f.keys(), os.path.join(folder, name)))
        return names

    ia, ib = index(a), index(b)
    if set(ia) != set(ib):
        return False, f"names differ: {sorted(set(ia) ^ set(ib))[:5]}"
    for name in sorted(ia):
        with safe_open(ia[name], "pt") as fa, safe_open(ib[name], "pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
        if ta.dtype != tb.dtype or ta.shape != tb.shape or not _raw(ta).equal(_raw(tb)):
            return False, f"{name}: {ta.dtype} {tuple(ta.shape)} vs {tb.dtype} {tuple(tb.shape)}"
    return True, f"{len(ia)} tensors bit-exact"


def _raw(t: Any) -> Any:
    """`t`'s bytes as a uint8 tensor (compared as bytes: NaNs and signed zeros included)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


# -- the table -----------------------------------------------------------------------------------


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs: list[dict[str, Any]], baseline_rss: int | None) -> list[dict[str, Any]]:
    """One row per layout, cache and kind (medians; peaks are the maximum), with the ratios."""
    rows: list[dict[str, Any]] = []
    keys = dict.fromkeys((r["layout"], r["cache"], r["kind"]) for r in runs)
    for layout, cache, kind in keys:
        group = [r for r in runs if (r["layout"], r["cache"], r["kind"]) == (layout, cache, kind)]
        row: dict[str, Any] = {
            "layout": layout, "cache": cache, "kind": kind, "runs": len(group),
            "ok": all(r["ok"] for r in group),
            "wall_s": _median(group, "wall_s"), "seconds": _median(group, "internal_s"),
            "walls": [round(r["wall_s"], 2) for r in group],
        }  # fmt: skip
        if kind != "io-limit":
            row.update(
                peak_rss_bytes=max(r["peak_rss_bytes"] for r in group),
                peak_anon_bytes=max(r["peak_anon_bytes"] for r in group),
                cpu_s=_median(group, "cpu_s"),
                load=_median(group, "load_before"),
            )
        if kind == "zerosafe" and baseline_rss is not None:
            row["within_memory"] = row["peak_anon_bytes"] <= baseline_rss + MEMORY_BUDGET_BYTES
        rows.append(row)
    for r in rows:
        same = {(x["layout"], x["cache"], x["kind"]): x for x in rows}
        z = same.get((r["layout"], r["cache"], "zerosafe"))
        limit = same.get((r["layout"], r["cache"], "io-limit"))
        if r["kind"] not in ("io-limit", "zerosafe") and z and z["wall_s"] and r["ok"]:
            r["wall_over_zerosafe"] = r["wall_s"] / z["wall_s"]
            r["rss_over_zerosafe"] = r["peak_rss_bytes"] / max(z["peak_rss_bytes"], 1)
        if r["kind"] != "io-limit" and limit and r["wall_s"]:
            r["wall_over_limit"] = r["wall_s"] / limit["wall_s"]
    return rows


def render(rows: list[dict[str, Any]], head: str) -> str:
    lines = [head, "layout | cache | tool | n | wall s | conv s | wall/limit | peak RSS GB | "
             "anon GB | ok | vs zerosafe"]  # fmt: skip

    def gb(n: float | None) -> str:
        return "-" if n is None else f"{n / 1e9:.2f}"

    for r in rows:
        tool = TOOL_LABELS.get(r["kind"], r["kind"])
        vs = (
            f"wall x{r['wall_over_zerosafe']:.2f}, RSS x{r['rss_over_zerosafe']:.1f}"
            if "wall_over_zerosafe" in r
            else "-"
        )
        lines.append(
            " | ".join(
                [
                    r["layout"],
                    r["cache"],
                    tool,
                    str(r["runs"]),
                    f"{r['wall_s']:.2f}",
                    "-" if r["seconds"] is None else f"{r['seconds']:.2f}",
                    f"{r['wall_over_limit']:.2f}" if "wall_over_limit" in r else "1.00",
                    gb(r.get("peak_rss_bytes")),
                    gb(r.get("peak_anon_bytes")),
                    "yes" if r["ok"] else "FAILED",
                    vs,
                ]
            )
        )
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(TOOLS), help=f"comma list of {', '.join(TOOLS)}")
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--params", help="override the size's param count")
    ap.add_argument("--repeat", type=int, help="runs of each kind per cache state (default 3)")
    ap.add_argument("--cache", default="warm,cold", help="comma list of warm, cold")
    ap.add_argument("--work-dir", help="where the saves go (default: a new temporary folder, "
                    "removed at the end); a save recorded there is reused")  # fmt: skip
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--name", help="results file name (default: hf-<size>)")
    ap.add_argument("--mem-limit", type=int, default=18 * 10**9)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between runs")
    cfg = ap.parse_args(argv)
    params = cfg.params or SIZES[cfg.size]
    repeat = cfg.repeat or (1 if cfg.size == "tiny" else 3)
    layouts = cfg.layouts.split(",")
    unknown = sorted(set(layouts) - set(TOOLS))
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {', '.join(TOOLS)}")
    temporary = cfg.work_dir is None
    cfg.work_dir = cfg.work_dir or tempfile.mkdtemp(prefix="zerosafe-bench-hf-")
    os.makedirs(cfg.work_dir, exist_ok=True)
    os.makedirs(cfg.results, exist_ok=True)
    try:
        return _run(cfg, params=params, repeat=repeat, layouts=layouts)
    finally:
        if temporary:
            shutil.rmtree(cfg.work_dir, ignore_errors=True)


def _run(cfg: argparse.Namespace, *, params: str, repeat: int, layouts: list[str]) -> int:
    """Forge each layout's save, measure every kind, write the results; the exit status."""
    load_before = os.getloadavg()

    from bench.run import run_baseline

    baseline = run_baseline(argparse.Namespace(mem_limit=cfg.mem_limit))
    baseline_rss = baseline["peak_rss_bytes"] if baseline["ok"] else None
    runs: list[dict[str, Any]] = []
    saves: dict[str, dict[str, Any]] = {}
    for layout in layouts:
        print(f"forging {layout} {params} ...", flush=True)
        save, info = forge(cfg.work_dir, layout, params)
        files = [os.path.join(r, f) for r, _, fs in os.walk(save) for f in fs]
        ranges, read_bytes, out_bytes = plan_ranges(save, dtype="float32")
        saves[layout] = {**info, "path": save, "read_bytes": read_bytes, "out_bytes": out_bytes}
        how = "reused" if info["reused"] else f"written in {info['seconds']:.1f} s"
        print(f"  {how}: {info['num_params']:,} params, {read_bytes / 1e9:.2f} GB", flush=True)
        tool = TOOLS[layout]
        kinds = ["io-limit", "zerosafe"] + ([tool] if tool else [])
        outs = {k: os.path.join(cfg.work_dir, f"out-{k}") for k in kinds}
        for cache in cfg.cache.split(","):
            for rep in range(repeat):
                for kind in kinds:
                    warm_cache(files) if cache == "warm" else drop_cache(files)
                    if kind == "io-limit":
                        res = measure_limit(ranges, outs[kind], out_bytes)
                        shutil.rmtree(outs[kind], ignore_errors=True)
                        row = {"kind": kind, "layout": layout, "ok": True,
                               "wall_s": res["total_s"], "internal_s": res["total_s"], **res}  # fmt: skip
                    else:
                        row = run_tool(kind, layout, save, outs[kind], cfg.mem_limit)
                    row.update(cache=cache, rep=rep)
                    runs.append(row)
                    time.sleep(cfg.settle)
                z = runs[-len(kinds) + 1]
                if z["ok"]:  # the tool's output, or the folder itself when there is no tool
                    other = outs[tool] if tool else save
                    z["same_as"] = other
                    z["same"], z["same_detail"] = same_tensors(outs["zerosafe"], other)
                for kind in kinds[1:]:
                    shutil.rmtree(outs[kind], ignore_errors=True)
                print(f"[{layout} {cache} {rep}] " + ", ".join(
                    f"{r['kind']} {r['wall_s']:.2f} s{'' if r['ok'] else ' FAILED'}"
                    for r in runs[-len(kinds):]
                ) + f"; outputs: {z.get('same_detail', '-')}", flush=True)  # fmt: skip
    rows = summarize(runs, baseline_rss)
    checks = [r for r in runs if r["kind"] == "zerosafe"]
    same = bool(checks) and all(r.get("same") for r in checks)
    load_after = os.getloadavg()
    head = (
        f"{params} fp32 over 2 ranks, every command a first command (defaults), medians of "
        f"{repeat}; outputs bit-exact in every repetition: {same}; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores"
    )
    table = render(rows, head)
    if baseline_rss is not None:
        table += (
            f"\ninterpreter baseline (imports of a conversion): RSS {baseline_rss / 1e9:.2f} GB; "
            f"zerosafe within --memory 1GB (peak anonymous <= baseline + 1 GB): "
            f"{all(r.get('within_memory') for r in rows if r['kind'] == 'zerosafe')}"
        )
    result = {
        "name": cfg.name or f"hf-{cfg.size}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_total_bytes": meminfo_bytes("MemTotal"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": load_after,
        },
        "config": {**vars(cfg), "params": params, "repeat": repeat},
        "saves": saves,
        "baseline_rss_bytes": baseline_rss,
        "same_output": same,
        "summary": rows,
        "table": table,
        "runs": runs,
    }
    path = os.path.join(cfg.results, f"{result['name']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(table)
    print(f"\nwritten {path}")
    return 0 if same and all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
