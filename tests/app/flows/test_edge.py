"""The Prefect edge (`zerosafe_app.tasks.edge`): every task is made by one decorator with one
retry policy, and bodies get and give the engine's dataclasses while Prefect sees JSON."""

from __future__ import annotations

from zerosafe.stages.results import MergeResult
from zerosafe_app.tasks import extract, inspect, lazify, merge, pt2st, publish, verify
from zerosafe_app.tasks._common import Job
from zerosafe_app.tasks.edge import TRANSIENT_STORAGE, from_edge, is_transient, to_edge

TASKS = [
    extract.extract, merge.merge, verify.verify, inspect.inspect, publish.publish,
    publish.finish, lazify.list_files, lazify.lazify_one, pt2st.inspect, pt2st.convert,
    pt2st.verify,
]  # fmt: skip


def test_every_task_retries_transient_storage_errors_by_the_one_policy() -> None:
    for t in TASKS:
        assert t.retries == TRANSIENT_STORAGE.retries, t.name
        assert list(t.retry_delay_seconds or []) == list(TRANSIENT_STORAGE.delays_s), t.name
        assert t.retry_condition_fn is is_transient, t.name


def test_only_the_unit_stages_are_cached() -> None:
    cached = {t.name for t in TASKS if t.cache_key_fn is not None}
    assert cached == {"extract", "merge", "verify"}


def test_json_in_dataclasses_to_the_body_and_json_out() -> None:
    job = Job("s", "d", "w", "k" * 64, {"dtype": "bf16"}, {})
    assert from_edge(job.as_dict(), Job) == job
    assert from_edge(job, Job) is job  # already typed: as it is
    merged = MergeResult(
        shard=0, file="model.safetensors", file_bytes=10, data_bytes=8, bytes_read=8,
        tensors={}, ledger={}, seconds=0.5,
    )  # fmt: skip
    assert from_edge([merged.to_json()], list[MergeResult]) == [merged]
    assert to_edge(merged) == merged.to_json()
    assert to_edge([merged]) == [merged.to_json()]
    assert to_edge({"plain": 1}) == {"plain": 1} and to_edge(None) is None
    assert from_edge({"a": 1}, dict) == {"a": 1}  # no `from_json`: untouched
