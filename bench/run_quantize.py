"""Benchmark `zerosafe convert --quantize fp8-block` (issue 41) against the same conversion to
bf16 and against the two-step route, each a user's first command, in one run.

    .venv/bin/python bench/run_quantize.py --size quick     # 0.5B ZeRO-3 ws 8, ~10 min on 2 cores
    .venv/bin/python bench/run_quantize.py --size tiny --repeat 1   # seconds: a smoke run

One run forges a Llama-named ZeRO-3 checkpoint at world size 8 (`bench/forge/`: deterministic
fp32 masters, Adam moments as sparse holes; every linear dimension a multiple of 128, so each
linear weight is quantized, and a `config.json` beside `latest`, as the HF Trainer saves it),
then, on the same files, warm, `--repeat` times:

- `bf16`: `zerosafe convert CKPT OUT --dtype bf16` (default options otherwise);
- `fp8-block`: `zerosafe convert CKPT OUT --dtype bf16 --quantize fp8-block`;
- the two-step route: a bf16 conversion, then `bench/_fp8_two_step.py` on its output
  (`AutoModelForCausalLM.from_pretrained`, transformers' own `Fp8Quantize` on each linear
  weight, `save_pretrained`: the reference quantizer on CPU, the whole model in memory).
  `two-step` takes zerosafe's `bf16` run as its first step (its output is kept for it);
  `two-step-deepspeed` takes DeepSpeed's converter (`bench/_ds_convert.py`, bf16 safetensors;
  the `config.json` copied beside it, as a user must). Its time is the sum of its steps, its
  peak memory the larger one's.

Each command runs as a measured process tree (`bench/_measure.py`: wall time, peak RSS and
anonymous memory sampled every 50 ms) with a new, empty `PREFECT_HOME` and no
`PREFECT_API_URL` (`bench/_first_command.py`). The tools that do not fsync get an fsync of
their output timed after they exit (`sync_s`, added). Checks, in every repetition: `bf16`
equals the forge's values cast to bf16 (`bench/_check.py`); every FP8 weight and
`weight_scale_inv` of `fp8-block` equals transformers' `Fp8Quantize` applied to the forge's
fp32 masters, bit for bit, and every other tensor the bf16 cast; the two-step outputs hold the
same tensor names, dtypes and shapes (their FP8 bytes differ: the reference quantizes the bf16
copy, zerosafe the fp32 masters). `baseline` is a process that only imports what a conversion
imports: `fp8-block` is within `--memory` (1 GB by default) when its peak anonymous memory is
under baseline + 1 GB. Results: `bench/results/quantize-<size>.json` and the table printed.
"""

from __future__ import annotations

import argparse
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
from bench._iolimit import warm_cache  # noqa: E402
from bench._measure import meminfo_bytes, run_measured  # noqa: E402

PY = sys.executable
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"width": 256, "ffn": 768, "kv": 128, "layers": 2, "vocab": 1000},
    "quick": {"width": 1536, "ffn": 4096, "kv": 384, "layers": 16, "vocab": 32000},
}
"""Llama dims: hidden, intermediate, key/value width, layers, vocabulary (quick: 0.49B)."""
HEAD_DIM = 128
MEMORY_BUDGET_BYTES = 10**9
"""`zerosafe convert`'s default `--memory`."""
KINDS = ("bf16", "fp8-block", "two-step", "two-step-deepspeed")


def _env(prefect_home: str | None = None) -> dict[str, str]:
    return command_env(src=REPO, repo=REPO, prefect_home=prefect_home)


# -- the checkpoint ------------------------------------------------------------------------------


