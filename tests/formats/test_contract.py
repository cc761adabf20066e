"""The reader contract's typed edges (`zerosafe.formats.base`): the source description keeps
each format's manifest block byte for byte, reads back from a plan unchanged, and the optional
16-bit capability is declared by the readers that have it, not found by format name."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

from zerosafe.formats.base import (
    InspectFacts,
    ReadLabels,
    ReadsLowpCopies,
    SourceDescription,
    StoredDetails,
)
from zerosafe.formats.registry import READERS, reader_named
from zerosafe.io.storage import FileIdentity


@dataclass(frozen=True, kw_only=True, slots=True)
class _Details:
    ORDER: ClassVar[tuple[str, ...]] = (
        "format", "checkpoint", "ranks", "tag", "num_params", "files", "checkpoint_bytes",
        "content_sha256", "note",
    )  # fmt: skip
    ranks: int
    note: str | None = None

    @property
    def order(self) -> tuple[str, ...]:
        return self.ORDER

    def fields(self) -> dict[str, object]:
        return {"ranks": self.ranks, **({"note": self.note} if self.note is not None else {})}

    def headline(self, common: SourceDescription) -> str:
        return f"({self.ranks} ranks, tag {common.tag})"


def _description(note: str | None = None) -> SourceDescription:
    return SourceDescription(
        format="toy", checkpoint="mem://c", tag="step4", num_params=12, checkpoint_bytes=30,
        files=(FileIdentity(url="mem://c/a", size_bytes=30, version="7"),),
        content_sha256="ab" * 32, details=_Details(ranks=2, note=note),
    )  # fmt: skip


def test_the_block_follows_the_formats_key_order_and_leaves_out_what_it_omits() -> None:
    block = _description().to_json()
    assert list(block) == [
        "format", "checkpoint", "ranks", "tag", "num_params", "files", "checkpoint_bytes",
        "content_sha256",
    ]  # fmt: skip
    assert block["files"] == [{"url": "mem://c/a", "size_bytes": 30, "version": "7"}]
    assert "tag_url" not in block  # not in the format's order
    assert list(_description("x").to_json())[-1] == "note"
    assert "files" not in _description().to_json(with_files=False)


def test_a_description_read_back_writes_the_same_bytes_and_headline() -> None:
    first = _description("kept")
    back = SourceDescription.from_json(
        json.loads(json.dumps(first.to_json())), json.loads(json.dumps(first.reader_json()))
    )
    assert json.dumps(back.to_json()) == json.dumps(first.to_json())
    assert back.format == "toy" and back.files == first.files and back.num_params == 12
    assert back.headline == first.headline == "(2 ranks, tag step4)"
    assert isinstance(back.details, StoredDetails)
    assert back.model_files_url == "mem://c"  # no tag folder: the checkpoint itself


def test_inspect_facts_keep_the_report_order() -> None:
    facts = InspectFacts(
        fields={"checkpoint": "c", "files": {"n": 1}},
        about=["Checkpoint  c"],
        read_labels=ReadLabels(main="m", other="o", metadata="d", never="n"),
        appendix={"pipeline": {"stages": 2}},
    )
    assert list(facts.to_json()) == ["checkpoint", "files", "about", "read_labels", "pipeline"]


def test_the_16_bit_witness_is_a_capability_the_deepspeed_readers_declare() -> None:
    having = {r.name for r in READERS if isinstance(r, ReadsLowpCopies)}
    assert having == {"deepspeed", "deepspeed-universal"}
    assert not isinstance(reader_named("dcp"), ReadsLowpCopies)
