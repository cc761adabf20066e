"""megatron-core's `.metadata`: torch's DCP metadata plus `all_local_plans` (issue 40)."""

from __future__ import annotations

from tests.formats.megatron.conftest import save_path
from zerosafe.formats.dcp.metadata import PLANNER_CLASSES, parse_metadata


def test_planner_classes_are_read_as_data(megatron_save: str) -> None:
    """megatron-core 0.19.2 pickles torch's `SavePlan`, `WriteItem`, `WriteItemType` and
    `TensorWriteData` into `.metadata`; they were refused as unknown globals (issue 40)."""
    path = save_path(megatron_save) / "iter_0000003" / ".metadata"
    meta = parse_metadata(path.read_bytes(), str(path))
    assert set(PLANNER_CLASSES) <= meta.globals_found
    qkv = meta.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.size == (2, 64, 32) and qkv.dtype == "float32"
    assert "common_state/shard_0_1" in meta.byte_entries
    assert meta.version == "1.0.0"
