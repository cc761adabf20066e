"""Benchmark zerosafe's first command on a 0.5B megatron-core `torch_dist` save (issue 40),
against the CPU route Megatron users have and the I/O limit.

    .venv/bin/python bench/run_megatron.py                          # the 0.5B save, 3 repeats
    .venv/bin/python bench/run_megatron.py --repeat 1 --cache warm  # one warm run of each

The save is written once by megatron-core itself (`bench/forge_megatron.py`, run in the
megatron-core environment `--mcore-python`: a Llama-style `GPTModel` of 0.49B params, fp32,
tensor parallel 2 on 2 gloo CPU ranks, initialised without training, saved with its
`DistributedOptimizer` state as Megatron-LM's `save_checkpoint` saves it: 7.8 GB, of which
1.95 GB are the model's weights) into `--save` (default `/work/bench-data/megatron-500m`, not
committed; reused when present). Then, on the same files and in the same run, for each cache
state (warm, cold) `--repeat` times:

- `io-limit`: reading the bytes the conversion reads once plus writing the output once
  (fsynced), serial (`bench/_iolimit.py`);
- `zerosafe`: `zerosafe convert SAVE OUT` as a user's first command: default options (fp32
  out, Hugging Face Llama names and `config.json`), a new `PREFECT_HOME`, no `PREFECT_API_URL`
  (`bench/_first_command.py`);
- `torch-dcp`: torch's DCP consolidation, `dcp_to_torch_save` then `save_file` of the model's
  tensors (`bench/_megatron_tool_convert.py`, in the megatron-core environment): the CPU route
  that runs. It writes Megatron's stacked names and padded vocabulary, not HF weights.

Not runnable here, recorded in the results (`not_run`): Megatron-LM's converter scripts
(`tools/checkpoint/`) are not in the megatron-core wheel; Megatron-Bridge (`megatron-bridge`
0.6.2 on PyPI) requires `megatron-core[dev,mlm]`, whose `fast-hadamard-transform` has no
wheel, only a source package whose `setup.py` builds a CUDA extension with `nvcc`.

Each runs as a measured process tree (`bench/_measure.py`: wall time, peak RSS and anonymous
memory sampled every 50 ms). In every repetition zerosafe's output is checked against the
tool's, mapped to HF names with plain torch (`tests/formats/megatron/reference.py`: layers
unstacked, QKV split per query group, `[gate; up]` split, vocabulary trimmed), tensor by
tensor, bit for bit. Results: `bench/results/megatron-500m.json` (every run, the summary, the
table, the load average before and after), and the table printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench._iolimit import drop_cache, measure_limit, plan_ranges, warm_cache  # noqa: E402
from bench._measure import meminfo_bytes, run_measured  # noqa: E402
from bench.run_hf import render, run_tool, summarize  # noqa: E402

PY = sys.executable
LAYOUT = "megatron"
TOOL = "torch-dcp"
NOT_RUN = {
    "Megatron-LM tools/checkpoint (convert.py, loader_mcore/saver_hf)": (
        "not in the megatron-core wheel (megatron-core 0.19.2 ships megatron/core only): they "
        "need a Megatron-LM checkout and its training package, whose loader builds the model; "
        "the one-file convert_mlm_to_hf_checkpoint.py reads only the legacy "
        "mp_rank_NN/model_optim_rng.pt format, not torch_dist"
    ),
    "Megatron-Bridge (AutoBridge.export_ckpt)": (
        "megatron-bridge 0.6.2 requires megatron-core[dev,mlm]; its fast-hadamard-transform "
        "1.1.0 has no wheel on PyPI, only a source package whose setup.py builds a CUDA "
        "extension (CUDAExtension, nvcc): not installable on this CPU machine (checked with "
        "pip in the megatron-core venv, 2026-11-28)"
    ),
}


FUSED_NORMS = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
"""The norms as megatron-core's `sharded_state_dict` saves them (on the fused layers, even with
the local spec), and their names on the live model, which `hf_reference` takes."""


def forge(save: str, mcore_python: str) -> dict[str, Any]:
    """The save's record (`SAVE.forge.json`), writing the save first when it is missing."""
    info_path = save.rstrip("/") + ".forge.json"
    if not os.path.exists(info_path):
        shutil.rmtree(save, ignore_errors=True)
        proc = subprocess.run(
            [mcore_python, os.path.join(REPO, "bench", "forge_megatron.py"), save],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"writing the Megatron save failed:\n{proc.stderr[-3000:]}")
        reused = False
    else:
        reused = True
    with open(info_path) as f:
        info: dict[str, Any] = json.load(f)
    return {**info, "reused": reused}


