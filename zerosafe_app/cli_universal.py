"""`zerosafe inspect|convert --to universal`: a DeepSpeed universal checkpoint, written in the
command's own process (`zerosafe.training_state`)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerosafe.errors import ConfigError
from zerosafe.io.storage import Storage
from zerosafe.units import format_bytes

__all__ = [
    "check_universal_args",
    "convert_universal",
    "inspect_universal",
    "print_verified",
    "verify_universal",
]


def print_verified(found: dict[str, Any], what: str, *, as_json: bool) -> int:
    """Print what `verify OUT` found in a training-state output (`--to universal` or `--to
    dcp`): `OK|FAILED  OUT: <what>`, then one line per failure; 0 if it holds, else 1."""
    if as_json:
        print(json.dumps(found, indent=1))
    else:
        print(f"{'OK' if found['ok'] else 'FAILED'}  {found['output']}: {what}")
        for f in found["failures"]:
            print(f"  {f['file']}: {f['error']}")
    return 0 if found["ok"] else 1


def verify_universal(args: argparse.Namespace, storage: Storage) -> int:
    """`verify OUT` of a `--to universal` output: every file of its manifest again."""
    from zerosafe.training_state.universal import verify_universal_output

    if args.against:
        raise ConfigError("`--against` does not apply to a universal checkpoint yet")
    found = verify_universal_output(args.output, storage=storage)
    what = f"DeepSpeed universal checkpoint {found['folder']}, {found['num_files']} files checked"
    return print_verified(found, what, as_json=args.json)


def check_universal_args(args: argparse.Namespace) -> None:
    """`--to universal` / `--to dcp` take the checkpoint, the output and `--tag`; refuse what
    they ignore."""
    to = f"`--to {args.to}`"
    if args.to != "dcp" and args.dcp_layout != "torch":
        raise ConfigError("`--dcp-layout` applies only with `--to dcp`")
    if any(getattr(args, k, None) for k in ("quantize", "quantize_ignore", "quantize_like")):
        raise ConfigError(
            f"`--quantize` does not apply with {to}: training state keeps the float32 masters "
            "and Adam moments exact; quantize a `--to safetensors` release instead"
        )
    if args.dtype != "fp32":
        raise ConfigError(
            f"`--dtype` does not apply with {to}: it writes the float32 masters and Adam "
            "moments as they are"
        )
    if getattr(args, "work_dir", None):
        raise ConfigError(
            f"`--work-dir` does not apply with {to} yet: its unit records live in "
            "OUTPUT/.zerosafe-work"
        )
    if getattr(args, "via", "local") == "prefect":
        raise ConfigError(
            f"{to} runs in the command's own process only for now; drop `--via "
            "prefect` (or pass `--via local`)"
        )


def inspect_universal(args: argparse.Namespace, storage: Storage) -> int:
    from zerosafe.training_state import plan_universal

    check_universal_args(args)
    report = plan_universal(storage, args.checkpoint, tag=args.tag).to_json()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(
        f"--to universal: {report['num_params']} trained params of ZeRO-{report['zero_stage']} "
        f"(world size {report['world_size']}) into {report['folder']}/zero/<param>/"
        "{fp32,exp_avg,exp_avg_sq}.pt"
    )
    print(
        f"  reads {format_bytes(report['read_bytes'])} (masters "
        f"{format_bytes(report['masters_bytes'])}, moments {format_bytes(report['moments_bytes'])}, "
        f"model states {format_bytes(report['model_states_bytes'])}); writes "
        f"{format_bytes(report['output_bytes'])}"
    )
    for note in report["notes"]:
        print(f"  note: {note}")
    return 0


def convert_universal(args: argparse.Namespace, storage: Storage) -> int:
    """`convert --to universal`: in this process (`zerosafe.training_state`)."""
    from zerosafe.training_state import convert_to_universal

    check_universal_args(args)
    summary = convert_to_universal(
        args.checkpoint, args.output, tag=args.tag, storage=storage,
        overwrite=args.overwrite, keep_work=args.keep_work,
    )  # fmt: skip
    if args.json:
        print(json.dumps({**summary.to_json(), "via": "local"}, indent=1))
    elif summary.status == "already-complete":
        print(
            f"{args.output}: already a complete universal checkpoint of this checkpoint; nothing to do."
        )
    elif not args.quiet:
        print(
            f"wrote a DeepSpeed universal checkpoint of {summary.num_params} params into "
            f"{args.output}/{summary.folder} in {summary.seconds:.1f} s ({summary.files_written} "
            f"files; read {format_bytes(summary.bytes_read)} for "
            f"{format_bytes(summary.masters_bytes + summary.moments_bytes)} of masters and "
            f"moments; peak memory {format_bytes(summary.peak_rss_bytes)})"
        )
        print(
            f"  verified: every file written re-read and checked; "
            f"{summary.source_records_checked} checkpoint records matched their CRC-32"
        )
        if summary.units_kept:
            print(f"  resumed: kept {summary.units_kept} finished unit(s), ran {summary.units_run}")
        print(
            '  resume with `"checkpoint": {"load_universal": true}` and '
            f"`engine.load_checkpoint('{args.output}')`"
        )
        for note in summary.notes:
            print(f"  note: {note}")
    return 0
