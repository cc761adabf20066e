"""A failed task does not release the leases while its siblings still run (issue 24 item 7).

Before the fix, the flow's scheduler (then `StageScheduler.run`, now the engine's
`zerosafe.run.schedule.Scheduler.run`) raised on the first failed future and the `with` blocks
released the output and work-area leases while sibling tasks kept writing; a second run
starting then would take the leases and remove the first run's in-flight `.partial` files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SAMPLE_CKPT
from zerosafe.io.lease import DESTINATION_LEASE_NAME

pytestmark = pytest.mark.slow


def test_a_failed_task_waits_for_its_siblings_before_the_leases_go(
    prefect_server: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import zerosafe_app.tasks.extract as extract_task
    from zerosafe_app.flows.convert import convert

    out = tmp_path / "out"
    real = extract_task.extract_unit
    seen: dict[int, Any] = {}

    def extract_unit(plan: Any, index: int, storage: Any, work: Any, *a: Any, **kw: Any) -> Any:
        if index == 0:
            time.sleep(0.2)  # its sibling is running by now
            raise ValueError("injected: rank 0's file vanished")
        if index == 1:
            time.sleep(2.0)  # still writing when part 0 fails
            seen[index] = (
                (out / DESTINATION_LEASE_NAME).exists(),
                (Path(work.root) / "lease.json").exists(),
            )
        return real(plan, index, storage, work, *a, **kw)

    monkeypatch.setattr(extract_task, "extract_unit", extract_unit)
    state = convert(
        source=str(SAMPLE_CKPT), destination=str(out), max_shard_size="20KB", mode="staged",
        max_parallel_tasks=2, return_state=True,
    )  # fmt: skip
    assert state.is_failed(), state
    assert seen[1] == (True, True), "a lease was released while a sibling task still ran"
    assert not (out / DESTINATION_LEASE_NAME).exists(), "the leases are released at the end"
