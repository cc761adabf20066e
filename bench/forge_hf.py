"""Write a save of any size with the frameworks' own save code, quickly: 2 gloo CPU ranks.

    python -m bench.forge_hf OUT_DIR --layout hf-sharded --params 500M [--dtype float32]

An FSDP2 model (Llama-like param shapes from `bench.forge.transformer_shapes`, each decoder
layer and the root `fully_shard`ed, so every param is a `Shard(0)` DTensor with uneven rows)
is built on the meta device and materialised with `to_empty`; each rank fills its local shards
with seeded normals (no full tensor is ever made, no training step). Then, by layout:

- `hf-sharded`: `dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(OUT_DIR,
  save_distributed=True))`: one `shard-0000R-model-00001-of-00001.safetensors` per rank;
- `bytecheckpoint`: `bytecheckpoint.save(OUT_DIR, {"model": model}, framework="fsdp2",
  global_steps=1)`: `global_step_1/model/` (`.metadata` and `__R_0.distcp`) and
  `latest_checkpointed_iteration.txt`.

`OUT_DIR.forge.json` records what was written (`num_params`, `total_bytes`, `seconds`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

WORLD_SIZE = 2
LAYOUTS = ("hf-sharded", "bytecheckpoint")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(shapes: Sequence[tuple[str, tuple[int, ...]]], dtype: Any) -> Any:
    """A module tree holding `shapes` as meta-device params under their dotted names."""
    import torch
    from torch import nn

    root = nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))
    return root


def _worker(rank: int, out: str, layout: str, params: str, dtype: str, port: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from bench.forge import parse_count, transformer_shapes

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    torch.set_num_threads(1)
    model = _model(transformer_shapes(parse_count(params), tied=False), getattr(torch, dtype))
    for layer in model.layers.children():
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(generator=gen)
    if layout == "hf-sharded":
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict_saver import save

        save(
            model.state_dict(),
            storage_writer=HuggingFaceStorageWriter(out, save_distributed=True),
        )
    else:
        import bytecheckpoint

        bytecheckpoint.save(out, {"model": model}, framework="fsdp2", global_steps=1)
    dist.barrier()
    dist.destroy_process_group()


def forge_save(out: str, *, layout: str, params: str, dtype: str = "float32") -> dict[str, Any]:
    """Write the save into the new folder `out` (see the module docstring); returns its record."""
    from torch.multiprocessing.spawn import spawn

    from bench.forge import parse_count, transformer_shapes

    os.makedirs(out)
    t0 = time.perf_counter()
    error = None
    for attempt in range(3):  # a free port can be taken before gloo binds it: retry
        try:
            args = (out, layout, params, dtype, _free_port())
            spawn(_worker, args=args, nprocs=WORLD_SIZE)  # type: ignore[no-untyped-call]
            error = None
            break
        except Exception:
            error = f"attempt {attempt + 1} of 3: " + traceback.format_exc(limit=3)
    if error is not None:
        raise RuntimeError(f"{layout} save of {params} failed: {error}")
    files = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs]
    for path in files:  # durable, so a cold run can evict every page
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    shapes = transformer_shapes(parse_count(params), tied=False)
    return {
        "layout": layout,
        "params": params,
        "dtype": dtype,
        "world_size": WORLD_SIZE,
        "num_params": sum(math.prod(s) for _, s in shapes),
        "num_tensors": len(shapes),
        "total_bytes": sum(os.path.getsize(p) for p in files),
        "seconds": time.perf_counter() - t0,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--layout", choices=LAYOUTS, default="hf-sharded")
    p.add_argument("--params", default="500M")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    info = forge_save(args.out, layout=args.layout, params=args.params, dtype=args.dtype)
    with open(args.out.rstrip("/") + ".forge.json", "w") as f:
        json.dump(info, f)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
