"""The `--to dcp` side of `zerosafe convert`, `inspect` and `verify`: what each prints
(`zerosafe.training_state.dcp` does the work, `zerosafe_app.cli_universal.run_state` runs it).
`zerosafe_app.cli` checks the arguments first."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.units import format_bytes
from zerosafe_app.cli_universal import print_state_tail, print_verified, run_state

__all__ = ["convert_dcp", "inspect_dcp", "verify_dcp"]

EXIT_OK = 0


def inspect_dcp(args: argparse.Namespace, storage: Any) -> int:
    from zerosafe.training_state.dcp_plan import plan_dcp

    report = plan_dcp(storage, args.checkpoint, tag=args.tag, layout=args.dcp_layout).to_json()
    if args.json:
        print(json.dumps(report, indent=1))
        return EXIT_OK
    print(
        f"--to dcp: {report['num_model_entries']} model entries and the AdamW state of "
        f"{report['num_params']} trained params of ZeRO-{report['zero_stage']} (world size "
        f"{report['world_size']}) into .metadata + __<n>_0.distcp"
    )
    print(
        f"  reads {format_bytes(report['read_bytes'])} (masters "
        f"{format_bytes(report['masters_bytes'])}, moments {format_bytes(report['moments_bytes'])}"
        f"); writes {format_bytes(report['output_bytes'])} (model "
        f"{format_bytes(report['model_bytes'])})"
    )
    for note in report["notes"]:
        print(f"  note: {note}")
    return EXIT_OK


def convert_dcp(args: argparse.Namespace, storage: Any) -> int:
    """`convert --to dcp`: `run_state` (`zerosafe_app.cli_universal`), then what it did."""
    s = run_state(args, storage)
    if args.json:
        print(json.dumps(s, indent=1))
    elif s["status"] == "already-complete":
        print(
            f"{args.output}: already a complete DCP checkpoint of this checkpoint; nothing to do."
        )
    elif not args.quiet:
        print(
            f"wrote a PyTorch DCP checkpoint ({s['num_items']} items: model and AdamW state "
            f"of {s['num_params']} params) into {args.output} in {s['seconds']:.1f} s "
            f"(read {format_bytes(s['bytes_read'])}, wrote "
            f"{format_bytes(s['bytes_written'])}; {s['parallel']} unit(s) at once; peak memory "
            f"{format_bytes(s['peak_rss_bytes'])})"
        )
        print_state_tail(s, "item")
        print(
            "  resume with `dcp.load({'model': msd, 'optim': osd}, checkpoint_id=...)` and "
            "`set_state_dict` (docs/training-state.md)"
        )
        for note in s["notes"]:
            print(f"  note: {note}")
    return EXIT_OK


def verify_dcp(args: argparse.Namespace, storage: Any) -> int:
    from zerosafe.training_state.dcp import verify_dcp_output

    if args.against:
        raise ConfigError("`--against` does not apply to a DCP checkpoint written by --to dcp yet")
    found = verify_dcp_output(args.output, storage=storage)
    what = f"PyTorch DCP checkpoint, {found['num_files']} files, {found['num_items']} items checked"
    return print_verified(found, what, as_json=args.json)
