"""The output-target contract: what every kind of output zerosafe writes (`--to`) provides.

A target turns one planned source into one output folder. Whichever process runs it (the
command's own, or Prefect tasks), a run follows one call sequence:

1. **check destination**: hold the output folder (`zerosafe.pipeline.hold_destination`: one
   job per folder, the other refused in one line naming the holder), refuse an output inside
   the checkpoint or holding another kind's output (`zerosafe.stages.destination`), then
   `prepare`: already complete (nothing to do), another source's output (refused, or removed
   with `--overwrite`), leftovers a reader must not take for the output.
2. **plan units**: `units`, each a `UnitSpec` with a fingerprint of what it writes; the
   unit's record key is `(target, job key, index, fingerprint)`.
3. **run unit**, per unit, resumable: `write_unit` returns the files it wrote; the unit is
   recorded (`zerosafe.run.unit_records`) and a rerun keeps every recorded unit whose files
   are all there with their recorded sizes. Units run several at a time.
4. **check unit**: the source records read against their zip CRC-32s, then `check_file` on
   every file written (kept units too); a unit with a failing file is dropped.
5. **publish**, the marker last: `publish` writes what a reader opens (manifest, index,
   `.metadata`, `latest_universal`) and returns the marker, which the lifecycle writes after.
6. **summary**: status, units run and kept, bytes read and written, peak RSS.

The training-state targets (`universal`, `dcp`) implement `OutputTarget` step by step, and
`zerosafe.targets.lifecycle` runs steps 1-6 once for both, in this process (threads) or as
Prefect tasks (`zerosafe_app.flows.training_state`). The `safetensors` target is, for now,
the weights pipeline (`zerosafe.pipeline`), whose stages follow the same sequence with their
own steps (extract, merge, verify). Every target is listed in `zerosafe.targets.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypedDict

from zerosafe.config import DEFAULT_MEMORY_BYTES, ConvertOptions
from zerosafe.formats.crc import CrcLedger
from zerosafe.io.storage import Storage

__all__ = [
    "DEFAULT_UNIT_BYTES",
    "StateKwargs",
    "StateOptions",
    "StateSummary",
    "OutputTarget",
    "TargetName",
    "UnitSpec",
    "UnitWork",
]

TargetName = Literal["safetensors", "universal", "dcp"]
DEFAULT_UNIT_BYTES = 256 << 20
"""Source bytes a training-state unit reads, about (the granularity of resume)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StateOptions:
    """How a training-state target runs: the options that never change its bytes."""

    memory: int = DEFAULT_MEMORY_BYTES
    """The budget the units running at once share (`--memory`)."""
    parallel: int = 2
    """Units at once at most (`--parallel`), further bounded by `memory`."""
    chunk_bytes: int | None = None
    """Bytes read and written at a time per unit; by default `memory` divided among the units
    at once, as the weights' copy tasks divide it (`ConvertOptions.chunk_bytes`)."""
    unit_bytes: int = DEFAULT_UNIT_BYTES
    overwrite: bool = False
    """Replace another source's output, or another kind's, and redo every unit a killed run
    left."""
    keep_work: bool = False
    """Keep the unit records after publishing."""

    @property
    def budget(self) -> ConvertOptions:
        return ConvertOptions(memory=self.memory, max_parallel_tasks=self.parallel)

    @property
    def tasks_at_once(self) -> int:
        """Units that fit `memory` at once (at least 1, at most `parallel`)."""
        return self.budget.parallel_tasks

    @property
    def chunk(self) -> int:
        return self.chunk_bytes or self.budget.chunk_bytes


class StateKwargs(TypedDict, total=False):
    """`StateOptions`' fields as keyword arguments (`convert_to_universal(..., parallel=4)`)."""

    memory: int
    parallel: int
    chunk_bytes: int | None
    unit_bytes: int
    overwrite: bool
    keep_work: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitSpec:
    """One unit of work of a target: what it writes, named for its record key."""

    index: int
    kind: str
    """What the unit writes, in the target's own words (`params`, `optimizer_state`, ...)."""
    fingerprint: str
    """A digest of what it writes (`zerosafe.run.unit_records.fingerprint`)."""
    members: tuple[Any, ...] = ()
    """The target's own items (param indices, DCP items)."""