def run_torch_dcp(save: str, out: str, mcore_python: str, mem_limit: int) -> dict[str, Any]:
    """torch's DCP consolidation of the save, as a measured process in the megatron-core env."""
    shutil.rmtree(out, ignore_errors=True)
    script = os.path.join(REPO, "bench", "_megatron_tool_convert.py")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    m = run_measured([mcore_python, script, save, out], env=env, cwd=REPO, limit_bytes=mem_limit)
    row: dict[str, Any] = {"kind": TOOL, "layout": LAYOUT, **m.as_dict(tail=1500)}
    res: dict[str, Any] = next(
        (json.loads(x[7:]) for x in reversed(m.stdout.splitlines()) if x.startswith("RESULT ")),
        {},
    )
    row["ok"] = m.returncode == 0 and m.killed is None and "total_s" in res
    row["internal_s"] = res.get("total_s")
    row["steps"] = res
    if not row["ok"]:
        row["error"] = m.killed or m.stderr[-800:]
    return row


def same_as_mapped(zerosafe_out: str, tool_out: str, args: dict[str, Any]) -> tuple[bool, str]:
    """Whether zerosafe's output holds exactly the tool's tensors mapped to HF Llama names with
    plain torch (`hf_reference`), bit for bit; and the first difference."""
    import torch
    from safetensors import safe_open

    from tests.formats.megatron.reference import hf_reference

    live: dict[str, torch.Tensor] = {}
    with safe_open(os.path.join(tool_out, "model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            tensor = f.get_tensor(key)
            if key.startswith("decoder.layers."):  # stacked: one leading layer dimension
                rest = key.removeprefix("decoder.layers.")
                rest = FUSED_NORMS.get(rest, rest)
                live |= {f"decoder.layers.{i}.{rest}": t for i, t in enumerate(tensor.unbind(0))}
            else:
                live[key] = tensor
    want = hf_reference(live, args)
    del live
    files = [n for n in os.listdir(zerosafe_out) if n.endswith(".safetensors")]
    got: set[str] = set()
    for name in sorted(files):
        with safe_open(os.path.join(zerosafe_out, name), "pt") as f:
            for key in f.keys():  # noqa: SIM118
                got.add(key)
                ours, ref = f.get_tensor(key), want.get(key)
                if ref is None:
                    return False, f"{key}: not in the mapped tool output"
                if ours.dtype != ref.dtype or ours.shape != ref.shape:
                    return (
                        False,
                        f"{key}: {ours.dtype} {tuple(ours.shape)} vs {ref.dtype} {tuple(ref.shape)}",
                    )
                if not ours.reshape(-1).view(torch.uint8).equal(ref.reshape(-1).view(torch.uint8)):
                    return False, f"{key}: bytes differ"
    if got != set(want):
        return False, f"names differ: {sorted(got ^ set(want))[:5]}"
    return True, f"{len(got)} tensors bit-exact (the tool's, mapped to HF names with plain torch)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--save", default="/work/bench-data/megatron-500m",
                    help="the --save folder (written by bench/forge_megatron.py when missing)")  # fmt: skip
    ap.add_argument("--mcore-python", default="/work/mcore-venv/bin/python",
                    help="the megatron-core environment's interpreter")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3, help="runs of each kind per cache state")
    ap.add_argument("--cache", default="warm,cold", help="comma list of warm, cold")
    ap.add_argument("--work-dir", help="where the outputs go (default: beside the save)")
    ap.add_argument("--results", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--name", default="megatron-500m", help="results file name")
    ap.add_argument("--mem-limit", type=int, default=16 * 10**9)
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between runs")
    cfg = ap.parse_args(argv)
    cfg.work_dir = cfg.work_dir or os.path.dirname(os.path.abspath(cfg.save))
    os.makedirs(cfg.results, exist_ok=True)
    return _run(cfg)


def _measure_all(cfg: argparse.Namespace, info: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kind, cache state and repetition, each zerosafe output checked against the tool's."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(cfg.save) for f in fs]
    ranges, _, out_bytes = plan_ranges(cfg.save, dtype="float32")
    kinds = ("io-limit", "zerosafe", TOOL)
    outs = {k: os.path.join(cfg.work_dir, f"out-{k}") for k in kinds}
    runs: list[dict[str, Any]] = []
    for cache in cfg.cache.split(","):
        for rep in range(cfg.repeat):
            for kind in kinds:
                warm_cache(files) if cache == "warm" else drop_cache(files)
                if kind == "io-limit":
                    res = measure_limit(ranges, outs[kind], out_bytes)
                    shutil.rmtree(outs[kind], ignore_errors=True)
                    row = {"kind": kind, "layout": LAYOUT, "ok": True,
                           "wall_s": res["total_s"], "internal_s": res["total_s"], **res}  # fmt: skip
                elif kind == "zerosafe":
                    row = run_tool(kind, LAYOUT, cfg.save, outs[kind], cfg.mem_limit)
                else:
                    row = run_torch_dcp(cfg.save, outs[kind], cfg.mcore_python, cfg.mem_limit)
                row.update(cache=cache, rep=rep)
                runs.append(row)
                time.sleep(cfg.settle)
            z = runs[-2]
            if z["ok"] and runs[-1]["ok"]:
                z["same_as"] = outs[TOOL]
                z["same"], z["same_detail"] = same_as_mapped(
                    outs["zerosafe"], outs[TOOL], info["args"]
                )
            for kind in kinds[1:]:
                shutil.rmtree(outs[kind], ignore_errors=True)
            print(f"[{cache} {rep}] " + ", ".join(
                f"{r['kind']} {r['wall_s']:.2f} s{'' if r['ok'] else ' FAILED'}"
                for r in runs[-len(kinds):]
            ) + f"; load {os.getloadavg()[0]:.1f}; outputs: {z.get('same_detail', '-')}",
                flush=True)  # fmt: skip
    return runs


def _run(cfg: argparse.Namespace) -> int:
    """Forge (or reuse) the save, measure every kind, write the results; the exit status."""
    load_before = os.getloadavg()
    from bench.run import run_baseline

    baseline = run_baseline(argparse.Namespace(mem_limit=cfg.mem_limit))
    baseline_rss = baseline["peak_rss_bytes"] if baseline["ok"] else None
    print(f"forging {cfg.save} ...", flush=True)
    info = forge(cfg.save, cfg.mcore_python)
    _, read_bytes, out_bytes = plan_ranges(cfg.save, dtype="float32")
    how = "reused" if info["reused"] else f"written in {info['seconds']:.1f} s"
    print(f"  {how}: {info['num_params']:,} params, {info['total_bytes'] / 1e9:.2f} GB "
          f"({read_bytes / 1e9:.2f} GB of weights)", flush=True)  # fmt: skip
    runs = _measure_all(cfg, info)
    rows = summarize(runs, baseline_rss)
    checks = [r for r in runs if r["kind"] == "zerosafe"]
    same = bool(checks) and all(r.get("same") for r in checks)
    load_after = os.getloadavg()
    head = (
        f"megatron-core torch_dist, {info['num_params'] / 1e9:.2f}B params fp32, TP=2 on 2 "
        f"ranks, {info['total_bytes'] / 1e9:.2f} GB with optimizer state; every command a first "
        f"command (defaults), medians of {cfg.repeat}; zerosafe's output equal to the tool's "
        f"mapped to HF in every repetition: {same}; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after, on {os.cpu_count()} cores"
    )
    table = render(rows, head).replace(f"| {TOOL} |", "| torch dcp_to_torch_save + save_file |")
    if baseline_rss is not None:
        table += (
            f"\ninterpreter baseline (imports of a conversion): RSS {baseline_rss / 1e9:.2f} GB; "
            f"zerosafe within --memory 1GB (peak anonymous <= baseline + 1 GB): "
            f"{all(r.get('within_memory') for r in rows if r['kind'] == 'zerosafe')}"
        )
    table += "\nnot run: " + "; ".join(f"{k}: {v}" for k, v in NOT_RUN.items())
    result = {
        "name": cfg.name,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            "cpus": os.cpu_count(),
            "mem_total_bytes": meminfo_bytes("MemTotal"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_before": load_before,
            "load_after": load_after,
        },
        "config": vars(cfg),
        "save": {**info, "read_bytes": read_bytes, "out_bytes": out_bytes},
        "baseline_rss_bytes": baseline_rss,
        "same_output": same,
        "not_run": NOT_RUN,
        "summary": rows,
        "table": table,
        "runs": runs,
    }
    path = os.path.join(cfg.results, f"{cfg.name}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(table)
    print(f"\nwritten {path}")
    return 0 if same and all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