def llama_shapes(dims: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """A Llama's params under transformers' names, in module order (no biases, untied)."""
    w, ffn, kv = dims["width"], dims["ffn"], dims["kv"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (dims["vocab"], w))]
    for i in range(dims["layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (w,)),
            (p + "self_attn.q_proj.weight", (w, w)),
            (p + "self_attn.k_proj.weight", (kv, w)),
            (p + "self_attn.v_proj.weight", (kv, w)),
            (p + "self_attn.o_proj.weight", (w, w)),
            (p + "post_attention_layernorm.weight", (w,)),
            (p + "mlp.gate_proj.weight", (ffn, w)),
            (p + "mlp.up_proj.weight", (ffn, w)),
            (p + "mlp.down_proj.weight", (w, ffn)),
        ]
    return [*shapes, ("model.norm.weight", (w,)), ("lm_head.weight", (dims["vocab"], w))]


def llama_config(dims: dict[str, int]) -> dict[str, Any]:
    """The `config.json` the HF Trainer saves beside the checkpoint for these dims."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dims["width"], "intermediate_size": dims["ffn"],
        "num_hidden_layers": dims["layers"], "num_attention_heads": dims["width"] // HEAD_DIM,
        "num_key_value_heads": dims["kv"] // HEAD_DIM, "head_dim": HEAD_DIM,
        "vocab_size": dims["vocab"], "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "dtype": "bfloat16",
    }  # fmt: skip


def forge(work_dir: str, size: str, *, world_size: int, seed: int) -> tuple[str, dict[str, Any]]:
    """Forge (or reuse) the checkpoint: `(folder, record)`; the record is kept beside it."""
    dims = SIZES[size]
    ckpt = os.path.join(work_dir, f"llama-{size}-z3-ws{world_size}")
    want = {"dims": dims, "world_size": world_size, "seed": seed}
    info_path = ckpt + ".forge.json"
    if os.path.exists(info_path):
        with open(info_path) as f:
            saved = json.load(f)
        if saved.get("request") == want and os.path.exists(os.path.join(ckpt, "config.json")):
            return ckpt, {**saved, "reused": True}
    shutil.rmtree(ckpt, ignore_errors=True)
    shapes = llama_shapes(dims)
    info = F.forge_checkpoint(
        ckpt, shapes=shapes, stage=3, world_size=world_size, dtype="bf16", tied=False,
        buffers=(), seed=seed, moments="sparse",
    )  # fmt: skip
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(llama_config(dims), f, indent=2)
    sync_tree(ckpt)
    record = {
        "request": want, "params": {n: list(s) for n, s in shapes},
        "num_params": sum(math.prod(s) for _, s in shapes), "fp32_bytes": info.fp32_bytes,
        "seconds": info.seconds,
    }  # fmt: skip
    with open(info_path, "w") as f:
        json.dump(record, f)
    return ckpt, {**record, "reused": False}


# -- the runs ------------------------------------------------------------------------------------


def run_zerosafe(ckpt: str, out: str, extra: list[str], mem_limit: int) -> dict[str, Any]:
    """`zerosafe convert CKPT OUT --dtype bf16 EXTRA` as a first command; the output is kept."""
    shutil.rmtree(out, ignore_errors=True)
    home = tempfile.mkdtemp(prefix="zerosafe-bench-prefect-home-")
    argv = [PY, "-m", "zerosafe_app.cli", "convert", ckpt, out, "--dtype", "bf16", *extra,
            "--json", "--quiet"]  # fmt: skip
    try:
        m = run_measured(argv, env=_env(prefect_home=home), cwd=REPO, limit_bytes=mem_limit)
    finally:
        stop_leftovers(home)
    summary = json_tail(m.stdout) or {}
    row: dict[str, Any] = {**m.as_dict(tail=1500), "internal_s": summary.get("seconds")}
    row["ok"] = m.returncode == 0 and summary.get("status") == "converted"
    if not row["ok"]:
        row["error"] = m.killed or m.stderr[-800:]
    return row


def run_script(argv: list[str], out: str, mem_limit: int, **env: str) -> dict[str, Any]:
    """A tool that prints `RESULT {json}` with `convert_s`, then an fsync of `out` (timed)."""
    shutil.rmtree(out, ignore_errors=True)
    m = run_measured([PY, *argv], env={**_env(), **env}, cwd=REPO, limit_bytes=mem_limit)
    res: dict[str, Any] = next(
        (json.loads(x[7:]) for x in reversed(m.stdout.splitlines()) if x.startswith("RESULT ")),
        {},
    )
    row: dict[str, Any] = {**m.as_dict(tail=1500), "tool": res}
    row["ok"] = m.returncode == 0 and m.killed is None and "convert_s" in res
    if row["ok"]:
        row["sync_s"] = sync_tree(out)
        row["wall_s"] += row["sync_s"]
        row["internal_s"] = res["convert_s"] + row["sync_s"]
    else:
        row["error"] = m.killed or res.get("error") or m.stderr[-800:]
    return row


def two_step(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """The route's figures: times added, the larger peak, ok when both steps were."""
    row = {"steps": [first.get("kind"), second.get("kind")], "ok": first["ok"] and second["ok"]}
    for key in ("wall_s", "internal_s", "cpu_s"):
        row[key] = (first.get(key) or 0.0) + (second.get(key) or 0.0)
    for key in ("peak_rss_bytes", "peak_anon_bytes"):
        row[key] = max(first[key], second[key])
    row["load_before"] = first["load_before"]
    return row


# -- the checks ----------------------------------------------------------------------------------


def check_fp8(out: str, params: dict[str, list[int]], seed: int) -> dict[str, Any]:
    """Every tensor of the fp8-block output against the forge's masters: FP8 weights and their
    scales bit-exact against transformers' `Fp8Quantize`, the rest the bf16 cast."""
    import torch
    from safetensors import safe_open
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    from bench.forge.values import expected_fp32

    op = Fp8Quantize(FineGrainedFP8HfQuantizer(FineGrainedFP8Config()))
    files = _tensor_files(out)
    problems: list[str] = []
    quantized = 0
    plain = {n: tuple(s) for n, s in params.items()}
    for name, shape in params.items():
        if name not in files:
            problems.append(f"{name}: missing")
            continue
        with safe_open(files[name], "pt") as f:
            got = f.get_tensor(name)
            scale_name = name + "_scale_inv"
            got_scale = f.get_tensor(scale_name) if scale_name in f.keys() else None
        master = torch.from_numpy(expected_fp32(name, 0, math.prod(shape), seed)).reshape(shape)
        if got.dtype != torch.float8_e4m3fn:
            same = got.dtype == torch.bfloat16 and got.equal(master.bfloat16())
            if not same:
                problems.append(f"{name}: {got.dtype}, not the bf16 cast of the master")
            continue
        want = op.convert({name: master})
        ok = (
            scale_name in want and got_scale is not None
            and got.view(torch.uint8).equal(want[name].view(torch.uint8))
            and got_scale.view(torch.int32).equal(want[scale_name].view(torch.int32))
        )  # fmt: skip
        quantized += 1
        if not ok:
            problems.append(f"{name}: FP8 bytes or scales differ from Fp8Quantize's")
    extra = set(files) - set(plain) - {n + "_scale_inv" for n in plain}
    if extra:
        problems.append(f"unexpected tensors: {sorted(extra)[:5]}")
    return {"ok": not problems, "quantized": quantized, "tensors": len(files),
            "problems": problems[:20]}  # fmt: skip


def _tensor_files(folder: str) -> dict[str, str]:
    from safetensors import safe_open

    names: dict[str, str] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                names.update(dict.fromkeys(f.keys(), os.path.join(folder, name)))
    return names


def same_layout(a: str, b: str) -> tuple[bool, str]:
    """Whether folders `a` and `b` hold tensors of the same names, dtypes and shapes."""
    from safetensors import safe_open

    def layout(folder: str) -> dict[str, tuple[str, tuple[int, ...]]]:
        out = {}
        for name, path in _tensor_files(folder).items():
            with safe_open(path, "pt") as f:
                s = f.get_slice(name)
                out[name] = (s.get_dtype(), tuple(s.get_shape()))
        return out

    la, lb = layout(a), layout(b)
    if la == lb:
        return True, f"{len(la)} tensors, same names, dtypes and shapes"
    diff = sorted(set(la.items()) ^ set(lb.items()))[:4]
    return False, f"layouts differ: {diff}"


# -- the table -----------------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]], baseline_rss: int | None) -> list[dict[str, Any]]:
    """One row per kind (medians of the repetitions; peaks the maximum), with the ratios to
    `bf16` and `fp8-block` of the same run."""
    rows: list[dict[str, Any]] = []
    for kind in [
        k for k in (*KINDS, "deepspeed", "quantize-step") if any(r["kind"] == k for r in runs)
    ]:
        group = [r for r in runs if r["kind"] == kind]

        def median(key: str, group: list[dict[str, Any]] = group) -> float | None:
            vals = [r[key] for r in group if r.get(key) is not None]
            return statistics.median(vals) if vals else None

        rows.append({
            "kind": kind, "runs": len(group), "ok": all(r["ok"] for r in group),
            "wall_s": median("wall_s"), "seconds": median("internal_s"),
            "walls": [round(r["wall_s"], 2) for r in group], "cpu_s": median("cpu_s"),
            "load": median("load_before"),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in group),
            "peak_anon_bytes": max(r["peak_anon_bytes"] for r in group),
        })  # fmt: skip
    by = {r["kind"]: r for r in rows}
    for r in rows:
        for base in ("bf16", "fp8-block"):
            b = by.get(base)
            if b and b is not r and b["wall_s"] and r["wall_s"]:
                r[f"wall_over_{base}"] = r["wall_s"] / b["wall_s"]
                r[f"rss_over_{base}"] = r["peak_rss_bytes"] / max(b["peak_rss_bytes"], 1)
                r[f"anon_over_{base}"] = r["peak_anon_bytes"] / max(b["peak_anon_bytes"], 1)
        if r["kind"] == "fp8-block" and baseline_rss is not None:
            r["within_memory"] = r["peak_anon_bytes"] <= baseline_rss + MEMORY_BUDGET_BYTES
    return rows


