"""`zerosafe clean TARGET`: list (and with `--apply`, remove) what killed runs left behind.

The flags and the printed table; what counts as left behind, and the removal, are the
engine's (`zerosafe.stages.clean`), a plain function of typed arguments.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from zerosafe.io.s3 import STORAGE_OPTION_HELP
from zerosafe.io.storage import Storage
from zerosafe.stages.clean import Leftover, clean, parse_age
from zerosafe.units import format_bytes

__all__ = ["add_parser"]


def _render(found: list[Leftover], apply: bool) -> str:
    if not found:
        return "nothing left behind"
    rows = [("kind", "size", "age", "action", "url")]
    for f in found:
        age = "?" if f.age_seconds is None else f"{f.age_seconds / 60:.0f} min"
        action = f.action if apply or f.action != "remove" else "would remove"
        rows.append((f.kind, format_bytes(f.size_bytes), age, action, f.url))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    todo = [f for f in found if f.action in ("remove", "removed")]
    total = format_bytes(sum(f.size_bytes for f in todo))
    if apply:
        lines.append(f"removed {len(todo)} item(s), {total}")
    else:
        lines.append(f"{len(todo)} item(s), {total}, would be removed; run again with --apply")
    return "\n".join(lines)


def _cmd_clean(args: argparse.Namespace) -> int:
    make_storage: Callable[[], Storage] = args.storage_factory  # `zerosafe_app.cli.main` sets it
    storage = make_storage()
    found = clean(
        storage,
        args.target,
        older_than_seconds=args.older_than,
        apply=args.apply,
        server_folders=True,
    )
    if args.json:
        print(json.dumps([f.as_dict() for f in found], indent=1))
    else:
        print(_render(found, args.apply))
    return 0


def _age(text: str) -> float:
    try:
        return parse_age(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers: Any, add_verbosity: Callable[..., None]) -> None:
    """Register `zerosafe clean` (see `zerosafe_app.cli.EXTRA_COMMANDS`)."""
    p = subparsers.add_parser(
        "clean",
        help="list (and with --apply remove) abandoned work areas, unfinished S3 uploads and "
        "killed commands' Prefect server folders",
    )
    add_verbosity(p, top=False)
    p.add_argument("target", help="output folder, work area, or a folder/prefix above them")
    p.add_argument("--apply", action="store_true", help="remove them (default: only list)")
    p.add_argument(
        "--older-than",
        type=_age,
        default="1h",
        metavar="AGE",
        help="only what nothing touched for this long, e.g. 30m, 2h, 0 (default 1h)",
    )
    p.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help=STORAGE_OPTION_HELP
    )
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(handler=_cmd_clean)
