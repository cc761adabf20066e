"""The `zerosafe` command: `inspect`, `convert`, `verify`, and the commands of
`EXTRA_COMMANDS`.

`convert` runs the engine's lifecycle (`zerosafe.pipeline`) in this process, or, where a
Prefect API is configured (or with `--via prefect`), the Prefect flow `convert` against it
(`zerosafe_app.flows.runtime`). Prefect is imported only on that path, torch only where a
conversion needs it. A `ConversionError` is printed as one line and exits 2; `verify` exits 1
when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from zerosafe._version import __version__
from zerosafe.errors import ConfigError, ConversionError, VerificationError
from zerosafe_app.arg_types import int_at_least, list_of, positive_size, seconds, size_argument
from zerosafe_app.option_table import FLAG_OF_FIELD, Scope, add_job_flags, options_values

if TYPE_CHECKING:
    from zerosafe.config import ConvertOptions
    from zerosafe.io.storage import Storage

__all__ = ["main", "run", "with_flag_names"]

log = logging.getLogger("zerosafe")

EXIT_OK, EXIT_CHECK_FAILED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141
INTERRUPTED = (
    "\nzerosafe: interrupted; nothing was marked complete. Run the same command again to resume."
)

EXTRA_COMMANDS: list[str] = [
    "zerosafe_app.pt2st_cli",
    "zerosafe_app.lazify_cli",
    "zerosafe_app.clean_cli",
]
"""Modules that add a command: each has `add_parser(subparsers, add_verbosity)`, which adds its
parser and sets `handler=` (a function of the parsed args returning the exit code) as a default."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (exit 2) that points at `--help`, instead of the
    whole usage block above the one line that matters."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def default_parallel() -> int:
    """`--parallel`'s default: half the cores this process may use, at least 2, at most 4.
    One task keeps about two cores busy (reads, casts, writes); on a 16-core machine, tasks as
    threads ran 1.7-2.0x one task's speed at 4 and no faster at 8 or 16 (docs/performance.md)."""
    from zerosafe.stages.workers import usable_cores

    return max(2, min(4, usable_cores() // 2))


def with_flag_names(e: ConfigError) -> ConfigError:
    """`e` with the `ConvertOptions` fields it names replaced by the flags a user typed."""
    message = str(e)
    for field, flag in {**FLAG_OF_FIELD, "`quantize_like`": "`--quantize-like`"}.items():
        message = message.replace(field, flag)
    return ConfigError(message)


def _add_plan_options(p: argparse.ArgumentParser) -> None:
    """The flags of what is planned (`inspect` and `convert`): the table's `Scope.PLAN`
    fields (`zerosafe_app.option_table`), the output kind, and the storage options."""
    add_job_flags(p, Scope.PLAN, only=("tag",))
    p.add_argument(
        "--to",
        default="safetensors",
        choices=["safetensors", "universal", "dcp"],
        help="what to write: safetensors weights (default), a DeepSpeed universal "
        "checkpoint (masters and Adam moments) that DeepSpeed resumes at any world size with "
        '`"checkpoint": {"load_universal": true}`, or a PyTorch DCP checkpoint of the model and '
        "AdamW state that FSDP2 resumes with `dcp.load` + `set_state_dict` "
        "(docs/training-state.md)",
    )
    p.add_argument(
        "--dcp-layout",
        default="torch",
        choices=["torch", "accelerate"],
        help="with `--to dcp`: one checkpoint of {'model', 'optim'} (default), or accelerate's "
        "FSDP2 folders pytorch_model_fsdp_0/ and optimizer_0/",
    )
    add_job_flags(p, Scope.PLAN, skip=("tag",))
    _add_quantize_like(p)
    _add_storage_option(p)


def _add_storage_option(p: argparse.ArgumentParser) -> None:
    from zerosafe.io.s3 import STORAGE_OPTION_HELP

    p.add_argument(
        "--storage-option", action="append", metavar="KEY=VALUE", help=STORAGE_OPTION_HELP
    )


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    from zerosafe.io.s3 import parse_option_pairs

    return parse_option_pairs(getattr(args, "storage_option", None) or [])


def _storage(args: argparse.Namespace) -> Storage:
    """Storage for the command's URLs; a `credentials` block reference needs Prefect."""
    from zerosafe.io.storage import Storage

    options = _storage_options(args)
    if "credentials" in options:
        from zerosafe_app.tasks.credentials import storage_for

        return storage_for(options)
    return Storage(options)


def _add_verbosity(p: argparse.ArgumentParser, *, top: bool) -> None:
    # Accepted before or after the command; under a command they only count when given.
    default: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument(
        "-v",
        "--verbose",
        action="count",
        help="more log output",
        **({"default": 0} if top else default),
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="errors only; no progress bar",
        **({"default": False} if top else default),
    )


CHECKPOINT_HELP = (
    "checkpoint folder: DeepSpeed ZeRO (holding 'latest') or a tag folder; DeepSpeed universal "
    "(holding 'latest_universal'); PyTorch DCP (holding '.metadata': FSDP2, torchtitan, "
    "accelerate, OLMo-core, ByteCheckpoint's model/); Megatron-LM torch_dist (a --save folder "
    "holding 'latest_checkpointed_iteration.txt', or its iter_NNNNNNN/); verl FSDP (holding "
    "'model_world_size_W_rank_R.pt'); torch_checkpointing (holding 'model_R.pt', or "
    "'model_R.safetensors' and 'metadata.pkl', per rank); "
    "HuggingFaceStorageWriter rank files "
    "('shard-0000R-model-*.safetensors'); a safetensors model folder ('model.safetensors' or "
    "its index); or the folder above one such save"
)
"""The formats of `zerosafe.formats.registry.READERS`, written out so that the command's
start-up does not import every reader (tests/app/test_cli.py checks each reader's title is
here, and in `DESCRIPTION`, the flow's docstring and the engine's)."""

DESCRIPTION = (
    "Convert sharded training checkpoints (DeepSpeed ZeRO, DeepSpeed universal, PyTorch DCP, "
    "Megatron-LM torch_dist, verl FSDP, torch_checkpointing, HuggingFaceStorageWriter rank "
    "files, a safetensors model folder) into verified safetensors or training state, "
    "streaming, without DeepSpeed or torch.distributed."
)
"""The command's description, its formats written out as `CHECKPOINT_HELP`'s are."""


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="zerosafe",
        description=DESCRIPTION,
    )
    parser.add_argument("--version", action="version", version=f"zerosafe {__version__}")
    _add_verbosity(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    _add_inspect(sub)
    _add_convert(sub)
    _add_verify(sub)
    for module in EXTRA_COMMANDS:
        importlib.import_module(module).add_parser(sub, _add_verbosity)
    return parser


def _add_inspect(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show what a checkpoint holds and what converting it costs")
    _add_verbosity(p, top=False)
    p.add_argument(
        "checkpoint",
        nargs="?",
        help=CHECKPOINT_HELP,
    )
    _add_plan_options(p)
    p.add_argument("--json", action="store_true", help="print the plan summary as JSON")
    sim = p.add_argument_group(
        "simulation", "plan a model described by shapes alone (no checkpoint, nothing read)"
    )
    sim.add_argument(
        "--simulate",
        metavar="SPEC",
        help="YAML/JSON model description (see conf/simulate-80b.yaml) to plan instead of a checkpoint",
    )
    sim.add_argument(
        "--world-size", type=int_at_least(1),
        help="with --simulate: override the spec's world size",
    )  # fmt: skip
    sim.add_argument(
        "--parallel", type=int_at_least(1), default=2, metavar="N", dest="max_parallel_tasks",
        help="tasks a worker runs at once, within --memory (default 2)",
    )  # fmt: skip
    sim.add_argument(
        "--extract-part-size", type=size_argument, metavar="SIZE",
        help="with --simulate, staged mode: a rank's bytes are extracted in parts of at most "
        "this (default 2GB)",
    )  # fmt: skip
    sim.add_argument(
        "--workers", type=list_of(int_at_least(1)), metavar="N,...",
        help="with --simulate: worker counts to predict wall time for (default 1,4,16,64)",
    )  # fmt: skip
    sim.add_argument(
        "--bandwidth", type=list_of(positive_size), metavar="SIZE,...",
        help="with --simulate: aggregate storage bandwidths per second (default 1GB,10GB)",
    )  # fmt: skip
    sim.add_argument(
        "--task-rate", type=positive_size, metavar="SIZE",
        help="with --simulate: bytes one task moves per second at most (default: measured 1GB)",
    )  # fmt: skip
    sim.add_argument(
        "--request-latency", type=seconds, metavar="SECONDS",
        help="with --simulate: wait per ranged read, e.g. 0.03 for an object store (default 0)",
    )  # fmt: skip


def _add_convert(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint tag into safetensors")
    _add_verbosity(p, top=False)
    p.add_argument(
        "checkpoint",
        help=CHECKPOINT_HELP,
    )
    p.add_argument("output", help="output folder")
    _add_plan_options(p)
    add_job_flags(p, Scope.CONVERT, defaults={"max_parallel_tasks": default_parallel()})
    p.add_argument(
        "--via",
        choices=["auto", "local", "prefect"],
        default="auto",
        help="where the conversion runs: local (in this process, no server), prefect (the "
        "Prefect flow, on the configured API or on a private server started for this "
        "command), auto (prefect where a Prefect API is configured, else local; default)",
    )
    p.add_argument("--json", action="store_true", help="print the run summary as JSON")


def _add_verify(sub: Any) -> None:
    p = sub.add_parser(
        "verify", help="check a safetensors output (exit 0 ok, 1 a check failed, 2 unreadable)"
    )
    _add_verbosity(p, top=False)
    p.add_argument("output", help="output folder (index + shards, or model.safetensors)")
    p.add_argument(
        "--against",
        metavar="CHECKPOINT",
        help="also check coverage and values against the source checkpoint",
    )
    p.add_argument("--tag", help="with --against: the checkpoint tag")
    _add_storage_option(p)
    p.add_argument("--allow-nonfinite", action="store_true", help="do not fail on NaN/Inf values")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _options(args: argparse.Namespace) -> ConvertOptions:
    from zerosafe.config import ConvertOptions, choose_mode

    if getattr(args, "dcp_layout", "torch") != "torch":
        raise ConfigError("`--dcp-layout` applies only with `--to dcp`")
    try:
        source = getattr(args, "checkpoint", None)
        if source:
            direct, why = choose_mode(source, args.mode)
        else:  # `inspect --simulate`: no source to choose by
            direct, why = args.mode == "direct", f"{args.mode}, as asked"
        values = {**options_values(vars(args)), **_quantize_like_options(args)}
        return ConvertOptions(direct=direct, mode_reason=why, **values)
    except ConfigError as e:
        raise with_flag_names(e) from e


def _quantize_like_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options `--quantize-like DIR` reads from a base release (none without it)."""
    like = getattr(args, "quantize_like", None)
    if like is None:
        return {}
    if getattr(args, "quantize", None):
        raise ConfigError("`--quantize-like` reads the scheme that `--quantize` gives: give one")
    from zerosafe.quantize_like import read_quantize_like

    base = read_quantize_like(_storage(args), like)
    ignore = (*base.ignore, *(getattr(args, "quantize_ignore", None) or ()))
    return {"quantize": base.quantize, "quantize_scale_fmt": base.scale_fmt,
            "quantize_ignore": ignore}  # fmt: skip


def _add_quantize_like(p: argparse.ArgumentParser) -> None:
    """`--quantize-like`: no job field of its own, it gives the `quantize*` fields."""
    p.add_argument(
        "--quantize-like",
        metavar="DIR",
        help="quantize as the release in DIR (local or s3://) is: the scheme, scale format and "
        "ignore list of its config.json's quantization_config; what cannot be reproduced "
        "exactly is refused, naming the field (not with --quantize)",
    )


_SIMULATION_ONLY = ("world_size", "extract_part_size", "workers", "bandwidth", "task_rate",
                    "request_latency")  # fmt: skip


def _cmd_simulate(args: argparse.Namespace) -> int:
    from zerosafe.formats.deepspeed import simulate

    options = _options(args)
    spec = simulate.load_spec(args.simulate, world_size=args.world_size)
    _, plan = simulate.simulate_plan(spec, options)
    report = simulate.simulation_report(
        spec, plan, options, workers=args.workers or [1, 4, 16, 64],
        bandwidths=[float(b) for b in args.bandwidth or [10**9, 10**10]],
        task_rate=args.task_rate or simulate.DEFAULT_TASK_RATE_BYTES,
        request_latency=args.request_latency or 0.0,
    )  # fmt: skip
    print(json.dumps(report, indent=1) if args.json else simulate.render_simulation(report))
    return EXIT_OK


def _cmd_inspect(args: argparse.Namespace) -> int:
    from zerosafe.plan.build import plan_checkpoint
    from zerosafe.plan.describe import describe_plan, render_inspect

    if args.simulate:
        if args.checkpoint:
            raise ConfigError("give a checkpoint or `--simulate SPEC`, not both")
        return _cmd_simulate(args)
    if not args.checkpoint:
        raise ConfigError("`inspect` needs a checkpoint folder (or `--simulate SPEC`)")
    given = [f"--{n.replace('_', '-')}" for n in _SIMULATION_ONLY if getattr(args, n) is not None]
    if given:
        raise ConfigError(
            f"`{given[0]}` applies only with `--simulate SPEC`; drop it to inspect a checkpoint"
        )
    if args.to == "universal":
        from zerosafe_app.cli_universal import inspect_universal

        return inspect_universal(args, _storage(args))
    if args.to == "dcp":
        from zerosafe_app.cli_universal import check_universal_args
        from zerosafe_app.dcp_cli import inspect_dcp

        check_universal_args(args)
        return inspect_dcp(args, _storage(args))
    options = _options(args)
    storage = _storage(args)
    layout, plan = plan_checkpoint(storage, args.checkpoint, tag=args.tag, options=options)
    report = describe_plan(layout, plan, options, metadata_bytes_read=storage.counter.bytes_read)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_inspect(report))
    return EXIT_OK


def _check_before_starting(args: argparse.Namespace, options: ConvertOptions) -> str | None:
    """Refuse what is plainly wrong in well under a second, before the flow (and the embedded
    Prefect server, seconds to start) begins: a folder that holds no checkpoint, a tag that is
    not there, an output inside the checkpoint (or holding it), an output holding another kind
    of output, an output that cannot be written. The flow checks everything again.

    Returns:
        The job key when the output already holds this very conversion, intact (the same
        stat-only check the flow's inspect makes first): then there is nothing to run.
    """
    from zerosafe.formats.registry import check_options, find_save
    from zerosafe.io.storage import normalize_url
    from zerosafe.stages.destination import check_output_apart, check_output_kind
    from zerosafe.stages.output import quick_done

    source, output = normalize_url(args.checkpoint), normalize_url(args.output)
    storage = _storage(args)
    check_output_apart(storage, source, output)
    if not options.overwrite:  # with it, the lifecycle replaces another kind's output
        check_output_kind(storage, output, "weights", overwrite=False)
    found = find_save(storage, source, args.tag)  # the save one level down, where nested
    check_options(found.reader, found.url, options)
    found.reader.quick_identities(storage, found.url, args.tag)
    storage.ensure_folder(output)
    return quick_done(storage, source, args.tag, output, options)


def _cmd_convert(args: argparse.Namespace) -> int:
    from zerosafe.stages.progress import NullProgress, TerminalProgress
    from zerosafe.stages.results import RunSummary
    from zerosafe_app.cli_report import print_convert_result
    from zerosafe_app.cli_run import convert_with_flow, preload, route

    if args.to == "universal":
        from zerosafe_app.cli_universal import convert_universal

        return convert_universal(args, _storage(args))
    if args.to == "dcp":
        from zerosafe_app.cli_universal import check_universal_args
        from zerosafe_app.dcp_cli import convert_dcp

        check_universal_args(args)
        return convert_dcp(args, _storage(args))
    options = _options(args)
    show_progress = not args.quiet and not args.json and sys.stderr.isatty()
    done = _check_before_starting(args, options)
    via, why, api = route(args.via)
    summary: RunSummary
    if done is not None:  # complete and intact: no checkpoint byte read, nothing started
        summary = RunSummary.already_complete(args.output, done)
    elif via == "local":
        from zerosafe.cast import output_needs_torch, serial_torch

        serial_torch()  # this process runs its own threads; applied when torch is imported
        if output_needs_torch(options.dtype):  # bfloat16 and float32 are cast without it
            preload("torch", then=serial_torch)  # beside the planning, not before it
        from zerosafe.driver import convert_checkpoint
        from zerosafe.stages.workers import worker_mode

        # The command runs a job of 2 GB or more in worker processes unless ZEROSAFE_WORKERS
        # says otherwise (a library call keeps threads: docs/performance.md).
        summary = convert_checkpoint(
            args.checkpoint, args.output, options, tag=args.tag, work_url=args.work_dir,
            progress=TerminalProgress() if show_progress else NullProgress(), storage=_storage(args),
            workers=worker_mode(None, default="auto"),
        )  # fmt: skip
    else:
        from zerosafe.cast import output_needs_torch

        if output_needs_torch(options.dtype):
            preload("torch")
        summary = convert_with_flow(
            args, options, show_progress=show_progress, api=api,
            storage_options=_storage_options(args), mode=args.mode,
        )  # fmt: skip
    print_convert_result(
        args.output, summary, via=via, why=why, as_json=args.json, quiet=args.quiet
    )
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from zerosafe.training_state.dcp import is_dcp_output
    from zerosafe.training_state.universal import is_universal_output
    from zerosafe.verify.output import render_verify, verify_output

    storage = _storage(args)
    if is_dcp_output(storage, args.output):
        from zerosafe_app.dcp_cli import verify_dcp

        return verify_dcp(args, storage)
    if is_universal_output(storage, args.output):
        from zerosafe_app.cli_universal import verify_universal

        return verify_universal(args, storage)
    report = verify_output(
        args.output, against=args.against, tag=args.tag, allow_nonfinite=args.allow_nonfinite,
        storage=storage,
    )  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_verify(report))
    return EXIT_OK if report["ok"] else EXIT_CHECK_FAILED


def _setup_logging(args: argparse.Namespace) -> None:
    # Other libraries stay at WARNING even with -v (httpx, websockets, fsspec are chatty).
    level = logging.ERROR if args.quiet else (logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=level, format="zerosafe: %(levelname)s: %(message)s")
    logging.getLogger().setLevel(logging.ERROR if args.quiet else logging.WARNING)
    logging.getLogger("zerosafe").setLevel(
        logging.ERROR
        if args.quiet
        else {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    _setup_logging(args)
    handler = getattr(args, "handler", None) or {
        "inspect": _cmd_inspect, "convert": _cmd_convert, "verify": _cmd_verify
    }[args.command]  # fmt: skip
    args.storage_factory = functools.partial(_storage, args)
    try:
        os.getcwd()
    except FileNotFoundError:
        print(
            "zerosafe: error: the working folder no longer exists (it was deleted or moved); "
            "cd to an existing folder and run the command again",
            file=sys.stderr,
        )
        return EXIT_ERROR
    try:
        return handler(args)
    except VerificationError as e:
        print(f"zerosafe: verification failed: {e}", file=sys.stderr)
        return EXIT_ERROR
    except ConversionError as e:
        print(f"zerosafe: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED


def run() -> None:
    """The `zerosafe` command: `main` in this process, then exit.

    A reader that closes the output early (`zerosafe inspect ... | head`) ends the command
    with one line on stderr and exit code 141 (128 + SIGPIPE, what a shell reports for a
    writer killed by the signal), not a traceback.
    """
    try:
        code = main(sys.argv[1:])
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would report the pipe again while flushing stdout at exit: point it away.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        with contextlib.suppress(OSError):
            print(
                "zerosafe: output stopped: the reading end of the pipe was closed", file=sys.stderr
            )
        code = EXIT_PIPE
    finish_process(code)


def finish_process(code: int) -> NoReturn:
    """Exit with `code` once a command is done.

    After a flow ran, the interpreter's own teardown of Prefect (its threads, loops and
    clients) costs a second or more, and the command has nothing left to do: every file is
    committed and the lease released. So the command sends Prefect's queued logs and events
    to the server (bounded), flushes its own output and exits at once. `main` stays a plain
    function for callers in a process that goes on (tests, notebooks).
    """
    prefect_services = sys.modules.get("prefect._internal.concurrency.services")
    if prefect_services is None:
        sys.exit(code)
    with contextlib.suppress(Exception):
        prefect_services.QueueService.drain_all(timeout=5)
    logging.shutdown()
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
