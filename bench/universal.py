"""`zerosafe convert --to universal` against DeepSpeed's `ds_to_universal.py`, in one run.

Forges (or reuses) a DeepSpeed 0.19.8 ZeRO-3 checkpoint with its Adam moments written out
(`bench/forge`, moments as real zeros so both tools read every byte), then runs each tool
`--repeat` times, interleaved (zerosafe, DeepSpeed, zerosafe, ...) so both see the same
machine, each as a measured process tree (`bench/_measure.py`: wall clock, peak RSS summed
over the tree, bytes read through system calls). Both are run as a user runs them, with
their defaults: `zerosafe convert CKPT OUT --to universal` and
`python -m deepspeed.checkpoint.ds_to_universal --input_folder CKPT/<tag> --output_folder OUT`.

The first pair's outputs are compared file by file (every `zero/<param>/{fp32,exp_avg,
exp_avg_sq}.pt` tensor equal, same params), then deleted. Reports medians and the ratios
DeepSpeed / zerosafe, and each tool's bytes read against the masters + moments.

    .venv/bin/python -m bench.universal --params 0.5B --world-size 8 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from bench import forge as F
from bench._measure import run_measured

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def forge(ckpt: str, params: str, world_size: int) -> dict[str, Any]:
    info_path = ckpt + ".forge.json"
    want = {"params": params, "world_size": world_size, "moments": "zeros"}
    if os.path.exists(info_path) and os.path.exists(os.path.join(ckpt, "latest")):
        with open(info_path) as f:
            saved: dict[str, Any] = json.load(f)
        if saved.get("request") == want:
            return saved
    shutil.rmtree(ckpt, ignore_errors=True)
    info = F.forge_checkpoint(
        ckpt, shapes=F.transformer_shapes(params, tied=False), stage=3,
        world_size=world_size, dtype="bf16", tied=False, seed=0, moments="zeros",
    )  # fmt: skip
    data = {"request": want, "fp32_bytes": info.fp32_bytes, "moment_bytes": info.moment_bytes}
    with open(info_path, "w") as f:
        json.dump(data, f)
    return data


def _argv(kind: str, ckpt: str, out: str) -> list[str]:
    if kind == "zerosafe":
        return [PY, "-m", "zerosafe_app.cli", "convert", ckpt, out, "--to", "universal", "--json"]
    with open(os.path.join(ckpt, "latest")) as f:
        tag = f.read().strip()
    return [
        PY, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", os.path.join(ckpt, tag), "--output_folder", out,
    ]  # fmt: skip


def run_one(kind: str, ckpt: str, out: str, timeout: float) -> dict[str, Any]:
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PREFECT_HOME": tempfile.mkdtemp(prefix="zerosafe-bench-prefect-home-"),
    }
    env.pop("PREFECT_API_URL", None)
    m = run_measured(_argv(kind, ckpt, out), env=env, cwd=REPO, timeout_s=timeout)
    row = {"kind": kind, **m.as_dict(tail=1200)}
    row["ok"] = m.returncode == 0 and m.killed is None
    if kind == "zerosafe" and row["ok"]:
        summary = json.loads(m.stdout[m.stdout.index("{") :])
        row["source_bytes_read"] = summary["bytes_read"]  # its own count; rchar adds verify
    return row


def _universal_root(out: str, kind: str) -> str:
    """The folder holding `zero/` (zerosafe: `OUT/<tag>_universal`; DeepSpeed: `OUT`)."""
    if kind == "deepspeed":
        return out
    with open(os.path.join(out, "latest_universal")) as f:
        return os.path.join(out, f.read().strip())


def compare(ours: str, theirs: str) -> dict[str, Any]:
    """Every param's state files equal (loaded with torch: both are our own outputs here)."""
    import torch

    a_root, b_root = os.path.join(ours, "zero"), os.path.join(theirs, "zero")
    a_params = sorted(p for p in os.listdir(a_root) if os.path.isdir(os.path.join(a_root, p)))
    b_params = sorted(p for p in os.listdir(b_root) if os.path.isdir(os.path.join(b_root, p)))
    mismatched: list[str] = []
    files = 0
    for p in sorted(set(a_params) & set(b_params)):
        for name in sorted(os.listdir(os.path.join(b_root, p))):
            a = torch.load(os.path.join(a_root, p, name), weights_only=True)
            b = torch.load(os.path.join(b_root, p, name), weights_only=True)
            ta = a["param"] if isinstance(a, dict) else a
            tb = b["param"] if isinstance(b, dict) else b
            files += 1
            if ta.dtype != tb.dtype or ta.shape != tb.shape or not torch.equal(ta, tb):
                mismatched.append(f"{p}/{name}")
    return {
        "params_ours": len(a_params),
        "params_deepspeed": len(b_params),
        "only_ours": sorted(set(a_params) - set(b_params))[:5],
        "only_deepspeed": sorted(set(b_params) - set(a_params))[:5],
        "files_compared": files,
        "mismatched": mismatched[:10],
        "ok": a_params == b_params and not mismatched and files > 0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="0.5B")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work-dir", default=os.path.join(REPO, "bench", "results", "work"))
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--out", help="results JSON (default bench/results/universal-<params>.json)")
    cfg = ap.parse_args(argv)
    os.makedirs(cfg.work_dir, exist_ok=True)
    ckpt = os.path.join(cfg.work_dir, f"universal-{cfg.params}-ws{cfg.world_size}")
    t = time.perf_counter()
    forged = forge(ckpt, cfg.params, cfg.world_size)
    print(f"forged {ckpt} in {time.perf_counter() - t:.0f} s", flush=True)
    rows: list[dict[str, Any]] = []
    check: dict[str, Any] | None = None
    for i in range(cfg.repeat):
        outs = {}
        for kind in ("zerosafe", "deepspeed"):
            out = os.path.join(cfg.work_dir, f"out-{kind}")
            row = run_one(kind, ckpt, out, cfg.timeout)
            row["repeat"] = i
            rows.append(row)
            outs[kind] = out
            print(
                f"{kind:9s} run {i}: {'ok' if row['ok'] else 'FAILED'} {row['wall_s']:.2f} s, "
                f"peak RSS {row['peak_rss_bytes'] / 1e9:.2f} GB, read {row['rchar'] / 1e9:.2f} GB",
                flush=True,
            )
            if not row["ok"]:
                print(row["stderr"][-1200:], file=sys.stderr)
        if check is None and all(r["ok"] for r in rows[-2:]):
            check = compare(
                _universal_root(outs["zerosafe"], "zerosafe"),
                _universal_root(outs["deepspeed"], "deepspeed"),
            )
            print(f"outputs compared: {check}", flush=True)
        for out in outs.values():
            shutil.rmtree(out, ignore_errors=True)
    state_bytes = forged["fp32_bytes"] + forged["moment_bytes"]
    summary: dict[str, Any] = {"masters_plus_moments_bytes": state_bytes}
    for kind in ("zerosafe", "deepspeed"):
        ok = [r for r in rows if r["kind"] == kind and r["ok"]]
        if not ok:
            continue
        summary[kind] = {
            "runs": len(ok),
            "wall_s": statistics.median(r["wall_s"] for r in ok),
            "peak_rss_gb": statistics.median(r["peak_rss_bytes"] for r in ok) / 1e9,
            "read_vs_state": statistics.median(r["rchar"] for r in ok) / state_bytes,
        }
        if kind == "zerosafe":
            summary[kind]["source_read_vs_state"] = ok[0]["source_bytes_read"] / state_bytes
    if "zerosafe" in summary and "deepspeed" in summary:
        summary["deepspeed_over_zerosafe_wall"] = (
            summary["deepspeed"]["wall_s"] / summary["zerosafe"]["wall_s"]
        )
        summary["deepspeed_over_zerosafe_rss"] = (
            summary["deepspeed"]["peak_rss_gb"] / summary["zerosafe"]["peak_rss_gb"]
        )
    result = {"config": vars(cfg), "forged": forged, "check": check, "summary": summary,
              "runs": rows, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "load_avg": os.getloadavg()}  # fmt: skip
    path = cfg.out or os.path.join(REPO, "bench", "results", f"universal-{cfg.params}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0 if check and check["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
