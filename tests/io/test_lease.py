"""Leases on local folders (issue 24 item 9): exclusive create, a guarded take-over of a stale
lease, a heartbeat that re-reads the lease, and a run that fails before publishing when another
run took its lease."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.config import ConvertOptions
from zerosafe.driver import convert_checkpoint
from zerosafe.io import lease as lease_module
from zerosafe.io.lease import LeaseHeldError, LeaseLostError, work_lease
from zerosafe.io.storage import Storage


def _takers(work: Path, n: int) -> list[str]:
    outcome = ["" for _ in range(n)]
    start, tried = threading.Barrier(n), threading.Barrier(n)

    def take(i: int) -> None:
        start.wait()
        try:
            with work_lease(Storage(), str(work)):
                outcome[i] = "won"
                tried.wait(timeout=30)
        except LeaseHeldError:
            outcome[i] = "refused"
            tried.wait(timeout=30)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


@pytest.mark.parametrize("stale", [False, True])
def test_concurrent_takers_exactly_one_wins(tmp_path: Path, stale: bool) -> None:
    work = tmp_path / "work"
    work.mkdir()
    if stale:  # a dead run's lease: every taker sees it stale, one takes it over
        dead = {"run_id": "dead", "host": socket.gethostname(), "pid": 2**22 + 7, "heartbeat": 0}
        (work / "lease.json").write_text(json.dumps(dead))
    outcome = _takers(work, 8)
    assert outcome.count("won") == 1 and outcome.count("refused") == 7, outcome
    assert not (work / "lease.json").exists() and not list(work.glob("*.takeover"))


def test_a_local_heartbeat_after_a_takeover_notices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_module, "HEARTBEAT_SECONDS", 0.1)
    url = tmp_path / "work" / "lease.json"
    with work_lease(Storage(), str(tmp_path / "work")) as held:
        other = {"run_id": "other", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}
        url.write_text(json.dumps(other))
        deadline = time.monotonic() + 10
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.lost is not None
        assert json.loads(url.read_text())["run_id"] == "other"
    assert json.loads(url.read_text())["run_id"] == "other"


class _TakeOverMidRun:
    """A progress bar that, at the first bytes copied, plays a second run taking over the work
    area's lease (as one would after this run's heartbeat stalled past `STALE_SECONDS`)."""

    def __init__(self, out: Path) -> None:
        self.out, self.done = out, False

    def start(self, label: str, total_bytes: int, stages: dict[str, int] | None = None) -> None:
        pass

    def advance(self, num_bytes: int, stage: str | None = None) -> None:
        if self.done:
            return
        (lease,) = (self.out / ".zerosafe-work").glob("*/lease.json")
        other = {"run_id": "other", "host": "elsewhere", "pid": 1, "heartbeat": time.time()}
        lease.write_text(json.dumps(other))
        self.done = True

    def finish(self) -> None:
        pass


def test_a_run_whose_lease_was_taken_fails_before_publishing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(LeaseLostError, match="another run took"):
        convert_checkpoint(
            str(SAMPLE_CKPT), str(out), ConvertOptions(max_shard_size=20_000),
            progress=_TakeOverMidRun(out),
        )  # fmt: skip
    assert not (out / "zerosafe-complete.json").exists()
    assert not list(out.glob("model*.safetensors"))
    assert os.path.exists(next((out / ".zerosafe-work").glob("*/lease.json")))


def test_the_lease_record_keeps_its_bytes_and_a_torn_one_holds_nothing(tmp_path: Path) -> None:
    """`LeaseRecord` writes the keys leases always had, in their order (`job` only on an
    output folder's); content that is no lease reads as None, which holds nothing."""
    out = tmp_path / "out"
    with lease_module.destination_lease(Storage(), str(out), job="k fp32"):
        held = json.loads((out / lease_module.DESTINATION_LEASE_NAME).read_bytes())
    assert list(held) == ["job", "run_id", "host", "pid", "heartbeat"]
    assert held["job"] == "k fp32" and held["pid"] == os.getpid()
    with work_lease(Storage(), str(tmp_path / "work")):
        held = json.loads((tmp_path / "work" / "lease.json").read_bytes())
    assert list(held) == ["run_id", "host", "pid", "heartbeat"]
    record = lease_module.parse_lease(json.dumps(held).encode())
    assert record is not None and record.to_json() == held
    for torn in (b'{"run_id": "x", "pi', b"[1]", b'{"pid": "12"}'):
        assert lease_module.parse_lease(torn) is None
