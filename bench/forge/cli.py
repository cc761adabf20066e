"""The command line: `python -m bench.forge DEST --params 500M --stage 3 --world-size 8`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

from .checkpoint import forge_checkpoint
from .shapes import parse_count, transformer_shapes


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Forge a synthetic DeepSpeed 0.19.8 ZeRO checkpoint.")
    ap.add_argument("dest")
    ap.add_argument("--params", default="100M", help="approximate param count: 500M, 7B, ...")
    ap.add_argument("--stage", type=int, default=3, choices=(1, 2, 3))
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--tag", default="global_step1")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--width", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument(
        "--sub-group", type=parse_count, default=None, help="ZeRO-3 sub_group_size (elements)"
    )
    ap.add_argument(
        "--no-tied", action="store_true", help="a separate lm_head.weight instead of a tied alias"
    )
    ap.add_argument("--freeze", action="append", default=[], help="freeze this param (repeatable)")
    ap.add_argument("--groups", type=int, default=2, choices=(1, 2))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--moments", default="sparse", choices=("sparse", "zeros"))
    ap.add_argument("--chunk-mb", type=float, default=8)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--fsync", action="store_true", help="fsync every file before timing stops")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shapes = transformer_shapes(
        args.params, vocab=args.vocab, width=args.width, layers=args.layers, tied=not args.no_tied
    )
    info = forge_checkpoint(
        args.dest,
        shapes=shapes,
        stage=args.stage,
        world_size=args.world_size,
        dtype=args.dtype,
        tag=args.tag,
        sub_group_numel=args.sub_group,
        tied=not args.no_tied,
        frozen=args.freeze,
        groups=args.groups,
        seed=args.seed,
        moments=args.moments,
        chunk_bytes=int(args.chunk_mb * (1 << 20)),
        threads=args.threads,
    )
    if args.fsync:
        t = time.perf_counter()
        for f in info.files:
            fd = os.open(f["path"], os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        info.seconds += time.perf_counter() - t
    print(info.summary())
    if sys.platform.startswith("linux"):
        import resource

        print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0
