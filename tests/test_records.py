"""`zerosafe.records`: the one JSON form of the engine's records, and the task results'
JSON pinned byte for byte (results cached by earlier runs must still read back)."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

import pytest

from zerosafe.formats.crc import IntegrityReport, RecordNote
from zerosafe.records import Record, RecordError, from_json, json_meta, to_json
from zerosafe.stages.results import (
    ExtractResult,
    JobPlan,
    MergeResult,
    PartWork,
    PublishResult,
    RunStats,
    RunSummary,
    ShardWork,
    VerifyResult,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, kw_only=True, slots=True)
class Inner(Record):
    name: str
    size_bytes: int = field(metadata=json_meta(key="bytes"))


@dataclass(frozen=True, kw_only=True, slots=True)
class Outer(Record):
    color: Color
    inners: tuple[Inner, ...]
    by_name: dict[str, Inner] = field(default_factory=dict)
    pair: tuple[int, str] = (0, "")
    maybe: Inner | None = None
    note: str | None = field(default=None, metadata=json_meta(omit_default=True))
    seconds: float = field(metadata=json_meta(absent=0.0))


def test_nested_records_round_trip() -> None:
    outer = Outer(
        color=Color.BLUE,
        inners=(Inner(name="a", size_bytes=1), Inner(name="b", size_bytes=2)),
        by_name={"c": Inner(name="c", size_bytes=3)},
        pair=(4, "d"),
        maybe=Inner(name="e", size_bytes=5),
        seconds=1.5,
    )
    data = json.loads(json.dumps(outer.to_json()))
    assert data == {
        "color": "blue",
        "inners": [{"name": "a", "bytes": 1}, {"name": "b", "bytes": 2}],
        "by_name": {"c": {"name": "c", "bytes": 3}},
        "pair": [4, "d"],
        "maybe": {"name": "e", "bytes": 5},
        "seconds": 1.5,
    }
    assert Outer.from_json(data) == outer
    assert to_json(replace_note(outer))["note"] == "set"


def replace_note(outer: Outer) -> Outer:
    from dataclasses import replace

    return replace(outer, note="set")


def test_defaults_absent_keys_and_unknown_keys() -> None:
    read = from_json(Outer, {"color": "red", "inners": [], "newer_key": 1})
    assert read == Outer(color=Color.RED, inners=(), seconds=0.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inners": []}, "Outer: expected the key 'color'"),
        ({"color": "green", "inners": []}, r"Outer.color: expected one of \['red', 'blue'\]"),
        ({"color": "red", "inners": [{"name": "a", "bytes": "1"}]}, "Inner.bytes: expected int"),
        ({"color": "red", "inners": {}}, "Outer.inners: expected an array"),
        ({"color": "red", "inners": [], "pair": [1]}, "Outer.pair: expected an array of 2"),
        ({"color": "red", "inners": [], "seconds": True}, "Outer.seconds: expected float"),
        ([], "Outer: expected a JSON object, found list"),
    ],
)
def test_wrong_records_are_refused_with_one_line(data: object, message: str) -> None:
    with pytest.raises(RecordError, match=message):
        Outer.from_json(data)


INTEGRITY = IntegrityReport(
    records_checked=2, records_skipped=(RecordNote(record="a.pt#x", why="no CRC"),),
    records_failed=(),
)  # fmt: skip
STATS = RunStats(
    mode="direct", mode_reason="local", source_bytes_read=10, source_bytes_needed=8,
    intermediate_bytes_written=0, output_bytes_written=6, bytes_read=16, bytes_written=6,
    fp32_bytes=12, tasks_executed={"merge": 1}, seconds=2.5, source_read_ratio=1.25,
)  # fmt: skip

# The JSON every result had before `zerosafe.records` derived it: keys, order and values.
GOLDEN = [
    (
        JobPlan(
            state="empty",
            job_key="k",
            destination="out",
            work_url="out/.w",
            parts=(PartWork(index=0, rank=1, label="1/2", size_bytes=5),),
            shards=(
                ShardWork(index=0, file_name="m.st", data_bytes=3, source_bytes=4, parts=(0,)),
            ),
            aliases={"a": "b"},
            notes=("n",),
            serial_merges="s3",
        ),  # fmt: skip
        '{"state": "empty", "job_key": "k", "destination": "out", "work": "out/.w", "source": {}, '
        '"reader": {}, "parts": [{"index": 0, "rank": 1, "label": "1/2", "bytes": 5}], "shards": '
        '[{"index": 0, "file": "m.st", "bytes": 3, "source_bytes": 4, "parts": [0]}], "aliases": '
        '{"a": "b"}, "notes": ["n"], "warnings": [], "fp32_bytes": 0, "metadata_bytes_read": 0, '
        '"source_bytes_needed": 0, "task_memory_bytes": 0, "serial_merges": "s3"}',
    ),
    (
        ExtractResult(
            part=1,
            rank=2,
            file="i.st",
            file_bytes=3,
            bytes_read=4,
            content_sha256="c",
            ledger={"u": [[1, 2]]},
            seconds=0.5,
        ),  # fmt: skip
        '{"part": 1, "rank": 2, "file": "i.st", "file_bytes": 3, "bytes_read": 4, '
        '"content_sha256": "c", "ledger": {"u": [[1, 2]]}, "seconds": 0.5}',
    ),
    (
        MergeResult(
            shard=0,
            file="m.st",
            file_bytes=1,
            data_bytes=1,
            bytes_read=2,
            tensors={"x": {"sha256": "1"}},
            ledger={},
            seconds=1.0,
            reused=True,
        ),  # fmt: skip
        '{"shard": 0, "file": "m.st", "file_bytes": 1, "data_bytes": 1, "bytes_read": 2, '
        '"tensors": {"x": {"sha256": "1"}}, "ledger": {}, "seconds": 1.0, "reused": true}',
    ),
    (
        VerifyResult(
            shard=0,
            file="m.st",
            num_tensors=1,
            tensors={},
            metadata={"format": "pt"},
            failures=({"file": "m.st"},),
            bytes_read=1,
            seconds=2.0,
            sha256="ab",
        ),  # fmt: skip
        '{"file": "m.st", "ok": false, "num_tensors": 1, "tensors": {}, "metadata": {"format": '
        '"pt"}, "failures": [{"file": "m.st"}], "bytes_read": 1, "shard": 0, "seconds": 2.0, '
        '"sha256": "ab"}',
    ),
    (
        PublishResult(files=("m.st",), num_tensors=1, integrity=INTEGRITY, stats=STATS),
        '{"files": ["m.st"], "num_tensors": 1, "integrity": {"records_checked": 2, '
        '"records_skipped": [{"record": "a.pt#x", "why": "no CRC"}], "records_failed": []}, '
        '"stats": {"mode": '
        '"direct", "mode_reason": "local", "source_bytes_read": 10, "source_bytes_needed": 8, '
        '"intermediate_bytes_written": 0, "output_bytes_written": 6, "bytes_read": 16, '
        '"bytes_written": 6, "fp32_bytes": 12, "rss_growth_bytes_by_stage": {}, '
        '"rss_baseline_bytes": 0, "tasks_executed": {"merge": 1}, "peak_rss_bytes": 0, '
        '"seconds": 2.5, "source_read_ratio": 1.25}}',
    ),
    (
        RunSummary(
            status="converted",
            output="out",
            job_key="k",
            files=("m.st",),
            num_tensors=1,
            checks_passed=1,
            stats=STATS,
            seconds=3.0,
            throughput_bytes_per_second=3,
        ),  # fmt: skip
        '{"status": "converted", "output": "out", "job_key": "k", "files": ["m.st"], '
        '"num_tensors": 1, "aliases": {}, "integrity": {}, "notes": [], "warnings": [], '
        '"checks_passed": 1, "mode": "direct", "mode_reason": "local", "source_bytes_read": 10, '
        '"source_bytes_needed": 8, "intermediate_bytes_written": 0, "output_bytes_written": 6, '
        '"bytes_read": 16, "bytes_written": 6, "fp32_bytes": 12, "rss_growth_bytes_by_stage": '
        '{}, "rss_baseline_bytes": 0, "tasks_executed": {"merge": 1}, "peak_rss_bytes": 0, '
        '"seconds": 3.0, "source_read_ratio": 1.25, "throughput_bytes_per_second": 3}',
    ),
    (
        RunSummary.already_complete("out", "k"),
        '{"status": "already-complete", "output": "out", "job_key": "k"}',
    ),
]


@pytest.mark.parametrize(("record", "golden"), GOLDEN, ids=lambda r: type(r).__name__)
def test_results_keep_their_json(record: Record, golden: str) -> None:
    assert json.dumps(record.to_json()) == golden
    assert json.dumps(type(record).from_json(json.loads(golden)).to_json()) == golden


def test_results_cached_without_later_keys_still_read() -> None:
    old = {
        "shard": 0, "file": "m.st", "file_bytes": 1, "data_bytes": 1, "bytes_read": 2,
        "tensors": {}, "ledger": {},
    }  # fmt: skip
    assert MergeResult.from_json(old).seconds == 0.0
    verify = {"shard": 0, "file": "m.st", "num_tensors": 0, "tensors": {}}
    assert VerifyResult.from_json(verify).ok
