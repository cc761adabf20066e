"""The flow `convert`: inspect -> extract[part] -> merge[shard] -> verify[shard] -> publish.

Deployments reference `flows/convert.py:convert`. Its parameters are the job config's fields,
flat (so the Prefect UI shows a form and `--param dtype=bf16` works), plus `conf`, a YAML job
file they override. `zerosafe convert` runs this same flow, embedded.

Each stage task is cached by (stage, job key, unit, content fingerprint of its inputs) with
results persisted in the work area, so a killed run started again skips every task whose
output is complete and still present. Before submitting a task the flow checks that output
on disk and refreshes the cache where it vanished or changed.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, tags
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.runtime import deployment as deployment_run
from prefect.runtime import flow_run
from prefect.states import Completed, Failed
from prefect.task_runners import ThreadPoolTaskRunner

from zerosafe.config import ConvertOptions
from zerosafe.errors import ConversionError, VerificationError
from zerosafe.formats.base import SourceDescription
from zerosafe.io.lease import Lease
from zerosafe.io.storage import Storage, is_local, join_url
from zerosafe.pipeline import (
    cleanup_warning,
    hold_destination,
    hold_work,
    parts_to_extract,
    run_stats,
    stage_bytes,
    summarize,
    unit_process_options,
)
from zerosafe.stages.results import JobPlan, PublishResult, RunStats, RunSummary, VerifyResult
from zerosafe.stages.workers import processes_note, worker_mode
from zerosafe.units import format_bytes
from zerosafe_app.flows.config import JobConfig, flow_parameters, load_job_config
from zerosafe_app.flows.schedule import StageResults, StageScheduler
from zerosafe_app.tasks._common import (
    Job,
    close_workers,
    read_journal,
    set_progress,
    stage_memory,
    workers_peak_rss,
)
from zerosafe_app.tasks._common import progress as task_progress
from zerosafe_app.tasks.credentials import storage_for
from zerosafe_app.tasks.inspect import inspect
from zerosafe_app.tasks.merge import reusable_shards
from zerosafe_app.tasks.publish import finish, publish

__all__ = ["convert", "run_convert"]


def _task_runner(cfg: JobConfig, options: ConvertOptions) -> Any:
    if cfg.runner == "dask":
        from prefect_dask.task_runners import DaskTaskRunner

        return DaskTaskRunner(address=cfg.dask_address)
    return ThreadPoolTaskRunner(max_workers=options.parallel_tasks)


def _short(url: str | None, tag: str | None = None) -> str:
    """The last two parts of a URL or path (`llm/checkpoints`), then the tag if one is given."""
    if not url:
        return "?"
    parts = [p for p in re.split(r"[/\\]+", url.split("://", 1)[-1]) if p]
    text = "/".join(parts[-2:]) or url
    return f"{parts[-1] if parts else url}/{tag}" if tag else text


def job_slug(destination: str) -> str:
    """A key for one job's artifacts, from its destination: readable, and unique by a hash
    (Prefect artifact keys allow lowercase letters, digits and dashes)."""
    readable = re.sub(r"[^a-z0-9]+", "-", _short(destination).lower()).strip("-")[:40]
    digest = hashlib.sha256(destination.encode()).hexdigest()[:8]
    return f"{readable}-{digest}" if readable else digest


def _run_name_of(params: dict[str, Any]) -> str:
    source, destination, tag = params.get("source"), params.get("destination"), params.get("tag")
    if (not source or not destination) and params.get("conf"):
        try:
            cfg = load_job_config(
                params["conf"], **{k: v for k, v in params.items() if k in JobConfig.model_fields}
            )
            source, destination, tag = cfg.source, cfg.destination, tag or cfg.tag
        except Exception:  # a bad job file fails the run itself, with its own message
            pass
    return f"convert {_short(source, tag)} -> {_short(destination)}"


def _convert_run_name() -> str:
    """`convert llm/global_step1000 -> hf/step1000`: what the run converts, not random words."""
    return _run_name_of(dict(flow_run.parameters or {}))


_RETURNED: dict[UUID, Any] = {}
_RETURNED_KEPT = 64  # flow runs no caller here collects (a worker's top-level runs)
_RETURNED_LOCK = threading.Lock()


def _hand_back(value: Any) -> Any:
    """Keep what this flow run returns in this process too, for `_result_of` (a flow run here
    is a subflow, or the command's own run). Prefect hands a return value back through the
    run's final state; when the server's answer to that state change is lost, the client sends
    it again, the server refuses the repeat and answers with the state it stored, which holds
    no data (flow results are not persisted), and reading it raises `MissingResult` after a
    finished conversion."""
    run_id = FlowRunContext.get().flow_run.id  # type: ignore[union-attr]  # inside a flow run
    with _RETURNED_LOCK:
        while len(_RETURNED) >= _RETURNED_KEPT:
            del _RETURNED[next(iter(_RETURNED))]
        _RETURNED[run_id] = value
    return value


def _result_of(state: State[Any], *, raise_on_failure: bool = True) -> Any:
    """The result of the flow run that ended in `state`, from what it returned in this process
    (`_hand_back`): its value, or the result of the state it returned (a Failed state's error,
    raised unless `raise_on_failure` is false). A run that raised returned nothing: then
    `state`'s own result, the error."""
    run_id = state.state_details.flow_run_id
    with _RETURNED_LOCK:
        returned = _RETURNED.pop(run_id, state) if run_id is not None else state
    if isinstance(returned, State):
        return returned.result(raise_on_failure=raise_on_failure)
    return returned


def failure_message(e: ConversionError, cfg: JobConfig | None = None) -> str:
    """The one line a user needs for a permanent error: the error's own message (file,
    expected, found, fix), and, on a worker, where local paths were read."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = f"{type(e).__name__}: {text}"
    urls = [u for u in ((cfg.source, cfg.destination) if cfg else ()) if u]
    on_worker = deployment_run.id or flow_run.parent_deployment_id
    if on_worker and any(is_local(u) for u in urls):
        text += (
            f" (local paths are read on the machine that runs the flow, {socket.gethostname()};"
            " they must exist there)"
        )
    return text


@flow(name="convert", log_prints=False, flow_run_name=_convert_run_name)
def convert(
    source: str | None = None,
    destination: str | None = None,
    conf: str | None = None,
    tag: str | None = None,
    select: list[str] | None = None,
    strip_prefix: str | None = None,
    keep_names: bool | None = None,
    dtype: str | None = None,
    max_shard_size: str | None = None,
    memory: str | None = None,
    max_parallel_tasks: int | None = None,
    mode: str | None = None,
    tied: str | None = None,
    exclude_frozen: bool | None = None,
    overwrite: bool | None = None,
    keep_work: bool | None = None,
    allow_nonfinite: bool | None = None,
    check_lowp: bool | None = None,
    file_sha256: bool | None = None,
    keep_fp32: list[str] | None = None,
    model_files: str | None = None,
    copy_model_files: bool | None = None,
    adapter: bool | None = None,
    quantize: str | None = None,
    quantize_ignore: list[str] | None = None,
    quantize_scale_fmt: str | None = None,
    extract_part_size: str | None = None,
    work_dir: str | None = None,
    runner: str | None = None,
    dask_address: str | None = None,
    storage_options: dict[str, Any] | None = None,
    timeout_seconds: int | None = None,
) -> Any:
    """Convert one checkpoint (DeepSpeed ZeRO, DeepSpeed universal, PyTorch DCP, Megatron-LM
    torch_dist, verl FSDP, torch_checkpointing, HuggingFaceStorageWriter rank files or a
    safetensors model folder) into verified safetensors.

    The stages run in a subflow, `convert-job`, so this flow can pick its task runner. The
    subflow carries this run's tags; this run's state message and its link artifact name the
    subflow, and a permanent error (bad input or options) fails both with the one-line message,
    without a traceback.

    Args:
        source: The checkpoint's folder, of one of the formats above (`zerosafe convert
            --help` says what a folder of each holds), or the folder above one save.
        destination: The output folder.
        conf: A YAML job file (see conf/example.yaml); the other parameters override it.
    """
    # Every parameter but `conf` is a job field, by name (tests/app/test_option_table.py
    # keeps this signature equal to `JOB_FIELDS`); taken before any other local exists.
    params = {name: value for name, value in dict(locals()).items() if name != "conf"}
    log = get_run_logger()
    try:
        cfg = load_job_config(conf, **params)
    except ConversionError as e:
        message = failure_message(e)
        log.error("%s", message)
        _announce_failure(message, destination or "")
        return _hand_back(Failed(message=message, data=e))
    job_flow = run_job.with_options(
        task_runner=_task_runner(cfg, cfg.options()),
        timeout_seconds=cfg.timeout_seconds,
        flow_run_name=_run_name_of(cfg.model_dump()).replace("convert ", "convert-job ", 1),
    )
    with tags(*(flow_run.tags or [])):  # so filtering runs by tag finds the subflow too
        # A sync flow called with `return_state=True` returns its State.
        state = cast("State[Any]", job_flow(cfg, return_state=True))
    child = state.state_details.flow_run_id
    where = f"stages, logs and artifacts in subflow run {_run_ref(child)}"
    if child is not None:
        create_link_artifact(
            _flow_run_url(child) or f"flow-run/{child}",
            link_text=f"convert-job run of {cfg.destination}",
            key=f"zerosafe-{job_slug(cfg.destination)}-run",
            description=f"The `convert-job` subflow run that holds this job's task runs and artifacts (`{cfg.destination}`).",
        )
    if state.is_failed() or state.is_crashed() or state.is_cancelled():
        error = _result_of(state, raise_on_failure=False)
        if not isinstance(error, ConversionError):
            return _hand_back(state)  # an unexpected error: its traceback is in the subflow's logs
        message = state.message or failure_message(error, cfg)
        log.error("%s (%s)", message, where)
        _announce_failure(message, cfg.destination)
        return _hand_back(Failed(message=f"{message} ({where})", data=error))
    result = _result_of(state)
    log.info("%s: %s (%s)", cfg.destination, result["status"], where)
    return _hand_back(
        Completed(message=f"{result['status']}: {cfg.destination} ({where})", data=result)
    )


def _announce_failure(message: str, destination: str) -> None:
    """An event naming the error, related to this run, sent before the run turns Failed:
    `prefect deployment run --watch` prints the run's events (its log lines only when the
    server streams logs out), so the one line shows there too."""
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    emit_event(
        event="zerosafe.pipeline.failed",
        resource={
            "prefect.resource.id": f"zerosafe.job.{job_slug(destination)}",
            "prefect.resource.name": message,
        },
        related=[
            {
                "prefect.resource.id": f"prefect.flow-run.{flow_run.id}",
                "prefect.resource.role": "flow-run",
            }
        ],
    )
    EventsWorker.instance().wait_until_empty()


def _flow_run_url(flow_run_id: Any) -> str | None:
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return f"{ui.rstrip('/')}/runs/flow-run/{flow_run_id}" if ui else None


def _run_ref(flow_run_id: Any) -> str:
    return f"{flow_run_id}" + (f" ({url})" if (url := _flow_run_url(flow_run_id)) else "")


def _result_storage(work: str, storage_options: dict[str, Any]) -> Any:
    """Where task results and cache records live: the job's work area, so every worker (and
    the next run) finds them. A local area is given as a `Path`; a remote one as a saved
    block (Prefect reads a plain string as a block name, and refuses unsaved blocks) whose
    settings are the job's secret-free storage options: credentials stay a reference, resolved
    where the results are read or written (`zerosafe_app.flows.results`)."""
    from zerosafe.io.storage import local_path

    url = join_url(work, "results")
    if is_local(url):
        return Path(local_path(url)).resolve()
    from zerosafe_app.flows.results import WorkAreaResults

    block = WorkAreaResults(basepath=url, settings=storage_options)
    block.save(f"zerosafe-results-{hashlib.sha256(url.encode()).hexdigest()[:16]}", overwrite=True)
    return block


class _Progress:
    """The run's progress artifact, advanced by the bytes each finished task handled."""

    def __init__(self, stages: dict[str, int], *, key: str) -> None:
        total_bytes = sum(stages.values())
        self.total = max(total_bytes, 1)
        self.done = 0
        # The terminal bar, when run embedded: each stage's bytes against its own total.
        task_progress().start("convert", total_bytes, stages=stages)
        artifact_id = create_progress_artifact(
            progress=0.0, key=key, description="zerosafe: bytes processed (extract, merge, verify)"
        )
        assert isinstance(artifact_id, UUID)  # the sync API, called from a sync flow
        self.id = artifact_id

    def add(self, num_bytes: int) -> None:
        self.done += num_bytes
        update_progress_artifact(self.id, progress=min(100.0, 100.0 * self.done / self.total))


@flow(name="convert-job", log_prints=False)
def run_job(config: JobConfig) -> Any:
    """The stages of one validated job (a subflow, so `convert` can pick the task runner).

    `config` is the very value `convert` validated (a model instance is not validated
    again), with the `ConvertOptions` computed then: every task gets that one value.

    A `ConversionError` (bad input, options or output: permanent, so never retried) ends the
    run in a Failed state whose message is the error's one line, with a failure artifact
    saying the same; any other error raises, with its traceback.
    """
    cfg = config
    try:
        return _hand_back(_run_job(cfg))
    except ConversionError as e:
        message = failure_message(e, cfg)
        get_run_logger().error("%s", message)
        if not isinstance(e, VerificationError):  # that one has its own table of failures
            create_markdown_artifact(
                f"# zerosafe: conversion failed\n\n{_md(message)}\n\n"
                f"- source: `{cfg.source}`\n- destination: `{cfg.destination}`\n"
                "- nothing was published; fix the cause and run again (finished work is kept)\n",
                key=f"zerosafe-{job_slug(cfg.destination)}-failure",
                description="Why the conversion failed",
            )
        return _hand_back(Failed(message=message, data=e))


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def _run_job(cfg: JobConfig) -> dict[str, Any]:
    started = time.monotonic()
    storage = storage_for(cfg.storage_options)
    with hold_destination(storage, cfg.source, cfg.destination) as out_lease:
        return _run_held(cfg, storage, out_lease, started=started).to_json()


def _run_held(cfg: JobConfig, storage: Storage, out_lease: Lease, *, started: float) -> RunSummary:
    """Plan, then (holding the work area) run the stages and publish; the same steps as
    `zerosafe.driver.convert_checkpoint`, as tasks."""
    options = cfg.options()
    job = JobPlan.from_json(
        inspect(
            cfg.source,
            cfg.destination,
            options,
            tag=cfg.tag,
            work_dir=cfg.work_dir,
            storage_options=cfg.storage_options,
        )  # fmt: skip
    )
    if job.is_done:
        get_run_logger().info("%s already holds this conversion; nothing to do", cfg.destination)
        # Unkeyed: the job's keyed summary stays the one of the run that converted it.
        create_markdown_artifact(
            f"`{cfg.destination}` already holds this conversion (job `{job.job_key[:16]}`); nothing to do.",
        )
        return RunSummary.already_complete(cfg.destination, job.job_key)
    with hold_work(storage, job) as work_lease:
        # Worker processes (ZEROSAFE_WORKERS) where the tasks run in this process; a Dask
        # cluster's workers are processes already.
        # A repair keeps the published shards that are still intact: no extract or merge reads
        # anything for them, and the choice of workers counts only what is left to do.
        reused = reusable_shards(
            Job(
                cfg.source, cfg.destination, job.work_url, job.job_key, options,
                cfg.storage_options, work_lease.run_id,
            ).as_dict()
        )  # fmt: skip
        unit_options = None
        if cfg.runner != "dask":
            unit_options = unit_process_options(
                job, storage, options, mode=worker_mode(None), reused=reused
            )
        task_job = Job(
            cfg.source, cfg.destination, job.work_url, job.job_key, unit_options or options,
            cfg.storage_options, work_lease.run_id,
            workers=unit_options.parallel_tasks if unit_options else 0,
        ).as_dict()  # fmt: skip
        try:
            published, verifies = _run_stages(
                cfg, options, job, task_job, storage, started=started,
                leases=(out_lease, work_lease), reused=reused,
            )  # fmt: skip
        finally:
            close_workers(task_job)
        # `stage_task` types a task's result as its JSON; with `return_state` it is its state
        cleanup = cast("State[None]", finish(task_job, return_state=True))
    summary = summarize(job, published, verifies, seconds=time.monotonic() - started)
    if task_job["workers"]:
        summary = replace(summary, notes=(*summary.notes, processes_note(task_job["workers"])))
    if cleanup.is_failed():  # the output is complete: say what is left, do not fail the run
        warning = cleanup_warning(
            cfg.destination, job.work_url, cleanup.result(raise_on_failure=False)
        )
        get_run_logger().warning("%s", warning)
        summary = replace(summary, warnings=(*summary.warnings, warning))
    _summary_artifact(cfg, job, summary)
    return summary


def _run_stages(
    cfg: JobConfig,
    options: ConvertOptions,
    job: JobPlan,
    task_job: dict[str, Any],
    storage: Storage,
    *,
    started: float,
    leases: tuple[Lease, ...],
    reused: set[int],
) -> tuple[PublishResult, list[VerifyResult]]:
    """Schedule extract, merge and verify (`StageScheduler`), then publish; `reused`: the
    shards a repair keeps."""
    results = _result_storage(job.work_url, cfg.storage_options)

    def submit(task: Any, *args: Any, refresh: bool = False, **kwargs: Any) -> Any:
        run = task.with_options(result_storage=results, refresh_cache=refresh or None)
        return run.submit(*args, **kwargs)

    parts = parts_to_extract(job, direct=options.direct, reused=reused)
    slug = job_slug(cfg.destination)
    progress = _Progress(
        stage_bytes(job, parts, direct=options.direct), key=f"zerosafe-{slug}-progress"
    )
    unit_bytes = {
        "extract": {p.index: p.size_bytes for p in parts},
        "merge": {s.index: s.source_bytes for s in job.shards},
        "verify": {s.index: s.data_bytes for s in job.shards},
    }
    done = StageScheduler(
        job, task_job, parts=parts, direct=options.direct, reused=reused, submit=submit,
        on_done=lambda stage, index: progress.add(unit_bytes[stage][index]),
        limit=None if cfg.runner == "dask" else options.parallel_tasks,
        serial_merges=bool(job.serial_merges),
    ).run()  # fmt: skip
    extracts = [done.extracts[i] for i in sorted(done.extracts)]
    merges = [done.merges[i] for i in range(len(job.shards))]
    verifies = [done.verifies[i] for i in range(len(job.shards))]
    stats = _stats(
        job, options, storage, done, seconds=time.monotonic() - started, task_job=task_job
    )
    for lease in leases:  # another run took over: it owns the output now
        lease.check()
    try:
        published = publish(
            task_job, [e.to_json() for e in extracts], [m.to_json() for m in merges],
            [v.to_json() for v in verifies], stats.to_json(), wait_for=done.verify_futures,
        )  # fmt: skip
    except VerificationError as e:
        rows = "\n".join(
            f"| {f['file']} | {f['tensor']} | {f['check']} | {f['detail']} |"
            for f in e.failures[:200]
        )
        create_markdown_artifact(
            f"# zerosafe: checks failed, nothing published\n\n| file | tensor | check | detail |\n|---|---|---|---|\n{rows}\n",
            key=f"zerosafe-{slug}-failure",
        )
        raise
    return PublishResult.from_json(published), verifies


def _stats(
    job: JobPlan,
    options: ConvertOptions,
    storage: Storage,
    done: StageResults,
    *,
    seconds: float,
    task_job: dict[str, Any],
) -> RunStats:
    """The run's stats, with what the journal says of this run's tasks (its entries carry
    the run id): which ran (not cached) and each stage's own memory peak."""
    journal = read_journal(storage, job.work_url, run_id=task_job["run_id"])
    growth, baseline = stage_memory(journal)
    return run_stats(
        job, options, extracts=list(done.extracts.values()), merges=list(done.merges.values()),
        verifies=list(done.verifies.values()), seconds=seconds,
        tasks_executed={
            stage: sum(1 for e in journal if e["stage"] == stage)
            for stage in ("extract", "merge", "verify")
        },
        # the process's lifetime peak (ru_maxrss), as the command line has always reported,
        # and the job's worker processes' peaks where units ran in them (added up)
        peak_rss_bytes=max((e["peak_rss_bytes"] for e in journal), default=0)
        + workers_peak_rss(task_job),
        # Each stage's own peak: the most one of its tasks raised the RSS (zerosafe_app/tasks/_common.py).
        rss_growth_bytes_by_stage=growth, rss_baseline_bytes=baseline,
    )  # fmt: skip


def _source_text(cfg: JobConfig, source: SourceDescription | None) -> str:
    """The summary's `source` row: the URL and what the format says about it."""
    return f"`{cfg.source}` {source.headline}" if source is not None else f"`{cfg.source}`"


def _summary_artifact(cfg: JobConfig, job: JobPlan, r: RunSummary) -> None:
    assert r.stats is not None
    rows = [
        ("source", _source_text(cfg, job.source)),
        ("output", f"`{cfg.destination}`: {len(r.files)} file(s), {r.num_tensors} tensors"),
        ("mode", r.stats.mode_reason or r.stats.mode),
        ("read from source", _source_read_text(r.stats)),
        ("intermediates written", format_bytes(r.stats.intermediate_bytes_written)),
        ("output written", format_bytes(r.stats.output_bytes_written)),
        ("time", f"{r.seconds:.1f} s ({format_bytes(r.throughput_bytes_per_second)}/s read)"),
        ("peak memory by stage", _memory_text(r.stats)),
        (
            "tasks executed (not cached)",
            ", ".join(f"{k} {v}" for k, v in r.stats.tasks_executed.items()),
        ),
        (
            "checks passed",
            f"{r.checks_passed} tensors verified; {r.integrity['records_checked']} zip/intermediate records CRC-checked",
        ),
    ]
    if job.aliases:
        rows.append(("tied aliases", ", ".join(f"{a} -> {t}" for a, t in job.aliases.items())))
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    notes = "".join(f"\n- {n}" for n in job.notes)
    create_markdown_artifact(
        f"# zerosafe conversion\n\n| | |\n|---|---|\n{body}\n{notes}\n",
        key=f"zerosafe-{job_slug(cfg.destination)}",
        description=f"zerosafe summary of `{cfg.destination}`",
    )


def _memory_text(stats: RunStats) -> str:
    """Each stage's own peak, as growth over the worker process's baseline RSS."""
    growth = stats.rss_growth_bytes_by_stage
    if not growth:
        return "no task executed (all cached)"
    stages = ", ".join(f"{k} +{format_bytes(v)}" for k, v in growth.items())
    return (
        f"{stages} (the most one task of the stage raised the worker's RSS, over a "
        f"{format_bytes(stats.rss_baseline_bytes)} process baseline)"
    )


def _source_read_text(stats: RunStats) -> str:
    text = format_bytes(stats.source_bytes_read)
    if stats.source_read_ratio:
        text += (
            f" = {stats.source_read_ratio:.3f} x the {format_bytes(stats.source_bytes_needed)} "
            "needed (the tensor bytes it copies, plus metadata and headers)"
        )
    return text


def run_convert(
    ckpt_url: str,
    out_url: str,
    options: ConvertOptions,
    *,
    tag: str | None = None,
    work_url: str | None = None,
    show_progress: bool = False,
    quiet: bool = False,
    storage_options: dict[str, Any] | None = None,
    mode: str | None = None,
) -> RunSummary:
    """Run the flow embedded, for `zerosafe convert`. Progress goes to the terminal bar.

    `mode` is the mode as asked (`auto` included); by default the one `options` holds."""
    from zerosafe.stages.progress import NullProgress, TerminalProgress

    bar = TerminalProgress() if show_progress else NullProgress()
    set_progress(bar)  # the flow starts it with the total once the plan is known
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    try:
        # No heartbeats for a run the command itself watches: ending each of its two flow
        # runs would otherwise wait up to a second for the heartbeat thread.
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            state = cast(
                "State[Any]",
                convert(
                    **flow_parameters(
                        ckpt_url, out_url, options, tag=tag, work_dir=work_url,
                        storage_options=storage_options,
                        mode=mode or ("direct" if options.direct else "staged"),
                    ),
                    return_state=True,
                ),
            )  # fmt: skip
        # The summary; a ConversionError raises here (one line and exit 2), as any other error
        result = cast("dict[str, Any]", _result_of(state))
    finally:
        set_progress(NullProgress())
        if show_progress:
            bar.finish()
    return RunSummary.from_json(result)


if __name__ == "__main__":  # pragma: no cover - `python flows/convert.py conf.yaml`
    import sys

    print(json.dumps(convert(conf=sys.argv[1]), indent=1, default=str))
