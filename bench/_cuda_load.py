"""One side of the GPU load check (bench/device_command.sh): load a torch checkpoint onto the
GPU and report seconds, peak host RSS and anonymous RSS above the baseline, and a digest.

    _cuda_load.py make PT                   # a ~2 GB optimizer-like .pt, and its .safetensors
    _cuda_load.py load PT pt|zerosafe       # torch.load(map_location=device) or load_pt(device=device)
"""

import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._rss import RSSSampler  # noqa: E402


def _digest(obj: object) -> str:
    h = hashlib.sha256()

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{tuple(x.shape)}{x.dtype}{x.device.type}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def make(pt: str) -> None:
    g = torch.Generator().manual_seed(0)
    state = {
        "state": {
            i: {
                "step": torch.tensor(7.0),
                "exp_avg": torch.randn(4096, 8192, generator=g),
                "exp_avg_sq": torch.rand(4096, 8192, generator=g),
            }
            for i in range(8)
        },
        "param_groups": [{"lr": 1e-4, "params": list(range(8))}],
    }
    torch.save(state, pt)
    import zerosafe

    zerosafe.convert_pt(pt, pt[: -len(".pt")] + ".safetensors", overwrite=True)


def load(pt: str, via: str) -> None:
    device = os.environ.get("LOAD_DEVICE", "cuda")  # cpu: the script's own check, anywhere
    torch.empty(1, device=device)
    import zerosafe  # imported before the baseline in both ways

    with RSSSampler() as rss:
        if via == "pt":
            obj = torch.load(pt, map_location=device, weights_only=True)
        else:
            obj = zerosafe.load_pt(pt, device=device)
        if device == "cuda":
            torch.cuda.synchronize()
    first = obj["state"][0]["exp_avg"]
    print(
        json.dumps(
            {
                "via": via,
                "seconds": rss.seconds,
                "device": str(first.device),
                "peak_rss_above_bytes": rss.peak_rss - rss.base_rss,
                "peak_anon_above_bytes": rss.peak_anon - rss.base_anon,
                "digest": _digest(obj),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        load(sys.argv[2], sys.argv[3])
