"""`zerosafe inspect|convert --to universal`: a DeepSpeed universal checkpoint
(`zerosafe.training_state`), written in the command's own process or as the Prefect flow
`convert` with `to`; `run_state` runs `--to dcp` the same way."""

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
    "print_state_tail",
    "print_verified",
    "run_state",
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


def run_state(args: argparse.Namespace, storage: Storage) -> dict[str, Any]:
    """`convert --to universal|dcp`: the target (`zerosafe.targets.registry`) in this process,
    or, where a Prefect API is configured or with `--via prefect`, the flow `convert` with
    `to` (each unit a cached task). Returns the run summary's JSON, with `via`."""
    from zerosafe.targets.registry import get_target
    from zerosafe_app.cli_run import route, run_state_flow

    check_universal_args(args)
    via, _, api = route(args.via)
    layout = {"layout": args.dcp_layout} if args.to == "dcp" else {}
    if via == "local":
        summary = get_target(args.to).load()(
            args.checkpoint, args.output, tag=args.tag, storage=storage, memory=args.memory,
            parallel=args.max_parallel_tasks, overwrite=args.overwrite,
            keep_work=args.keep_work, **layout,
        ).to_json()  # fmt: skip
    else:
        from zerosafe.io.s3 import parse_option_pairs

        options = parse_option_pairs(getattr(args, "storage_option", None) or [])
        summary = run_state_flow(args, options, api)
    return {**summary, "via": via}


def convert_universal(args: argparse.Namespace, storage: Storage) -> int:
    """`convert --to universal`: `run_state`, then what it did."""
    s = run_state(args, storage)
    if args.json:
        print(json.dumps(s, indent=1))
    elif s["status"] == "already-complete":
        print(
            f"{args.output}: already a complete universal checkpoint of this checkpoint; nothing to do."
        )
    elif not args.quiet:
        print(
            f"wrote a DeepSpeed universal checkpoint of {s['num_params']} params into "
            f"{args.output}/{s['folder']} in {s['seconds']:.1f} s ({s['files_written']} "
            f"files; read {format_bytes(s['bytes_read'])} for "
            f"{format_bytes(s['masters_bytes'] + s['moments_bytes'])} of masters and "
            f"moments; {s['parallel']} unit(s) at once; peak memory "
            f"{format_bytes(s['peak_rss_bytes'])})"
        )
        print_state_tail(s, "file written")
        print(
            '  resume with `"checkpoint": {"load_universal": true}` and '
            f"`engine.load_checkpoint('{args.output}')`"
        )
        for note in s["notes"]:
            print(f"  note: {note}")
    return 0


def print_state_tail(s: dict[str, Any], what: str) -> None:
    """The lines every training-state summary shares: verified, resumed, and where it ran."""
    print(
        f"  verified: every {what} re-read and checked; "
        f"{s['source_records_checked']} checkpoint records matched their CRC-32"
    )
    if s["units_kept"]:
        print(f"  resumed: kept {s['units_kept']} finished unit(s), ran {s['units_run']}")
    if s["via"] == "prefect":
        print("  ran as the Prefect flow `convert` (a subflow per run, each unit a cached task)")
