"""The DCP reader against torch's own consolidation, on real checkpoints written by torch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.formats.dcp.helpers import assemble, same_bits
from zerosafe.errors import ConfigError
from zerosafe.formats.dcp.reader import DcpSelection, is_dcp_checkpoint, read_dcp_layout
from zerosafe.io.storage import ByteSource, Storage

Checkpoint = Callable[[str], Path]
Oracle = Callable[[str], dict[str, object]]


@pytest.mark.parametrize("name", ["dtensor", "fsdp2", "flat"])
def test_default_selection_matches_dcp_to_torch_save(
    name: str, dcp_checkpoint: Checkpoint, dcp_oracle: Oracle
) -> None:
    path = dcp_checkpoint(name)
    layout = read_dcp_layout(str(path), Storage())
    oracle = dcp_oracle(name)
    has_model = any(k.startswith("model.") for k in oracle)
    want = {
        k.removeprefix("model.") if has_model else k: v
        for k, v in oracle.items()
        if hasattr(v, "dtype") and (k.startswith("model.") or not has_model)
    }
    assert list(layout.tensors) == list(want) == layout.order
    for t in layout.tensors.values():
        assert same_bits(assemble(layout, t), want[t.name]), t.name  # type: ignore[arg-type]


def test_dtensor_layouts_and_entries(dcp_checkpoint: Checkpoint) -> None:
    layout = read_dcp_layout(str(dcp_checkpoint("dtensor")), Storage())
    by_name = layout.tensors
    # Shard(0) uneven (101 rows on 4 ranks): one run per chunk; Shard(1): one run per row.
    assert len(by_name["emb.weight"].fragments) == 4
    assert len(by_name["proj.weight"].fragments) == 4 * 10
    assert by_name["proj.weight"].dtype == "bfloat16"
    assert len(by_name["grid.weight"].fragments) == 4 + 4 + 3 + 3  # 2x2 mesh: rows per block
    assert by_name["scale"].shape == () and by_name["empty"].shape == (0, 4)
    block = layout.source.to_json()  # the manifest's `source` block
    assert block["non_tensor_entries"] == [
        "optim.param_groups.0.lr", "optim.param_groups.0.params", "step", "extra.note",
    ]  # fmt: skip
    assert any("non-tensor" in n and "step" in n for n in layout.notes)
    assert block["format"] == "dcp" and block["num_distcp_files"] == 4
    assert "4 .distcp files" in layout.source.headline
    assert layout.format == "dcp" and layout.tag == "dtensor"
    assert [f.role for f in layout.files] == ["metadata"] + ["distcp"] * 4
    assert layout.facts is not None
    facts = layout.facts.to_json()
    assert facts["sharding"]["4 chunks on dim 0"] >= 1 and facts["sharding"]["4 chunks on dim 1"]
    assert [2, 2] in facts["meshes"] and [4] in facts["meshes"]
    assert facts["about"][0].endswith(
        "(PyTorch DCP, metadata version " + str(facts["dcp_version"]) + ")"
    )


def test_tied_weight_is_converted_under_both_names(
    dcp_checkpoint: Checkpoint, dcp_oracle: Oracle
) -> None:
    layout = read_dcp_layout(str(dcp_checkpoint("fsdp2")), Storage())
    by_name = layout.tensors
    embed, head = (
        assemble(layout, by_name["embed.weight"]),
        assemble(layout, by_name["head.weight"]),
    )
    assert same_bits(embed, head)


def test_select_optimizer_state(dcp_checkpoint: Checkpoint, dcp_oracle: Oracle) -> None:
    path = dcp_checkpoint("fsdp2")
    selection = DcpSelection(select=("optim.state",), strip_prefix="optim.state")
    layout = read_dcp_layout(str(path), Storage(), selection)
    oracle = dcp_oracle("fsdp2")
    assert set(layout.tensors) == {
        k.removeprefix("optim.state.") for k in oracle if k.startswith("optim.state.")
    }
    for t in layout.tensors.values():
        want = oracle[f"optim.state.{t.name}"]
        assert same_bits(assemble(layout, t), want), t.name  # type: ignore[arg-type]


def test_safetensors_serialization(dcp_checkpoint: Checkpoint, dcp_oracle: Oracle) -> None:
    # torch 2.13's FileSystemReader cannot load this form (it torch.loads every chunk), so
    # the oracle is the same state saved in the default form.
    layout = read_dcp_layout(str(dcp_checkpoint("safetensors")), Storage())
    oracle = dcp_oracle("flat")
    assert list(layout.tensors) == ["w", "v", "b"]
    for t in layout.tensors.values():
        assert same_bits(assemble(layout, t), oracle[t.name]), t.name  # type: ignore[arg-type]
    assert any("safetensors" in n for n in layout.notes)


class _RecordingStorage(Storage):
    """Records every byte range read from the checkpoint's files."""

    def __init__(self) -> None:
        super().__init__()
        self.ranges: list[tuple[str, int, int]] = []

    def open_source(self, url: str) -> ByteSource:
        source = super().open_source(url)
        outer = self

        class Recording:
            def __init__(self) -> None:
                self.url, self.size_bytes = source.url, source.size_bytes

            def read_range(self, start: int, end: int) -> bytes:
                outer.ranges.append((url, start, end))
                return source.read_range(start, end)

            def readinto_at(self, offset: int, buf: memoryview) -> None:
                outer.ranges.append((url, offset, offset + len(buf)))
                source.readinto_at(offset, buf)

            def close(self) -> None:
                source.close()

        return Recording()


def test_optimizer_state_is_never_read(dcp_checkpoint: Checkpoint) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    path = dcp_checkpoint("fsdp2")
    storage = _RecordingStorage()
    layout = read_dcp_layout(str(path), storage)
    meta = FileSystemReader(str(path)).read_metadata()
    optim = [
        (str(path / info.relative_path), info.offset, info.offset + info.length)
        for index, info in meta.storage_data.items()
        if index.fqn.startswith("optim.")
    ]
    assert storage.ranges and optim
    for url, start, end in storage.ranges:
        for o_url, o_start, o_end in optim:
            assert url != o_url or end <= o_start or start >= o_end, (url, start, end)
    # headers only: far fewer bytes than the model's own data
    data_bytes = sum(s.nbytes for s in layout.slots)
    assert sum(end - start for _, start, end in storage.ranges) < 2 * data_bytes + 40_000


def test_selection_errors(dcp_checkpoint: Checkpoint) -> None:
    path = str(dcp_checkpoint("flat"))
    with pytest.raises(
        ConfigError, match=r"no tensor matches `select` \['model'\].*\['b', 'v', 'w'\]"
    ):
        read_dcp_layout(path, Storage(), DcpSelection(select=("model",)))
    layout = read_dcp_layout(path, Storage(), DcpSelection(select=("w", "b")))
    assert list(layout.tensors) == ["w", "b"]


def test_detection(dcp_checkpoint: Checkpoint, tmp_path: Path) -> None:
    assert is_dcp_checkpoint(str(dcp_checkpoint("flat")), Storage())
    assert not is_dcp_checkpoint(str(tmp_path), Storage())
