"""Measure one pt2st operation's memory in a fresh process; print JSON.

    python tests/pt2st/memory_probe.py make PT NUM_BYTES
    python tests/pt2st/memory_probe.py convert PT OUT MEMORY_BYTES
    python tests/pt2st/memory_probe.py load OUT

`make` writes a checkpoint of about NUM_BYTES: one big tensor, a storage shared by two views,
small tensors. `convert` first converts a tiny file (so lazy imports and thread pools are warm),
takes the RSS then as the baseline and samples RSS every few ms during the real conversion.
`load` maps the output with `load_pt_like` and reports the RSS it added, before and after
reading one value of every tensor.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.rss import PeakRSS  # noqa: E402
from zerosafe.pt2st import convert_pt, load_pt_like  # noqa: E402


def make(pt: str, num_bytes: int) -> None:
    big = torch.ones(num_bytes * 2 // 3 // 4, dtype=torch.float32)
    shared = torch.full((num_bytes // 3 // 2,), 2.0, dtype=torch.bfloat16)
    torch.save(
        {
            "model": {"big.weight": big, "small": torch.arange(10)},
            "shared_a": shared[: shared.numel() // 2],
            "shared_b": shared.view(-1, 2).t(),
        },
        pt,
    )


def convert(pt: str, out: str, memory: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as warm:
        torch.save({"w": torch.ones(1000)}, os.path.join(warm, "w.pt"))
        convert_pt(os.path.join(warm, "w.pt"), os.path.join(warm, "w.safetensors"))
    with PeakRSS() as m:
        summary = convert_pt(pt, out, memory=memory, overwrite=True)
    return {
        "baseline_rss": m.baseline,
        "peak_rss": m.peak,
        "peak_above_baseline": m.peak - m.baseline,
        "file_bytes": summary["file_bytes"],
        "seconds": m.seconds,
    }


def load(out: str) -> dict[str, float]:
    proc = psutil.Process()
    load_pt_like(out)  # warm: imports, the first map
    baseline = proc.memory_info().rss
    obj = load_pt_like(out)
    after_load = proc.memory_info().rss
    tensors = [obj["model"]["big.weight"], obj["shared_a"], obj["shared_b"]]
    firsts = [float(t[(0,) * t.dim()]) for t in tensors]  # one element: one page each
    after_touch = proc.memory_info().rss
    return {
        "baseline_rss": baseline,
        "load_above_baseline": after_load - baseline,
        "touch_above_baseline": after_touch - baseline,
        "values": firsts,
        "file_bytes": os.path.getsize(out),
    }


def main() -> None:
    kind = sys.argv[1]
    if kind == "make":
        make(sys.argv[2], int(sys.argv[3]))
        print(json.dumps({"ok": True}))
    elif kind == "convert":
        print(json.dumps(convert(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        print(json.dumps(load(sys.argv[2])))


if __name__ == "__main__":
    main()