@dataclass(kw_only=True)
class UnitWork:
    """What one unit did: the files it wrote and the source bytes it read."""

    files: list[dict[str, Any]]
    """Each file as the unit record, manifest and `check_file` hold it (`path`, `size_bytes`,
    and the target's own fields)."""
    ledger: CrcLedger = field(default_factory=CrcLedger)
    """CRC-32s of the source bytes read, by zip record (checked once every unit is done)."""
    bytes_read: int = 0
    bytes_written: int = 0

    def record(self, kind: str) -> dict[str, Any]:
        """The unit record's `result`."""
        return {"kind": kind, "files": self.files, "ledger": self.ledger.to_json()}

    @classmethod
    def from_record(cls, result: Mapping[str, Any]) -> UnitWork:
        return cls(
            files=list(result["files"]), ledger=CrcLedger.from_json(result.get("ledger", {}))
        )


@dataclass(kw_only=True)
class StateSummary:
    """What a training-state run did (`convert --to universal|dcp --json` prints it)."""

    status: str
    """`converted` or `already-complete`."""
    output: str
    num_params: int
    units_run: int = 0
    units_kept: int = 0
    files_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    masters_bytes: int = 0
    moments_bytes: int = 0
    seconds: float = 0.0
    peak_rss_bytes: int = 0
    source_records_checked: int = 0
    """Source zip records whose bytes, as read, matched their recorded CRC-32."""
    notes: list[str] = field(default_factory=list)
    parallel: int = 1
    """Units that ran at once at most (`--parallel` within `--memory`)."""
    chunk_bytes: int = 0
    """Bytes a unit read and wrote at a time (`--memory` divided among the units at once)."""

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class OutputTarget(Protocol):
    """A planned training-state output (`--to universal`, `--to dcp`): the parts that differ
    between targets. The lifecycle (`zerosafe.targets.lifecycle.run_target`) does the rest,
    in the order of this module's call sequence."""

    @property
    def name(self) -> Literal["universal", "dcp"]:
        """The `--to` value, the destination kind and the unit records' stage."""
        ...

    marker_name: str
    label: str
    """What the output is, for messages: `universal checkpoint`, `DCP checkpoint`."""
    job_key: str
    source_url: str
    notes: list[str]

    def prepare(
        self, storage: Storage, out_url: str, marker: Mapping[str, Any] | None, *, overwrite: bool
    ) -> bool:
        """Step 1, once the destination is held and another kind's output refused: True when
        `marker` (the output's marker, if any) says this very conversion is complete; else
        remove what a reader could take for the output. Another source's complete output
        (raised or removed) is the lifecycle's business."""
        ...

    def clear(self, storage: Storage, out_url: str) -> None:
        """Remove a complete output of this target, its marker first (`--overwrite`)."""
        ...

    def units(self, unit_bytes: int) -> Sequence[UnitSpec]:
        """Step 2."""
        ...

    def write_unit(
        self, storage: Storage, out_url: str, unit: UnitSpec, chunk_bytes: int
    ) -> UnitWork:
        """Step 3: write one unit's files; safe to call from several threads at once."""
        ...

    def check_source(self, storage: Storage, ledger: CrcLedger, records: Any) -> tuple[int, int]:
        """Step 4: every source record read against its zip CRC-32 (`records`: the
        `UnitRecords`, cleared on a mismatch); returns how many were checked and the bytes
        read to check them (the padding between the pieces read)."""
        ...

    def check_file(
        self, storage: Storage, out_url: str, file: Mapping[str, Any], chunk_bytes: int
    ) -> None:
        """Step 4: re-read one written file and check it."""
        ...

    def temp_folders(self, storage: Storage, out_url: str) -> list[str]:
        """Folders a killed run may have left temporary files in."""
        ...

    def publish(
        self, storage: Storage, out_url: str, files: list[dict[str, Any]], chunk_bytes: int
    ) -> dict[str, Any]:
        """Step 5: write what a reader opens; returns the marker the lifecycle writes last."""
        ...

    def summary(self, status: str, output: str) -> StateSummary:
        """Step 6: the target's summary, with its own fields (`folder`, `num_items`) set; the
        lifecycle fills in what the run did."""
        ...
