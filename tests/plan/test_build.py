"""The format-agnostic planner on plain integers and synthetic layouts: no checkpoint, no I/O."""

from __future__ import annotations

import pytest

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, LayoutMismatchError
from zerosafe.formats.base import (
    Slot,
    SourceDescription,
    SourceFile,
    SourceLayout,
    SourceTensor,
    StoredDetails,
)
from zerosafe.plan.build import assign_shards, plan_layout, plan_parts


@pytest.mark.parametrize(
    ("sizes", "limit", "want"),
    [
        ([], 10, []),
        ([4, 4, 4], 10, [0, 0, 1]),
        ([10, 10], 10, [0, 1]),  # exactly full: the next one starts a new file
        ([3, 20, 3], 10, [0, 1, 2]),  # larger than the limit: a file of its own
        ([20, 3, 3], 10, [0, 1, 1]),
        ([0, 0, 10, 0], 10, [0, 0, 0, 0]),  # empty tensors never open a file
        ([6, 5, 5, 6], 10, [0, 1, 1, 2]),
    ],
)
def test_assign_shards(sizes: list[int], limit: int, want: list[int]) -> None:
    assert assign_shards(sizes, limit) == want


def _slot(index: int, rank: int, numel: int, dtype: str = "float32") -> Slot:
    return Slot(
        index=index, file=0, rank=rank, kind="fp32", name=f"s{index}", record=f"r{index}",
        record_offset=64 * index, record_size_bytes=4 * numel, record_crc32=0,
        element_offset=0, numel=numel, dtype=dtype,
    )  # fmt: skip


def test_plan_parts_split_a_rank_by_bytes_and_never_mix_ranks() -> None:
    slots = [_slot(0, 0, 10), _slot(1, 0, 10), _slot(2, 1, 3)]
    parts = plan_parts(slots, [0, 1, 2], part_bytes=48)  # 12 fp32 elements per part
    assert [(p.rank, p.pieces) for p in parts] == [
        (0, ((0, 0, 10), (1, 0, 2))),
        (0, ((1, 2, 8),)),
        (1, ((2, 0, 3),)),
    ]
    assert [p.file_name for p in parts] == [
        "rank00000-part0000.safetensors",
        "rank00000-part0001.safetensors",
        "rank00001-part0000.safetensors",
    ]


def _layout(tensors: dict[str, SourceTensor], slots: list[Slot], **kw: object) -> SourceLayout:
    return SourceLayout(
        format="test", where="mem://ckpt", tag="t",
        files=[SourceFile(index=0, url="mem://ckpt/f", role="x", rank=0, size_bytes=1, version="1")],
        slots=slots, tensors=tensors, order=list(kw.pop("order", tensors)),
        source=SourceDescription(
            format="test", checkpoint="mem://ckpt", tag="t", num_params=0, checkpoint_bytes=1,
            files=(), content_sha256="", details=StoredDetails((), ("checkpoint", "tag")),
        ),
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _tensor(name: str, shape: tuple[int, ...], frags: tuple, role: str = "param") -> SourceTensor:
    return SourceTensor(name=name, shape=shape, dtype="float32", role=role, fragments=frags)


def test_fragments_from_two_ranks_tile_a_tensor() -> None:
    layout = _layout(
        {"w": _tensor("w", (2, 3), ((1, 0, 3, 3), (0, 2, 3, 0)))}, [_slot(0, 0, 5), _slot(1, 1, 3)]
    )
    plan = plan_layout(layout, ConvertOptions(dtype="bf16"))
    assert [(t.name, t.out_dtype, t.shard) for t in plan.tensors] == [("w", "bfloat16", 0)]
    assert plan.fragments.for_tensor(0) == [(0, 2, 3, 0), (1, 0, 3, 3)]  # destination order
    assert plan.shards[0].data_bytes == 12


@pytest.mark.parametrize(
    ("frags", "why"),
    [
        (((0, 0, 3, 0), (0, 3, 2, 4)), "gap or overlap at element 3"),
        (((0, 0, 4, 0), (0, 0, 4, 2)), "gap or overlap at element 4"),
        (((0, 0, 5, 0),), "has 6 elements but its fragments hold 5"),
        (((0, 4, 6, 0),), "gap or overlap"),  # reads past the slot
    ],
)
def test_fragments_that_do_not_tile_are_refused(frags: tuple, why: str) -> None:
    layout = _layout({"w": _tensor("w", (6,), frags)}, [_slot(0, 0, 8)])
    with pytest.raises(LayoutMismatchError, match=why):
        plan_layout(layout, ConvertOptions())


def test_aliases_recorded_or_copied_and_dropped_with_an_excluded_target() -> None:
    slots = [_slot(0, 0, 4), _slot(1, 0, 2)]
    tensors = {
        "emb": _tensor("emb", (4,), ((0, 0, 4, 0),)),
        "side": _tensor("side", (2,), ((1, 0, 2, 0),), role="frozen"),
    }
    kw = {
        "order": ["emb", "head", "side", "side_alias"],
        "aliases": {"head": "emb", "side_alias": "side"},
    }
    plan = plan_layout(_layout(tensors, slots, **kw), ConvertOptions())
    assert [t.name for t in plan.tensors] == ["emb", "side"]
    assert plan.aliases == {"head": "emb", "side_alias": "side"}
    plan = plan_layout(_layout(tensors, slots, **kw), ConvertOptions(tied="copy"))
    assert [(t.name, t.role, t.alias_of) for t in plan.tensors] == [
        ("emb", "param", None), ("head", "tied", "emb"), ("side", "frozen", None),
        ("side_alias", "tied", "side"),
    ]  # fmt: skip
    plan = plan_layout(_layout(tensors, slots, **kw), ConvertOptions(exclude_frozen=True))
    assert [t.name for t in plan.tensors] == ["emb"] and plan.aliases == {"head": "emb"}
    assert any("1 frozen param(s) left out" in n for n in plan.notes)


def test_integer_tensors_keep_their_dtype_and_oversized_tensors_get_a_note() -> None:
    slots = [_slot(0, 0, 8), _slot(1, 0, 2, dtype="int64")]
    tensors = {
        "big": _tensor("big", (8,), ((0, 0, 8, 0),)),
        "steps": SourceTensor(
            name="steps", shape=(2,), dtype="int64", role="buffer", fragments=((1, 0, 2, 0),)
        ),
    }
    plan = plan_layout(_layout(tensors, slots), ConvertOptions(dtype="fp16", max_shard_size=10))
    assert [(t.name, t.out_dtype, t.shard) for t in plan.tensors] == [
        ("big", "float16", 0), ("steps", "int64", 1),
    ]  # fmt: skip
    assert [s.file_name for s in plan.shards] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
    ]  # fmt: skip
    assert any("exceed the shard size of 10 bytes" in n and "'big'" in n for n in plan.notes)