def render(rows: list[dict[str, Any]], head: str) -> str:
    def gb(n: float | None) -> str:
        return "-" if n is None else f"{n / 1e9:.2f}"

    lines = [head, "kind | n | wall s | conv s | cpu s | load | peak RSS GB | anon GB | ok | "
             "wall/bf16 | wall/fp8 | RSS/fp8"]  # fmt: skip
    for r in rows:
        lines.append(" | ".join([
            r["kind"], str(r["runs"]), f"{r['wall_s']:.2f}",
            "-" if r["seconds"] is None else f"{r['seconds']:.2f}", f"{r['cpu_s']:.1f}",
            f"{r['load']:.1f}", gb(r["peak_rss_bytes"]), gb(r["peak_anon_bytes"]),
            "yes" if r["ok"] else "FAILED",
            f"{r['wall_over_bf16']:.2f}" if "wall_over_bf16" in r else "-",
            f"{r['wall_over_fp8-block']:.2f}" if "wall_over_fp8-block" in r else "-",
            f"{r['rss_over_fp8-block']:.2f}" if "rss_over_fp8-block" in r else "-",
        ]))  # fmt: skip
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="quick", choices=sorted(SIZES))
    ap.add_argument("--repeat", type=int, help="runs of each kind (median; default 3, tiny 1)")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of {', '.join(KINDS)}")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default=os.path.join(REPO, "bench", "results", "work"))
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--name", help="results file name (default: quantize-<size>)")
    ap.add_argument("--mem-limit", type=int, default=18 * 10**9)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between runs")
    cfg = ap.parse_args(argv)
    repeat = cfg.repeat or (1 if cfg.size == "tiny" else 3)
    kinds = cfg.kinds.split(",")
    if unknown := sorted(set(kinds) - set(KINDS)):
        ap.error(f"unknown kinds {unknown}; choose from {', '.join(KINDS)}")
    if "two-step" in kinds and "bf16" not in kinds:
        ap.error("two-step takes the bf16 run as its first step: add bf16 to --kinds")
    os.makedirs(cfg.work_dir, exist_ok=True)
    os.makedirs(cfg.results, exist_ok=True)
    load_before = os.getloadavg()
    from bench.run import run_baseline

    baseline = run_baseline(argparse.Namespace(mem_limit=cfg.mem_limit))
    baseline_rss = baseline["peak_rss_bytes"] if baseline["ok"] else None
    print(f"forging {cfg.size} ZeRO-3 ws {cfg.world_size} ...", flush=True)
    ckpt, forged = forge(cfg.work_dir, cfg.size, world_size=cfg.world_size, seed=cfg.seed)
    print(f"  {'reused' if forged['reused'] else 'forged'}: {forged['num_params']:,} params, "
          f"fp32 {forged['fp32_bytes'] / 1e9:.2f} GB", flush=True)  # fmt: skip
    files = [os.path.join(r, f) for r, _, fs in os.walk(ckpt) for f in fs]
    outs = {k: os.path.join(cfg.work_dir, f"out-{k}") for k in (*KINDS, "deepspeed")}
    runs: list[dict[str, Any]] = []
    checks: list[bool] = []
    for rep in range(repeat):
        got = _one_round(cfg, kinds, ckpt, forged, files, outs)
        for row in got:
            row["rep"] = rep
        runs += got
        checks += [bool(r["check"]["ok"]) for r in got if "check" in r]
        print(f"[{rep}] " + ", ".join(
            f"{r['kind']} {r['wall_s']:.2f} s {(r.get('peak_rss_bytes') or 0) / 1e9:.2f} GB"
            f"{'' if r['ok'] else ' FAILED'}" for r in got
        ), flush=True)  # fmt: skip
    for out in outs.values():
        shutil.rmtree(out, ignore_errors=True)
    rows = summarize(runs, baseline_rss)
    load_after = os.getloadavg()
    head = (
        f"{forged['num_params'] / 1e9:.2f}B params, ZeRO-3 ws {cfg.world_size}, fp32 masters "
        f"{forged['fp32_bytes'] / 1e9:.2f} GB, warm; every command a first command; medians of "
        f"{repeat}; outputs checked in every repetition: {bool(checks) and all(checks)}; load "
        f"average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores"
    )
    table = render(rows, head)
    if baseline_rss is not None:
        table += (
            f"\ninterpreter baseline (imports of a conversion): RSS {baseline_rss / 1e9:.2f} GB; "
            "fp8-block within --memory 1GB (peak anonymous <= baseline + 1 GB): "
            f"{all(r.get('within_memory') for r in rows if r['kind'] == 'fp8-block')}"
        )
    result = {
        "name": cfg.name or f"quantize-{cfg.size}",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(), "mem_total_bytes": meminfo_bytes("MemTotal"),
            "platform": platform.platform(), "python": platform.python_version(),
            "load_before": load_before, "load_after": load_after,
        },
        "config": {**vars(cfg), "repeat": repeat},
        "checkpoint": {k: v for k, v in forged.items() if k != "params"},
        "baseline_rss_bytes": baseline_rss,
        "checked": bool(checks) and all(checks),
        "summary": rows, "table": table, "runs": runs,
    }  # fmt: skip
    path = os.path.join(cfg.results, f"{result['name']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(table)
    print(f"\nwritten {path}")
    return 0 if result["checked"] and all(r["ok"] for r in runs) else 1


def _one_round(
    cfg: argparse.Namespace,
    kinds: list[str],
    ckpt: str,
    forged: dict[str, Any],
    files: list[str],
    outs: dict[str, str],
) -> list[dict[str, Any]]:
    """One repetition of every kind, warm, each output checked; the rows."""
    rows: list[dict[str, Any]] = []
    step2 = os.path.join(REPO, "bench", "_fp8_two_step.py")

    def measured(kind: str, run: Any) -> dict[str, Any]:
        warm_cache(files)
        row = {"kind": kind, **run()}
        rows.append(row)
        time.sleep(cfg.settle)
        return row

    params = forged["params"]
    if "bf16" in kinds:
        bf16 = measured("bf16", lambda: run_zerosafe(ckpt, outs["bf16"], [], cfg.mem_limit))
        if bf16["ok"]:
            bf16["check"] = check_output(
                outs["bf16"], params={k: tuple(v) for k, v in params.items()}, buffers={},
                seed=cfg.seed, out_dtype="bf16", mode="full",
            )  # fmt: skip
            bf16["ok"] = bf16["check"]["ok"]
    if "fp8-block" in kinds:
        fp8 = measured(
            "fp8-block",
            lambda: run_zerosafe(
                ckpt, outs["fp8-block"], ["--quantize", "fp8-block"], cfg.mem_limit
            ),
        )
        if fp8["ok"]:
            fp8["check"] = check_fp8(outs["fp8-block"], params, cfg.seed)
            fp8["ok"] = fp8["check"]["ok"]
    routes = [("two-step", "bf16")] if "two-step" in kinds else []
    if "two-step-deepspeed" in kinds:
        ds_argv = [os.path.join(REPO, "bench", "_ds_convert.py"), os.path.join(ckpt, ""),
                   outs["deepspeed"], "--dtype", "bf16"]  # fmt: skip
        ds = measured("deepspeed", lambda: run_script(ds_argv, outs["deepspeed"], cfg.mem_limit,
                                                      DS_ACCELERATOR="cpu"))  # fmt: skip
        if ds["ok"]:  # DeepSpeed writes the weights only: the user copies the config
            shutil.copy(os.path.join(ckpt, "config.json"), outs["deepspeed"])
        routes.append(("two-step-deepspeed", "deepspeed"))
    for route, first_kind in routes:
        first = next(r for r in rows if r["kind"] == first_kind)
        second = measured(
            "quantize-step",
            lambda first_kind=first_kind, route=route: run_script(
                [step2, outs[first_kind], outs[route]], outs[route], cfg.mem_limit
            ),
        )
        second["route"] = route
        row = {"kind": route, **two_step(first, second)}
        if row["ok"] and "fp8-block" in kinds and os.path.isdir(outs["fp8-block"]):
            same, detail = same_layout(outs["fp8-block"], outs[route])
            row["check"] = {"ok": same, "detail": detail}
            row["ok"] = same
        rows.append(row)
        shutil.rmtree(outs[route], ignore_errors=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
