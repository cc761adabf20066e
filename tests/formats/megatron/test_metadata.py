"""megatron-core's `.metadata`: torch's DCP metadata plus `all_local_plans` (issue 40)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.formats.megatron.conftest import save_path
from zerosafe.formats.dcp.metadata import PLANNER_CLASSES, parse_metadata
from zerosafe.formats.megatron.args import read_args
from zerosafe.io.storage import Storage


def test_planner_classes_are_read_as_data(megatron_save: str) -> None:
    """megatron-core 0.19.2 pickles torch's `SavePlan`, `WriteItem`, `WriteItemType` and
    `TensorWriteData` into `.metadata`; they were refused as unknown globals (issue 40)."""
    path = save_path(megatron_save) / "iter_0000003" / ".metadata"
    meta = parse_metadata(path.read_bytes(), str(path))
    assert set(PLANNER_CLASSES) <= meta.globals_found
    qkv = meta.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    rows = (4 + 2 * 2) * (16 if megatron_save == "qwen3tp2" else 8)  # (heads + 2 groups) x d
    assert qkv.size == (2, rows, 32) and qkv.dtype == "float32"
    assert "common_state/shard_0_1" in meta.byte_entries
    assert meta.version == "1.0.0"


def test_args_are_read_as_inert_data(megatron_save: str) -> None:
    """The args `Namespace` in `common_state`, with the `AttnBackend` enum Megatron-LM's
    args hold, is read as data: nothing of megatron's is imported or run."""
    url = str(save_path(megatron_save) / "iter_0000003")
    meta = parse_metadata(Path(url, ".metadata").read_bytes(), url)
    args = read_args(url, meta, Storage())
    assert args.iteration == 3
    assert args.fields["num_query_groups"] == 2 and args.fields["vocab_size"] == 53
    assert "AttnBackend" in str(args.fields["attention_backend"])
    assert args.fields["params_dtype"] == "float32"
    assert "megatron" not in sys.modules
