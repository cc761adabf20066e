"""Where `zerosafe convert` runs: in the command's own process, or as the Prefect flow
`convert` on the configured API or on a private server of the command."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from zerosafe.errors import ConversionError

if TYPE_CHECKING:
    from zerosafe.config import ConvertOptions
    from zerosafe.stages.results import RunSummary

__all__ = [
    "convert_with_flow",
    "lost_api",
    "prefect_api",
    "preload",
    "route",
    "run_state_flow",
]


def preload(module: str, then: Callable[[], None] | None = None) -> None:
    """Import `module` in a background thread, then call `then` there: torch takes a second to
    import and the merge needs it only after the checkpoint is read and planned (and, with the
    flow, after Prefect is imported and the run created), so its import overlaps that work. A
    later `import` of it waits for this one (the import lock), never runs it twice."""

    def load() -> None:
        with contextlib.suppress(Exception):  # the real import reports any problem
            importlib.import_module(module)
            if then is not None:
                then()

    threading.Thread(target=load, name=f"zerosafe-preload-{module}", daemon=True).start()


def route(via: str) -> tuple[str, str, str | None]:
    """Where `convert` runs: (`local` or `prefect`, why, the configured Prefect API or None)."""
    from zerosafe_app.flows.runtime import configured_api

    if via == "local":
        return "local", "in this process (--via local)", None
    api = configured_api()
    if api is not None:
        return "prefect", f"the Prefect flow on {api[0]} ({api[1]})", api[0]
    if via == "prefect":
        return (
            "prefect",
            "the Prefect flow on a private server of this command (--via prefect)",
            None,
        )
    return "local", "in this process (no Prefect API configured; --via prefect runs the flow)", None


def convert_with_flow(
    args: argparse.Namespace,
    options: ConvertOptions,
    *,
    show_progress: bool,
    api: str | None,
    storage_options: dict[str, Any],
    mode: str,
) -> RunSummary:
    """Run the flow `convert` against the configured Prefect API, or, with none, against a
    private server that ends with this command."""
    with prefect_api(args, api):
        from zerosafe_app.flows.convert import run_convert  # Prefect only from here on

        try:
            return run_convert(
                args.checkpoint, args.output, options, tag=args.tag, work_url=args.work_dir,
                show_progress=show_progress, quiet=args.quiet,
                storage_options=storage_options, mode=mode,
            )  # fmt: skip
        except Exception as e:
            if not lost_api(e):
                raise
            raise ConversionError(
                f"the Prefect API at {os.environ.get('PREFECT_API_URL')} stopped answering "
                f"({type(e).__name__}: {e}); nothing was marked complete and finished work is "
                "kept: start the server again (or use --via local) and run the same command"
            ) from e


@contextlib.contextmanager
def prefect_api(args: argparse.Namespace, api: str | None) -> Iterator[None]:
    """Prefect configured for a flow this command runs: against `api`, or, with none, a
    private server that ends with the block."""
    from zerosafe_app.flows.runtime import configure_embedded_prefect, private_server, use_api

    configure_embedded_prefect(verbose=args.verbose)
    with contextlib.ExitStack() as stack:
        if api is None:
            stack.enter_context(use_api(*stack.enter_context(private_server())))
        yield


def run_state_flow(
    args: argparse.Namespace, storage_options: dict[str, Any], api: str | None
) -> dict[str, Any]:
    """`convert --to universal|dcp` as the flow `convert` with `to`, embedded (against `api`,
    else a private server); returns its summary. A `ConversionError` raises here (one line,
    exit 2)."""
    with prefect_api(args, api):
        from prefect.client.schemas.objects import State

        from zerosafe_app.flows.convert import convert, flow_result

        state = convert(
            source=args.checkpoint, destination=args.output, to=args.to, tag=args.tag,
            memory=str(args.memory), max_parallel_tasks=args.max_parallel_tasks,
            overwrite=args.overwrite, keep_work=args.keep_work, dcp_layout=args.dcp_layout,
            storage_options=storage_options, return_state=True,
        )  # fmt: skip
        assert isinstance(state, State)
        result: dict[str, Any] = flow_result(state)
        return result


def lost_api(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is the Prefect API going away mid-run: a refused
    or dropped connection, or a timeout, from the HTTP client."""
    import httpx

    seen: BaseException | None = error
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, httpx.TransportError | ConnectionError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
