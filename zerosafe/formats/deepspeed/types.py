"""The types the DeepSpeed readers share: a loaded file, a ZeRO checkpoint (one data-parallel
group of files), a pipeline-parallel checkpoint (one per stage) and a tag folder's listing.

Data only: the modules that read checkpoints (`files`, `rank_files`, `model_parallel`,
`pipeline`, `universal`) and those that lay them out (`slots`, `facts`, `reader`) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zerosafe.formats.deepspeed.layout import FlatGroup
from zerosafe.formats.deepspeed.moe_common import MoELayout
from zerosafe.formats.torch_zip import TensorRecord, TorchZipFile
from zerosafe.io.storage import FileIdentity

__all__ = [
    "FrozenParam",
    "LayerTensor",
    "LoadedFile",
    "PipelineCheckpoint",
    "SwapFile",
    "TagFiles",
    "ZeroCheckpoint",
]


@dataclass(kw_only=True)
class LoadedFile:
    """One checkpoint file: its identity, zip directory and unpickled (lazy) contents."""

    url: str
    role: str
    """`optim`, `model` or `expert` (an MoE expert file)."""
    rank: int
    """The data-parallel rank that wrote it (an expert file: the first rank holding its expert)."""
    identity: FileIdentity
    zip: TorchZipFile
    obj: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class FrozenParam:
    """A parameter without fp32 master weights, saved in the training dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    source: str
    """`fragments` (ZeRO-2/3 `frozen_param_fragments`), `module` (the 16-bit module copy) or
    `expert file` (an MoE expert's file)."""
    pieces: tuple[tuple[int, TensorRecord], ...]
    """`(rank, tensor)` in rank order; concatenated and cut to `numel` they give the param."""
    url: str = ""
    """The file holding the pieces when it is not their rank's model states (an expert file)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SwapFile:
    """A ZeRO-3 master partition that NVMe offload keeps in a swap file, not the optim file."""

    url: str
    identity: FileIdentity
    rank: int
    numel: int
    dtype: str


@dataclass(kw_only=True)
class ZeroCheckpoint:
    """Everything the planner needs about one tag of a ZeRO checkpoint."""

    ckpt_url: str
    tag: str
    tag_url: str
    stage: int
    optimizer_kind: str
    """`zero` (DeepSpeed's ZeRO optimizer) or `bf16_optimizer` (`BF16_Optimizer`, ZeRO-1)."""
    world_size: int
    train_dtype: str
    ds_version: str | None
    optim_files: list[LoadedFile]
    model_files: list[LoadedFile]
    param_groups: list[list[tuple[str, tuple[int, ...]]]]
    """Per flat group (ZeRO-3: per sub-group), the params in flat order with their shapes, as
    rank 0's `param_shapes` names them (MoE: rank 0's local experts)."""
    fp32_partitions: list[list[TensorRecord]]
    """Per rank, per flat group of that rank's optimizer file, the saved fp32 partition."""
    frozen: list[FrozenParam]
    buffers: list[tuple[str, TensorRecord]]
    shared: dict[str, str]
    """Tied aliases: alias name -> the name of the tensor it shares memory with."""
    module_order: list[str]
    master_dtype: str = "float32"
    """The dtype of the master weights (the groups DeepSpeed names `fp32`): bfloat16 or float16
    with `bf16_master_weights_and_grads` / `fp16_master_weights_and_grads`."""
    optimizer_name: str = "unknown"
    """The wrapped torch optimizer, as `inspect` names it (`AdamW`, `Muon`), with its state."""
    empty_params: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    """Zero-element params `(name, shape, dtype)`: in the output with their shape and no data."""
    swapped: dict[tuple[int, int], SwapFile] = field(default_factory=dict)
    """NVMe offload: `(rank, sub-group)` -> the swap file holding that partition's masters."""
    pipeline_stage: int | None = None
    """The pipeline stage (`mp_rank_XX`) these files are, in a pipeline-parallel checkpoint
    (`zerosafe.formats.deepspeed.pipeline`): its buffers and frozen params are in the layer
    files, not in the model states."""
    flat_groups: list[FlatGroup] = field(default_factory=list)
    """ZeRO-1/2: every flat group, where its partitions are and their sizes. ZeRO-3: only for
    MoE, whose sub-groups are partitioned over different ranks (otherwise `param_groups`
    over all ranks)."""
    expert_files: list[LoadedFile] = field(default_factory=list)
    """MoE expert files, by layer and expert."""
    moe: MoELayout | None = None
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def files(self) -> list[LoadedFile]:
        return [*self.optim_files, *self.model_files, *self.expert_files]

    @property
    def trained_params(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every param with fp32 masters: output name and shape (MoE: every expert, by its
        global name or, for AutoEP, as one logical tensor)."""
        if self.moe is not None:
            return list(self.moe.params.items())
        return [(name, shape) for group in self.param_groups for name, shape in group]

    @property
    def param_names(self) -> list[str]:
        return [name for name, _ in self.trained_params]


@dataclass(kw_only=True)
class TagFiles:
    """A tag folder's checkpoint files by model-parallel rank (the `mp_rank_XX` of their names:
    the pipeline stage, or the tensor-parallel rank), from its listing alone."""

    tag_url: str
    names: list[str]
    optim: dict[int, dict[int, str]]
    """mp rank -> data-parallel rank -> optimizer file."""
    model: dict[int, dict[int, str]]
    """mp rank -> rank -> model states file (ZeRO-1/2: rank 0 only, `mp_rank_XX_model_states.pt`)."""
    layers: dict[int, str]
    """Pipeline layer index -> `layer_XX-model_states.pt` (written by a `PipelineModule`)."""
    experts: dict[tuple[int, int], str] = field(default_factory=dict)
    """MoE expert files (`layer_<L>_expert_<E>_mp_rank_00_model_states.pt`) by `(layer, expert)`."""

    @property
    def model_parallel(self) -> bool:
        """Whether the folder holds more than plain data parallelism (mp_rank_00 alone)."""
        return bool(self.layers) or any(mp != 0 for mp in (*self.optim, *self.model))


@dataclass(frozen=True, kw_only=True, slots=True)
class LayerTensor:
    """A tensor of a `layer_XX-model_states.pt` file under its output name."""

    name: str
    file: LoadedFile
    tensor: TensorRecord


@dataclass(kw_only=True)
class PipelineCheckpoint:
    """A pipeline-parallel checkpoint: one `ZeroCheckpoint` per stage, and the layer files.

    Offers the attributes of `ZeroCheckpoint` the rest of zerosafe reads (`files`, `stage`,
    `world_size`, `train_dtype`, `param_groups`...), for the checkpoint as a whole."""

    ckpt_url: str
    tag: str
    tag_url: str
    stages: list[ZeroCheckpoint]
    layer_files: list[LoadedFile]
    owner: dict[str, int]
    """Trained param -> the stage whose masters are converted (the first holding it)."""
    held_by: dict[str, list[int]]
    """Trained param -> every stage whose masters hold it (several for a tied one)."""
    buffers: list[LayerTensor]
    frozen: list[LayerTensor]
    empty_params: list[tuple[str, tuple[int, ...], str]]
    shared: dict[str, str]
    order: list[str]
    module_copies: dict[str, LayerTensor]
    """Trained param -> its module copy (training dtype) in a layer file."""
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    swapped: dict[Any, Any] = field(default_factory=dict)
    """NVMe swap files: none (the pipeline engine runs ZeRO-1 at most)."""

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stage(self) -> int:
        return self.stages[0].stage

    @property
    def optimizer_kind(self) -> str:
        return self.stages[0].optimizer_kind

    @property
    def world_size(self) -> int:
        """The data-parallel world size of each stage."""
        return self.stages[0].world_size

    @property
    def train_dtype(self) -> str:
        return self.stages[0].train_dtype

    @property
    def master_dtype(self) -> str:
        return self.stages[0].master_dtype

    @property
    def optimizer_name(self) -> str:
        return self.stages[0].optimizer_name

    @property
    def ds_version(self) -> str | None:
        return self.stages[0].ds_version

    @property
    def optim_files(self) -> list[LoadedFile]:
        return [f for s in self.stages for f in s.optim_files]

    @property
    def model_files(self) -> list[LoadedFile]:
        return [f for s in self.stages for f in s.model_files]

    @property
    def files(self) -> list[LoadedFile]:
        """Every file read, in `model_parallel_urls` order: each stage's optimizer and model
        states files, then the layer files by index."""
        return [*(f for s in self.stages for f in s.files), *self.layer_files]

    @property
    def param_groups(self) -> list[list[tuple[str, tuple[int, ...]]]]:
        """Every stage's groups, each trained param once (in its owner stage's group)."""
        return [
            [(n, shape) for n, shape in group if self.owner[n] == s]
            for s, stage in enumerate(self.stages)
            for group in stage.param_groups
        ]

    @property
    def param_names(self) -> list[str]:
        return [name for group in self.param_groups for name, _ in group]

    @property
    def trained_params(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, shape) for group in self.param_groups for name, shape in group]

    @property
    def moe(self) -> None:
        """No MoE layout: expert files beside pipeline layer files are refused (`files.scan_files`)."""
        return None

    @property
    def expert_files(self) -> list[LoadedFile]:
        return []
