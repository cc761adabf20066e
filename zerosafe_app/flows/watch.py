"""The flow `watch`: convert each new checkpoint tag as training writes it.

Run on a schedule (deploy/prefect.yaml). Each run lists the checkpoint folder, skips tags that
are converted or still being written (looked at again next time, never failed), and starts a
`convert` run (a deployment, e.g. `convert/default`) for each tag that is ready, into
`destination_root/<tag>`. A tag whose conversion started but did not finish is started again:
the conversion resumes from its work area. Never twice at once for one tag, even when two
watch runs overlap: each launch carries an idempotency key (the tag, its destination, the
number of runs for it that already ended), so the server returns the existing run to the
second caller. At most `max_concurrent` conversions it started run at once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterDeploymentId,
    FlowRunFilterState,
    FlowRunFilterStateType,
    FlowRunFilterTags,
)
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment

from zerosafe.formats.deepspeed.watching import scan_tags
from zerosafe_app.tasks.credentials import storage_for

__all__ = ["watch"]

WATCH_TAG = "zerosafe-watch"
ACTIVE = [
    StateType.SCHEDULED,
    StateType.PENDING,
    StateType.RUNNING,
    StateType.PAUSED,
    StateType.CANCELLING,
]
FINISHED = [StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED]


def _dest_tag(destination: str) -> str:
    return "zerosafe-dest-" + hashlib.sha256(destination.encode()).hexdigest()[:16]


def _runs(tags: list[str], states: list[StateType]) -> list[Any]:
    """The deployment runs with `tags` in `states` (a conversion's `convert-job` subflow
    carries its tags too, but is no run of its own)."""
    with get_client(sync_client=True) as client:
        return list(
            client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=tags),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=states)),
                    deployment_id=FlowRunFilterDeploymentId(is_null_=False),
                )
            )
        )


@flow(name="watch", log_prints=False)
def watch(
    root: str,
    destination_root: str,
    deployment: str = "convert/default",
    conf: str | None = None,
    parameters: dict[str, Any] | None = None,
    max_concurrent: int = 2,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Start conversions for the tags of checkpoint folder `root` that are ready.

    Args:
        root: The DeepSpeed checkpoint folder (holding `latest` and the tag folders).
        destination_root: Tag T converts into `destination_root/T`.
        deployment: The convert deployment to run, `flow/deployment`.
        conf: A job file passed to each conversion (dtype, shard size, memory...).
        parameters: Further convert parameters (they override `conf`).
        max_concurrent: Conversions started by watch that may run at once.
        storage_options: fsspec options for `root` and `destination_root` (no secrets: a
            credentials reference, as for `convert`).
    """
    log = get_run_logger()
    storage = storage_for(storage_options or {})
    statuses = scan_tags(storage, root, destination_root)
    in_flight = _runs([WATCH_TAG], ACTIVE)
    report: dict[str, list[Any]] = {
        "launched": [],
        "running": [],
        "waiting": [],
        "done": [],
        "writing": [],
    }
    for status in statuses:
        if status.state == "done":
            report["done"].append(status.tag)
            continue
        if status.state == "writing":
            log.info("tag %s not ready: %s", status.tag, status.why)
            report["writing"].append({"tag": status.tag, "why": status.why})
            continue
        dest_tag = _dest_tag(status.destination)
        if _runs([dest_tag], ACTIVE):
            report["running"].append(status.tag)
            continue
        if len(in_flight) >= max_concurrent:
            report["waiting"].append(status.tag)
            continue
        # Runs that ended before (failed, or completed into an output since damaged): a new
        # attempt gets a new key; two watch runs now count the same and share one key.
        attempt = len(_runs([dest_tag], FINISHED))
        params: dict[str, Any] = {
            "source": root,
            "tag": status.tag,
            "destination": status.destination,
        }
        if conf:
            params["conf"] = conf
        if storage_options:
            params["storage_options"] = storage_options
        params.update(parameters or {})
        key = hashlib.sha256(
            json.dumps(
                [status.tag_url, status.destination, attempt, params], sort_keys=True, default=str
            ).encode()
        ).hexdigest()
        run: FlowRun = run_deployment(  # type: ignore[assignment]  # sync call: a FlowRun
            deployment, parameters=params, timeout=0, tags=[WATCH_TAG, dest_tag],
            idempotency_key=f"zerosafe-watch-{key[:32]}", as_subflow=False,
            flow_run_name=f"convert {status.tag}",
        )  # fmt: skip
        in_flight.append(run)
        log.info(
            "tag %s: started %s (%s)",
            status.tag,
            run.name,
            "resume" if status.state == "partial" else "new",
        )
        report["launched"].append(
            {"tag": status.tag, "flow_run_id": str(run.id), "resume": status.state == "partial"}
        )
    rows = "\n".join(
        f"| {kind} | {', '.join(str(x['tag'] if isinstance(x, dict) else x) for x in items)} |"
        for kind, items in report.items()
        if items
    )
    create_markdown_artifact(
        f"# zerosafe watch of `{root}`\n\n| | tags |\n|---|---|\n{rows}\n", key="zerosafe-watch"
    )
    return report