def test_job_key_depends_on_files_tag_and_byte_options_only() -> None:
    layout = _layout({"w": _tensor("w", (4,), ((0, 0, 4, 0),))}, [_slot(0, 0, 4)])
    base = plan_layout(layout, ConvertOptions()).job_key
    assert plan_layout(layout, ConvertOptions(memory=2 * 10**9)).job_key == base
    assert plan_layout(layout, ConvertOptions(dtype="bf16")).job_key != base
    layout.tag = "other"
    assert plan_layout(layout, ConvertOptions()).job_key != base


# -- issue 24 item 3: no two tensors get one output name ------------------------------------------


def test_a_name_listed_twice_is_refused_before_writing() -> None:
    """A reader that renames (pipeline-parallel layer files, MoE experts, a DCP selection)
    and lists one output name twice: each safetensors header keeps a name once, so one tensor
    would be lost, or two entries would name one tensor. The shipped sample's own layout,
    its order damaged, is refused with both sources and the name."""
    from tests.conftest import SAMPLE_CKPT
    from zerosafe.formats.registry import read_source
    from zerosafe.io.storage import Storage

    options = ConvertOptions()
    layout = read_source(Storage(), str(SAMPLE_CKPT), tag=None, options=options)
    assert len(plan_layout(layout, options).tensors) == len(set(layout.order)) - 1  # 1 alias
    layout.order.append(layout.order[2])
    with pytest.raises(CheckpointFormatError, match=r"'embed.weight' twice.*output name"):
        plan_layout(layout, options)


def test_an_alias_named_like_a_tensor_is_refused() -> None:
    slots = [_slot(0, 0, 4), _slot(1, 0, 4)]
    tensors = {
        "emb": _tensor("emb", (4,), ((0, 0, 4, 0),)),
        "head": _tensor("head", (4,), ((1, 0, 4, 0),)),
    }
    layout = _layout(tensors, slots, order=["emb", "head"], aliases={"head": "emb"})
    for tied in ("dedupe", "copy"):
        with pytest.raises(
            CheckpointFormatError,
            match=r"'head' \(a tensor\) and 'head' \(an alias of 'emb'\) both have the output name 'head'",
        ):
            plan_layout(layout, ConvertOptions(tied=tied))  # type: ignore[arg-type]


def test_dcp_renames_that_collide_name_both_keys() -> None:
    from zerosafe.errors import ConfigError
    from zerosafe.formats.dcp.reader import DcpSelection, select_tensors

    keys = ["model.w", "w", "model.b"]
    picked = select_tensors(keys, DcpSelection(select=("model",), strip_prefix="model"))
    assert picked.pairs == [("model.w", "w"), ("model.b", "b")]
    with pytest.raises(ConfigError, match=r"'model.w' and 'w' both become 'w'"):
        select_tensors(keys, DcpSelection(select=("model", "w"), strip_prefix="model"))
