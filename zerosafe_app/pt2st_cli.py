"""The `zerosafe pt2st` command: one `torch.save` file to one safetensors file.

Registered through `zerosafe_app.cli.EXTRA_COMMANDS`. It runs the engine in this process (no
Prefect); the Prefect flow `pt2st` (flows/pt2st.py) runs the same engine functions as tasks,
for deployments against S3 or NFS.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from zerosafe.errors import ConfigError, VerificationError
from zerosafe.io.storage import Storage
from zerosafe.units import format_bytes
from zerosafe_app.arg_types import size_argument

__all__ = ["add_parser", "command_storage"]


def command_storage(args: argparse.Namespace) -> Storage:
    """The command line's storage (it resolves a `credentials` reference), or one of ours."""
    factory = getattr(args, "storage_factory", None)
    if factory is not None:
        storage: Storage = factory()
        return storage
    from zerosafe.io.s3 import parse_option_pairs

    return Storage(parse_option_pairs(args.storage_option or []))


def add_parser(subparsers: Any, add_verbosity: Callable[..., None]) -> None:
    """Add `pt2st` to the `zerosafe` command line."""
    p = subparsers.add_parser(
        "pt2st",
        help="convert a torch .pt (state dict, optimizer state, training checkpoint) into "
        "one safetensors file that loads back lazily",
    )
    add_verbosity(p, top=False)
    p.add_argument("source", help="a file written by torch.save (zip format, torch >= 1.6)")
    p.add_argument(
        "output", nargs="?", help="the .safetensors file (default: SOURCE as x.safetensors)"
    )
    p.add_argument(
        "--memory",
        type=size_argument,
        default="1GB",
        metavar="SIZE",
        help="memory budget of the copy, e.g. 256MB (default 1GB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument(
        "--no-verify", action="store_true", help="skip re-reading the output to check it"
    )
    p.add_argument(
        "--list-globals",
        action="store_true",
        help="list the globals the pickle names, allowed or not, and exit (loads nothing)",
    )
    p.add_argument(
        "--inspect", action="store_true", help="say what converting gives; write nothing"
    )
    from zerosafe.io.s3 import STORAGE_OPTION_HELP

    p.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help=STORAGE_OPTION_HELP
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=_run)


def _list_globals(args: argparse.Namespace) -> int:
    from zerosafe.formats.torch_legacy import open_torch_file
    from zerosafe.pt2st.convert import list_pt_globals, open_pt

    src = open_pt(command_storage(args), args.source)
    try:
        found = list_pt_globals(open_torch_file(src))
    finally:
        src.close()
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for g in found:
            print(f"{'allowed' if g['allowed'] else 'REFUSED':8} {g['global']}")
        refused = sum(not g["allowed"] for g in found)
        print(f"{len(found)} globals, {refused} outside zerosafe's allowlist")
    return 0


def _check_memory(memory: int) -> None:
    """Refuse a budget too small for the copy before anything is opened, naming `--memory`."""
    from zerosafe.config import ConvertOptions
    from zerosafe_app.cli import with_flag_names

    try:
        ConvertOptions(memory=memory, max_parallel_tasks=1)
    except ConfigError as e:
        raise with_flag_names(e) from e


def _run(args: argparse.Namespace) -> int:
    from zerosafe.pt2st.convert import convert_pt, inspect_pt, verify_pt
    from zerosafe.pt2st.load import safetensors_path_for
    from zerosafe.stages.progress import NullProgress, Progress, TerminalProgress

    if args.list_globals:
        return _list_globals(args)
    _check_memory(args.memory)
    storage = command_storage(args)
    if args.inspect:
        report = inspect_pt(args.source, storage=storage)
        if args.json:
            print(json.dumps(report, indent=1))
        else:
            print(
                f"{args.source}: {report['num_tensors']} tensors -> {report['num_entries']} "
                f"entries ({report['num_views']} views), {format_bytes(report['data_bytes'])}"
            )
        return 0
    output = args.output or safetensors_path_for(args.source)
    show = not args.quiet and not args.json and sys.stderr.isatty()
    progress: Progress = TerminalProgress() if show else NullProgress()
    progress.start("pt2st", storage.identity(args.source).size_bytes if show else 0)
    summary = convert_pt(
        args.source,
        output,
        storage=storage,
        memory=args.memory,
        overwrite=args.overwrite,
        on_bytes=progress.advance,
    )
    if show:
        progress.finish()
    if not args.no_verify:
        try:
            summary["verify"] = verify_pt(
                output, storage=storage, expected_sha256=summary.get("sha256")
            )
        except VerificationError:
            if summary["status"] == "converted":
                storage.remove(output)  # ours, just written: leave nothing that looks done
            raise
    if args.json:
        print(json.dumps(summary, indent=1))
    elif summary["status"] == "already-complete":
        print(f"{output}: already a conversion of this version of {args.source}; nothing to do")
    elif not args.quiet:
        print(
            f"wrote {output}: {summary['num_tensors']} tensors in {summary['num_entries']} "
            f"entries ({summary['num_views']} views), {format_bytes(summary['file_bytes'])} in "
            f"{summary['seconds']:.1f} s{'' if args.no_verify else ', verified'}"
        )
    return 0
