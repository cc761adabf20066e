"""Benchmark zerosafe on a PyTorch DCP checkpoint against what users do today and the I/O limit.

    .venv/bin/python bench/run.py --format dcp --size quick   # 0.5B params (this module)
    .venv/bin/python bench/run_dcp.py --size tiny              # seconds: a smoke run

One run forges a DCP checkpoint in FSDP2's layout (`bench/forge_dcp.py`: model chunks plus
AdamW moments, 3x the model in all), then, on the same files and in the same run, measures:

- `io-limit`: reading the model's chunk bytes once plus writing the output bytes once
  (fsynced), serial (`bench/_iolimit.py`);
- `zerosafe`: `zerosafe convert --via local` (the engine; direct mode on a local disk);
- `torch`: `dcp_to_torch_save` then `torch.load` and `safetensors.torch.save_file` of the model
  part, the way users convert today (`bench/_dcp_torch_convert.py`).

Each runs as a measured process tree (`bench/_measure.py`: wall time, peak RSS sampled every
50 ms). Outputs are compared bit for bit with each other. Results go to
`bench/results/dcp-<size>.json` and the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench._iolimit import drop_cache, measure_limit, plan_ranges, warm_cache  # noqa: E402
from bench._measure import run_measured  # noqa: E402

PY = sys.executable
SIZES = {"tiny": "20M", "quick": "500M", "7b": "7B"}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    return env


def forge(ckpt: str, params: str, world_size: int) -> dict[str, Any]:
    from bench.forge import parse_count, transformer_shapes
    from bench.forge_dcp import forge_dcp_checkpoint

    info_path = ckpt + ".forge.json"
    want = {"params": params, "world_size": world_size}
    if os.path.exists(info_path):
        with open(info_path) as f:
            saved: dict[str, Any] = json.load(f)
        if saved.get("request") == want and os.path.exists(os.path.join(ckpt, ".metadata")):
            return saved
    shutil.rmtree(ckpt, ignore_errors=True)
    info = forge_dcp_checkpoint(
        ckpt, transformer_shapes(parse_count(params)), world_size=world_size
    )
    data = {**info.__dict__, "request": want}
    with open(info_path, "w") as f:
        json.dump(data, f)
    return data


def run_tool(kind: str, ckpt: str, out: str, dtype: str, mem_limit: int) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    if kind == "zerosafe":
        argv = [PY, "-m", "zerosafe_app.cli", "convert", ckpt, out, "--dtype", dtype,
                "--max-shard-size", "100GB", "--via", "local", "--json", "--quiet"]  # fmt: skip
    else:
        argv = [PY, os.path.join(REPO, "bench", "_dcp_torch_convert.py"), ckpt, out, dtype]
    m = run_measured(argv, env=_env(), cwd=REPO, limit_bytes=mem_limit)
    row: dict[str, Any] = {"kind": kind, **m.as_dict(tail=1500)}
    row["ok"] = m.returncode == 0 and m.killed is None
    row["internal_s"] = _internal_seconds(kind, m.stdout)
    return row


def _internal_seconds(kind: str, stdout: str) -> float | None:
    """The tool's own time, without interpreter start and imports."""
    try:
        if kind == "zerosafe":
            return float(json.loads(stdout[stdout.index("{") :])["seconds"])
        line = next(x for x in reversed(stdout.splitlines()) if x.startswith("RESULT "))
        return float(json.loads(line[len("RESULT ") :])["total_s"])
    except (ValueError, KeyError, StopIteration):
        return None


def same_output(a: str, b: str) -> bool:
    from safetensors.torch import load_file

    ta, tb = (
        load_file(os.path.join(a, "model.safetensors")),
        load_file(os.path.join(b, "model.safetensors")),
    )
    return set(ta) == set(tb) and all(ta[k].dtype == tb[k].dtype and ta[k].equal(tb[k]) for k in ta)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--params", help="override the size's param count")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--cache", default="warm", choices=("warm", "cold"))
    ap.add_argument("--work-dir", default=os.path.join(REPO, "bench", "results", "work"))
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--mem-limit", type=int, default=18 * 10**9)
    cfg = ap.parse_args(argv)
    params = cfg.params or SIZES[cfg.size]
    ckpt = os.path.join(cfg.work_dir, f"dcp-{params}-ws{cfg.world_size}")
    forged = forge(ckpt, params, cfg.world_size)
    files = [os.path.join(ckpt, n) for n in sorted(os.listdir(ckpt))]
    ranges, read_bytes, out_bytes = plan_ranges(ckpt, dtype="bf16")
    runs: list[dict[str, Any]] = []
    outs = {k: os.path.join(cfg.work_dir, f"out-{k}") for k in ("zerosafe", "torch")}
    for kind in ("io-limit", "zerosafe", "torch"):
        warm_cache(files) if cfg.cache == "warm" else drop_cache(files)
        if kind == "io-limit":
            limit = measure_limit([(u, o, n) for u, o, n in ranges], outs["zerosafe"], out_bytes)
            shutil.rmtree(outs["zerosafe"], ignore_errors=True)
            runs.append({"kind": kind, "ok": True, "wall_s": limit["total_s"], **limit})
        else:
            runs.append(run_tool(kind, ckpt, outs[kind], cfg.dtype, cfg.mem_limit))
    same = all(r["ok"] for r in runs) and same_output(outs["zerosafe"], outs["torch"])
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    limit_s = runs[0]["total_s"]
    lines = [
        f"dcp {params}: {forged['num_params'] / 1e9:.2f}B params over {cfg.world_size} ranks, "
        f"checkpoint {forged['total_bytes'] / 1e9:.2f} GB (model chunks {read_bytes / 1e9:.2f} GB) "
        f"-> {cfg.dtype} {out_bytes / 1e9:.2f} GB; {cfg.cache} cache; outputs identical: {same}",
        "tool | wall s | conversion s | conversion x limit | peak RSS GB | ok",
    ]
    for r in runs:
        rss = "-" if r["kind"] == "io-limit" else f"{r['peak_rss_bytes'] / 1e9:.2f}"
        own = r.get("internal_s") or r["wall_s"]
        lines.append(
            f"{r['kind']} | {r['wall_s']:.2f} | {own:.2f} | {own / limit_s:.2f} | {rss} | {r['ok']}"
        )
    table = "\n".join(lines)
    os.makedirs(cfg.results, exist_ok=True)
    with open(os.path.join(cfg.results, f"dcp-{cfg.size}.json"), "w") as f:
        json.dump({"config": vars(cfg), "checkpoint": forged, "runs": runs, "same_output": same,
                   "table": table}, f, indent=1, default=str)  # fmt: skip
    print(table)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
