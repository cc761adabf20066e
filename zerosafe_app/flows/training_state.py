"""`--to universal` and `--to dcp` as a Prefect flow: the training-state lifecycle
(`zerosafe.targets.lifecycle`) with each unit a Prefect task.

The flow holds the output folder and the work area as the command's own process does, then
submits one task per unit, cached by the unit's record key (target, job key, unit, what it
writes) with its result persisted in the work area, so a flow run killed at any point and
started again redoes no unit that had finished: a finished unit's task shows as Cached. A unit
whose files are gone or changed size is run again (its cache refreshed). The tasks run on the
flow's own threads (`--parallel` within `--memory`), since the run holds the leases; then every
file is checked and the output published, the marker last.

`convert(..., to="universal")` dispatches here (`zerosafe_app.flows.convert`); `zerosafe convert
--to universal --via prefect` runs that flow embedded (`zerosafe_app.cli_run.run_state_flow`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from prefect import flow, get_run_logger, task
from prefect.task_runners import ThreadPoolTaskRunner

from zerosafe.config import DEFAULT_MEMORY_BYTES
from zerosafe.errors import ConfigError
from zerosafe.io.storage import is_local, join_url, local_path
from zerosafe.targets.base import OutputTarget, StateOptions, UnitSpec, UnitWork
from zerosafe.targets.lifecycle import TargetRun, hold_target
from zerosafe.targets.registry import get_target
from zerosafe.units import parse_size
from zerosafe_app.flows.config import JobConfig
from zerosafe_app.tasks.credentials import storage_for

__all__ = ["dispatch", "training_state"]

STATE_TARGETS = ("universal", "dcp")


def _unit_key(context: Any, parameters: dict[str, Any]) -> str:
    run = cast("TargetRun", parameters["run"])
    return f"{run.target.name}-unit-{run.unit_key(cast('UnitSpec', parameters['unit']))}"


@task(
    name="state-unit", task_run_name="{unit.kind} unit {unit.index}", cache_key_fn=_unit_key,
    persist_result=True,
)  # fmt: skip
def state_unit(run: TargetRun, unit: UnitSpec) -> dict[str, Any]:
    """One unit of a training-state target: written (or kept, when recorded and intact) and
    recorded; returns its record (the files written and the source CRC-32s read)."""
    return run.run_unit(unit).record(unit.kind)


def _result_storage(work_url: str) -> Any:
    """The unit tasks' results, in the job's work area (a local one; a remote work area keeps
    Prefect's default storage, and the unit records there still make a rerun skip the unit)."""
    url = join_url(work_url, "results")
    return Path(local_path(url)).resolve() if is_local(url) else None


def _run_units(run: TargetRun) -> dict[int, UnitWork]:
    """Submit every unit as a task, a finished one served from the cache; wait for all."""
    results = _result_storage(run.work_url)
    futures = {}
    for unit in run.units():
        refresh = run.kept(unit) is None  # not recorded, or its files gone: a cache hit lies
        submit = state_unit.with_options(
            refresh_cache=refresh, **({"result_storage": results} if results else {})
        )
        futures[unit.index] = (unit, submit.submit(run, unit))
    done = {}
    for index, (_, future) in futures.items():
        record = future.result()
        if future.state.name == "Cached":  # the task did not run: the unit was kept
            run.count_kept()
        done[index] = UnitWork.from_record(record)
    return done


def _threads(count: int) -> Any:
    """The unit tasks' runner: threads of the flow's process, which holds the leases."""
    return ThreadPoolTaskRunner(max_workers=count)


@flow(name="convert-training-state", log_prints=False, task_runner=_threads(2))
def training_state(
    source: str,
    destination: str,
    to: str = "universal",
    tag: str | None = None,
    memory: str | int | None = None,
    max_parallel_tasks: int | None = None,
    overwrite: bool = False,
    keep_work: bool = False,
    dcp_layout: str = "torch",
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write the training state of a DeepSpeed ZeRO checkpoint: `to` is `universal` (a
    DeepSpeed universal checkpoint) or `dcp` (a PyTorch DCP checkpoint; `dcp_layout` `torch` or
    `accelerate`). Returns the run summary (`convert --to ... --json`'s keys)."""
    entry = get_target(to)
    if entry.target is None or to not in STATE_TARGETS:
        raise ConfigError(f"`to={to}`: the training-state flow writes {', '.join(STATE_TARGETS)}")
    storage = storage_for(storage_options)
    options = StateOptions(
        memory=parse_size(memory) if memory is not None else DEFAULT_MEMORY_BYTES,
        parallel=max_parallel_tasks or 2, overwrite=overwrite, keep_work=keep_work,
    )  # fmt: skip
    kwargs: dict[str, Any] = {"tag": tag, **({"layout": dcp_layout} if to == "dcp" else {})}

    def open_target() -> OutputTarget:
        return cast("OutputTarget", entry.load(entry.target)(storage, source, **kwargs))

    name = cast("Any", to)
    with hold_target(name, open_target, storage, source, destination, options) as run:
        if run.complete:
            get_run_logger().info("%s already holds this conversion; nothing to do", destination)
        else:
            run.publish(_run_units(run))
    summary = run.finish().to_json()
    get_run_logger().info("%s: %s (--to %s)", destination, summary["status"], to)
    return summary


def dispatch(cfg: JobConfig) -> Any:
    """The `convert` flow's `to: universal|dcp` branch: the training-state flow as its subflow,
    with the job's fields that apply; a weights-only field set is refused in one line."""
    defaults = JobConfig(source=cfg.source, destination=cfg.destination, to=cfg.to)
    ignored = [
        k for k in ("dtype", "select", "strip_prefix", "quantize", "quantize_ignore",
                    "keep_fp32", "work_dir", "runner", "dask_address", "extract_part_size",
                    "max_shard_size", "tied", "exclude_frozen", "allow_nonfinite",
                    "check_lowp", "file_sha256", "adapter")
        if getattr(cfg, k) != getattr(defaults, k)
    ]  # fmt: skip
    if ignored:
        raise ConfigError(
            f"`{ignored[0]}` does not apply with `to: {cfg.to}`: training state keeps the "
            "float32 masters and Adam moments as they are (docs/training-state.md)"
        )
    options = StateOptions(memory=cfg.memory, parallel=cfg.max_parallel_tasks)
    runner = _threads(options.tasks_at_once)
    return training_state.with_options(task_runner=runner, timeout_seconds=cfg.timeout_seconds)(
        source=cfg.source, destination=cfg.destination, to=cfg.to, tag=cfg.tag,
        memory=cfg.memory, max_parallel_tasks=cfg.max_parallel_tasks,
        overwrite=cfg.overwrite, keep_work=cfg.keep_work, dcp_layout=cfg.dcp_layout,
        storage_options=cfg.storage_options,
    )  # fmt: skip
