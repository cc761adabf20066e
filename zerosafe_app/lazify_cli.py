"""The `zerosafe lazify` command: a safetensors sibling next to every `.pt` of a checkpoint tag.

Registered through `zerosafe_app.cli.EXTRA_COMMANDS`. It runs the engine
(`zerosafe.lazy.lazify_checkpoint`) in this process, without Prefect; the flow `lazify`
(zerosafe_app/flows/lazify.py) runs the same engine function per file as tasks, for
deployments against S3 or NFS. Resuming from the siblings: `zerosafe.lazy_torch_load`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.units import format_bytes
from zerosafe_app.arg_types import size_argument
from zerosafe_app.pt2st_cli import command_storage

__all__ = ["add_parser"]


def add_parser(subparsers: Any, add_verbosity: Callable[..., None]) -> None:
    """Add `lazify` to the `zerosafe` command line."""
    p = subparsers.add_parser(
        "lazify",
        help="write X.pt.safetensors next to every .pt of a DeepSpeed checkpoint tag, so "
        "training resumes from them memory-mapped (zerosafe.lazy_torch_load)",
    )
    add_verbosity(p, top=False)
    p.add_argument("checkpoint", help="folder holding 'latest', or a tag folder (or s3://...)")
    p.add_argument("--tag", help="tag to lazify (default: the one 'latest' names)")
    p.add_argument(
        "--memory",
        type=size_argument,
        default="1GB",
        metavar="SIZE",
        help="memory budget of all files converted at once, e.g. 256MB (default 1GB)",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=2,
        metavar="N",
        help="files converted at once, fewer if --memory is small (default 2)",
    )
    p.add_argument(
        "--no-verify", action="store_true", help="skip re-reading each sibling to check it"
    )
    from zerosafe.io.s3 import STORAGE_OPTION_HELP

    p.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help=STORAGE_OPTION_HELP
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from zerosafe.lazy import file_memory_bytes, lazify_checkpoint
    from zerosafe_app.cli import with_flag_names

    try:
        file_memory_bytes(args.memory, args.parallel)  # before any I/O
    except ConfigError as e:
        raise with_flag_names(e) from e
    summary = lazify_checkpoint(
        args.checkpoint,
        tag=args.tag,
        storage=command_storage(args),
        memory=args.memory,
        max_parallel_files=args.parallel,
        verify=not args.no_verify,
    )
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    if not args.quiet:
        for f in summary["files"]:
            if f["status"] != "current":
                why = f" (was stale: {f['stale_because']})" if f["stale_because"] else ""
                print(f"{f['status']:9} {f['sibling']}{why}")
        print(
            f"{summary['tag_url']}: {summary['written']} written, {summary['rewritten']} "
            f"rewritten, {summary['current']} already current; "
            f"{format_bytes(summary['bytes_written'])} in {summary['seconds']:.1f} s"
        )
    return 0
