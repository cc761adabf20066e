"""Leases on S3 are taken with conditional writes (issue 24 item 9), on the moto server.

Before the fix a starter wrote its lease, slept 50 ms and read it back: a PUT slower than that
(here: one starter's PUT delayed by the fault proxy, as a loaded S3 endpoint would) landed
after the other starter's read-back, and both runs held the work area. The heartbeat rewrote
the lease without looking whose it was.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from tests.io.s3.faultproxy import Fault, FaultProxy
from tests.io.s3.support import MotoServer, s3_client
from zerosafe.io import lease as lease_module
from zerosafe.io.lease import LeaseHeldError, LeaseLostError, work_lease
from zerosafe.io.storage import Storage


def _take_together(storages: list[Storage], work: str) -> list[str]:
    """Each storage tries `work_lease(work)` at once; what each got: `won` or `refused`."""
    outcome: list[str] = ["" for _ in storages]
    start = threading.Barrier(len(storages))
    everyone_tried = threading.Barrier(len(storages))

    def take(i: int) -> None:
        start.wait()
        try:
            with work_lease(storages[i], work):
                outcome[i] = "won"
                everyone_tried.wait(timeout=30)
        except LeaseHeldError:
            outcome[i] = "refused"
            everyone_tried.wait(timeout=30)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(len(storages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcome


def test_two_starters_one_slow_put_exactly_one_wins(
    moto: MotoServer, bucket: str, proxy: FaultProxy
) -> None:
    for attempt in range(3):
        work = f"s3://{bucket}/out/.zerosafe-work/{attempt:016x}"
        proxy.clear()
        proxy.add(Fault("latency", "PUT", r"lease\.json", times=1))  # the slow starter's PUT
        slow = Storage({"endpoint_url": proxy.url})
        fast = Storage({"endpoint_url": moto.url})
        outcome = _take_together([slow, fast], work)
        assert sorted(outcome) == ["refused", "won"], (attempt, outcome)


def test_many_starters_at_once_exactly_one_wins(moto: MotoServer, bucket: str) -> None:
    outcome = _take_together(
        [Storage({"endpoint_url": moto.url}) for _ in range(6)], f"s3://{bucket}/w/many"
    )
    assert outcome.count("won") == 1 and outcome.count("refused") == 5, outcome


def test_a_heartbeat_after_a_takeover_notices_and_the_holder_stops(
    moto: MotoServer, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lease_module, "HEARTBEAT_SECONDS", 0.2)
    key = "w/taken/lease.json"
    storage = Storage({"endpoint_url": moto.url})
    client = s3_client(moto.url)
    with work_lease(storage, f"s3://{bucket}/w/taken") as held:
        held.check()  # still ours
        other: dict[str, Any] = {"run_id": "other", "host": "elsewhere", "pid": 1,
                                 "heartbeat": time.time()}  # fmt: skip
        client.put_object(Bucket=bucket, Key=key, Body=json.dumps(other).encode())
        deadline = time.monotonic() + 10
        while held.lost is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.lost is not None and "other" in held.lost, "the heartbeat did not notice"
        with pytest.raises(LeaseLostError, match="another run took"):
            held.check()
        body = client.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert json.loads(body)["run_id"] == "other", "the heartbeat overwrote the new holder"
    # Released without removing the new holder's lease.
    assert json.loads(client.get_object(Bucket=bucket, Key=key)["Body"].read())["run_id"] == "other"
