"""Megatron-LM / megatron-core `torch_dist` checkpoints as a format reader: a `SourceLayout`.

Megatron-LM's `--save` folder (megatron/training/checkpointing.py, with megatron-core 0.19.2's
`dist_checkpointing.save(..., 'torch_dist')`) holds `latest_checkpointed_iteration.txt` (the
latest iteration, or `release`) and one folder per save, `iter_NNNNNNN/` (`release/`), each a
PyTorch DCP folder (`.metadata`, `__R_0.distcp`) plus `metadata.json`
(`{"sharded_backend": "torch_dist", ...}`). Its keys are megatron-core's sharded keys: the
model's tensors with their layers stacked (`names.py`), the DistributedOptimizer's flat
buffers (`optimizer.distributed...`, never weights) and non-tensor byte items (`common_state`
with the args: `args.py`; `_extra_state`), which are never weights either.

The chunks are read exactly as the DCP reader reads them (`zerosafe.formats.dcp.reader`:
metadata, chunk geometry, stored bytes); the model's stacked tensors are then cut into the
Hugging Face Llama tensors as runs of their fragments (`names.py`): nothing is built in memory.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from zerosafe.config import ConvertOptions
from zerosafe.errors import CheckpointFormatError, ConfigError, UnsupportedCheckpointError
from zerosafe.formats.base import InspectFacts, ReadLabels, SourceLayout, SourceTensor
from zerosafe.formats.dcp.metadata import DcpMetadata
from zerosafe.formats.dcp.reader import (
    METADATA_FILE,
    DcpSelection,
    read_dcp_layout,
    read_metadata,
)
from zerosafe.formats.megatron.args import (
    MegatronArgs,
    check_llama,
    hf_config,
    llama_shape,
    read_args,
)
from zerosafe.formats.megatron.names import (
    STACKED,
    HfPiece,
    LlamaShape,
    compose,
    kept_pieces,
    llama_pieces,
)
from zerosafe.io.storage import Storage, join_url, normalize_url

__all__ = ["FORMAT_NAME", "LATEST_FILE", "MegatronReader"]

FORMAT_NAME = "Megatron-LM torch_dist"
LATEST_FILE = "latest_checkpointed_iteration.txt"
BACKEND_FILE = "metadata.json"
_ITER = re.compile(r"iter_\d{7}|release")
_LATEST_MAX_BYTES = 64
_OPTIMIZER = re.compile(r"(chained_\d+\.)?optimizer\.")
"""The DistributedOptimizer's keys; with experts megatron-core chains one optimizer for the
dense parameters and one for the experts' (`chained_0.optimizer...`, `chained_1...`)."""

_ROLES: dict[str, tuple[str, ...]] = {
    "embedding": ("embedding.word_embeddings.weight",),
    "input_norm": (
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.input_layernorm.weight",
    ),
    "qkv": ("decoder.layers.self_attention.linear_qkv.weight",),
    "proj": ("decoder.layers.self_attention.linear_proj.weight",),
    "mlp_norm": (
        "decoder.layers.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.pre_mlp_layernorm.weight",
    ),
    "fc1": ("decoder.layers.mlp.linear_fc1.weight",),
    "fc2": ("decoder.layers.mlp.linear_fc2.weight",),
    "final_norm": ("decoder.final_layernorm.weight",),
    "output": ("output_layer.weight",),
    "qkv_bias": ("decoder.layers.self_attention.linear_qkv.bias",),
    "q_norm": ("decoder.layers.self_attention.q_layernorm.weight",),
    "k_norm": ("decoder.layers.self_attention.k_layernorm.weight",),
    "router": ("decoder.layers.mlp.router.weight",),
    "experts_fc1": ("decoder.layers.mlp.experts.experts.linear_fc1.weight",),
    "experts_fc2": ("decoder.layers.mlp.experts.experts.linear_fc2.weight",),
}
"""The Megatron key of each role in the Llama mapping: the Transformer Engine spec's names
(fused norms), which megatron-core also saves for its local spec, then the local spec's own.
The QKV bias and query/key norms only where the args say so (`--add-qkv-bias`,
`--qk-layernorm`); with `--num-experts` the router and the experts (SequentialMLP, stacked
`[num_layers, num_experts, ...]`) instead of `fc1` and `fc2`."""


class MegatronReader:
    """Megatron-LM `torch_dist` checkpoints: a `--save` folder, or one `iter_NNNNNNN/` of it."""

    name = "megatron"
    title = FORMAT_NAME
    looks_like = (
        f"a Megatron-LM `--save` folder (`{LATEST_FILE}` and `iter_NNNNNNN/` folders) or one "
        f"`iter_NNNNNNN/` holding `{METADATA_FILE}` and `{BACKEND_FILE}`"
    )
    selects = False
    parts_below: tuple[str, ...] = ("megatron", "dcp")
    tag_folders = True

    def detect(self, storage: Storage, url: str) -> bool:
        url = normalize_url(url)
        if not storage.isdir(url):
            return False
        names = storage.listdir(url)
        if METADATA_FILE in names and BACKEND_FILE in names:
            return True
        return LATEST_FILE in names and any(_ITER.fullmatch(n) for n in names)

    def quick_identities(
        self, storage: Storage, url: str, tag: str | None
    ) -> tuple[str, list[dict[str, Any]]]:
        iter_url = self._iteration_url(storage, normalize_url(url), tag)
        names = [
            METADATA_FILE,
            *sorted(n for n in storage.listdir(iter_url) if n.endswith(".distcp")),
        ]
        return _tag_name(iter_url), [
            storage.identity(join_url(iter_url, n)).as_dict() for n in names
        ]

    def read(
        self, storage: Storage, url: str, *, tag: str | None, options: ConvertOptions
    ) -> SourceLayout:
        url = normalize_url(url)
        iter_url = self._iteration_url(storage, url, tag)
        read_before = storage.counter.bytes_read
        meta, meta_sha = read_metadata(iter_url, storage)
        args = read_args(iter_url, meta, storage)
        model_keys = [k for k in meta.tensors if not _OPTIMIZER.match(k)]
        shape: LlamaShape | None = None
        if options.keep_names:
            pieces = _kept_pieces(iter_url, meta, model_keys, args)
        else:
            check_llama(args)
            shape = llama_shape(args)
            keys = _role_keys(iter_url, meta, model_keys, args, shape)
            pieces = llama_pieces(shape, keys)
            _check_shapes(iter_url, meta, shape, keys)
        tops = tuple(dict.fromkeys(k.split(".", 1)[0] for k in model_keys))
        dcp = read_dcp_layout(
            iter_url, storage, DcpSelection(select=tops), metadata=(meta, meta_sha)
        )
        tensors = {p.name: _tensor(p, dcp.tensors[p.source]) for p in pieces}
        dcp.format = self.name
        dcp.source = dataclasses.replace(
            dcp.source,
            format=self.name,
            num_params=sum(math.prod(t.shape) for t in tensors.values()),
            model_config=(
                None if shape is None else hf_config(args, shape, dtype=_saved_dtype(tensors))
            ),
        )
        dcp.tensors = tensors
        dcp.order = list(tensors)
        dcp.tag = _tag_name(iter_url)
        dcp.ties_by_config = shape is not None and "output" not in keys
        dcp.metadata_bytes = storage.counter.bytes_read - read_before
        dcp.notes = [n for n in dcp.notes if "not selected" not in n]
        optimizer = sum(1 for k in meta.tensors if _OPTIMIZER.match(k))
        if optimizer:
            dcp.notes.append(
                f"{optimizer} DistributedOptimizer buffer(s) (optimizer.distributed...) not read: "
                "optimizer state, never weights"
            )
        dcp.notes.append(
            _vocab_note(shape) if shape is not None else "`--keep-names`: Megatron's names, "
            "layers unstacked, nothing split, the padded vocabulary kept, no config.json generated"
        )  # fmt: skip
        dcp.facts = _facts(iter_url, args, shape, meta, dcp.facts)
        return dcp

    def _iteration_url(self, storage: Storage, url: str, tag: str | None) -> str:
        """The `iter_NNNNNNN/` folder to read: `url` itself, `--tag`'s, or the one
        `latest_checkpointed_iteration.txt` names.

        Raises:
            CheckpointFormatError: If the file names no iteration, or its folder is missing.
            ConfigError: If `--tag` names no folder of the save.
        """
        names = storage.listdir(url)
        if METADATA_FILE in names and tag in (None, _tag_name(url)):
            return url
        if tag is not None:
            if tag not in names or not storage.isdir(join_url(url, tag)):
                iters = sorted(n for n in names if _ITER.fullmatch(n))
                raise ConfigError(
                    f"{url}: `--tag {tag}` names no folder here; the saves are {iters}"
                )
            return join_url(url, tag)
        file_url = join_url(url, LATEST_FILE)
        text = storage.read_bytes(file_url)[:_LATEST_MAX_BYTES].decode("ascii", "replace").strip()
        if text == "release":
            folder = "release"
        elif text.isascii() and text.isdecimal():
            folder = f"iter_{int(text):07d}"
        else:
            raise CheckpointFormatError(
                f"{file_url}: holds {text!r}, expected the latest iteration (Megatron-LM writes "
                "e.g. '3' for iter_0000003/) or 'release'; pass `--tag iter_NNNNNNN`"
            )
        iter_url = join_url(url, folder)
        if not storage.isdir(iter_url):
            raise CheckpointFormatError(
                f"{file_url}: names {folder}/, which is not in {url}; that save did not finish "
                "or was not copied. Pass `--tag` with a save that is there"
            )
        inside = storage.listdir(iter_url)
        if METADATA_FILE not in inside:
            legacy = [n for n in inside if n.startswith("mp_rank_")]
            if legacy:
                raise UnsupportedCheckpointError(
                    f"{iter_url}: holds {legacy[:3]}, Megatron-LM's legacy `torch` format, which "
                    "zerosafe does not read (it reads `torch_dist`: `.metadata` and `.distcp` "
                    "files); save with `--ckpt-format torch_dist`, or convert with Megatron's "
                    "own checkpoint converter"
                )
            raise CheckpointFormatError(
                f"{iter_url}: no '{METADATA_FILE}' ({len(inside)} entries); a Megatron-LM "
                "`torch_dist` save writes it last, so the save did not finish or was not "
                "copied. Pass `--tag` with a save that is complete"
            )
        return iter_url


def _saved_dtype(tensors: dict[str, SourceTensor]) -> str:
    """The dtype the weights were saved in (`config.json`'s `torch_dtype` before the output's
    own replaces it)."""
    return next(iter(tensors.values())).dtype


def _tag_name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def _role_keys(
    url: str, meta: DcpMetadata, model_keys: list[str], args: MegatronArgs, shape: LlamaShape
) -> dict[str, str]:
    """The Megatron key of each role (`_ROLES`); any other model tensor is refused.

    Raises:
        UnsupportedCheckpointError: A tensor the mapping does not know, or a role missing.
    """
    tied = not args.get("untie_embeddings_and_output_weights", False)
    wanted = [
        r for r in _ROLES
        if (r != "qkv_bias" or shape.qkv_bias) and (r not in ("q_norm", "k_norm") or shape.qk_norm)
        and (r not in ("fc1", "fc2") or not shape.num_experts)
        and (r not in ("router", "experts_fc1", "experts_fc2") or shape.num_experts)
    ]  # fmt: skip
    keys: dict[str, str] = {}
    for role in wanted:
        found = [k for k in _ROLES[role] if k in meta.tensors]
        if found:
            keys[role] = found[0]
    missing = [r for r in wanted if r not in keys and not (r == "output" and tied)]
    if missing:
        raise CheckpointFormatError(
            f"{url}: no tensor for {missing} ({_ROLES[missing[0]][0]}); the save holds "
            f"{model_keys[:8]}. Is it a GPT model saved by Megatron-LM?"
        )
    known = set(keys.values())
    other = [k for k in model_keys if k not in known]
    if other:
        raise UnsupportedCheckpointError(
            f"{url}: the save holds '{other[0]}' ({len(other)} tensor(s) the Llama mapping does "
            "not know), which zerosafe does not map to Hugging Face names yet; pass "
            "`--keep-names` for Megatron's own names, or convert with Megatron-Bridge or "
            "Megatron-LM's own converter"
        )
    return keys


def _check_shapes(url: str, meta: DcpMetadata, shape: LlamaShape, keys: dict[str, str]) -> None:
    """Refuse args that disagree with the stored shapes (another model's args, edited ones).

    Raises:
        CheckpointFormatError: Naming the tensor, its shape, and the one the args give.
    """
    s = shape
    h, d, n, g, f, layers = (
        s.hidden_size, s.kv_channels, s.num_attention_heads, s.num_query_groups,
        s.ffn_hidden_size, s.num_layers,
    )  # fmt: skip
    if n % g:
        raise CheckpointFormatError(
            f"{url}: the saved args have {n} attention heads in {g} query groups, which do not "
            "divide; the args are not this model's"
        )
    want = {
        "embedding": (s.padded_vocab_size, h), "output": (s.padded_vocab_size, h),
        "input_norm": (layers, h), "mlp_norm": (layers, h), "final_norm": (h,),
        "qkv": (layers, (n + 2 * g) * d, h), "proj": (layers, h, n * d),
        "fc1": (layers, 2 * f, h), "fc2": (layers, h, f),
        "qkv_bias": (layers, (n + 2 * g) * d), "q_norm": (layers, d), "k_norm": (layers, d),
        "router": (layers, s.num_experts, h),
        "experts_fc1": (layers, s.num_experts, 2 * s.moe_ffn_hidden_size, h),
        "experts_fc2": (layers, s.num_experts, h, s.moe_ffn_hidden_size),
    }  # fmt: skip
    for role, key in keys.items():
        got = meta.tensors[key].size
        if got != want[role]:
            raise CheckpointFormatError(
                f"{url}: '{key}' is {list(got)}, but the saved args (layers {layers}, hidden "
                f"{h}, heads {n}, query groups {g}, kv_channels {d}, ffn {f}, padded vocab "
                f"{s.padded_vocab_size}) give {list(want[role])}; the args are not this "
                "model's, so the tensors cannot be split. Convert the save as it was written"
            )


def _tensor(piece: HfPiece, stacked: SourceTensor) -> SourceTensor:
    return SourceTensor(
        name=piece.name, shape=piece.shape, dtype=stacked.dtype, role="param",
        fragments=compose(piece.runs, stacked.fragments),
    )  # fmt: skip


def _vocab_note(shape: LlamaShape) -> str:
    if shape.vocab_size == shape.padded_vocab_size:
        return (
            f"vocabulary: {shape.vocab_size} rows kept as stored (the args give no smaller "
            "`vocab_size`)"
        )
    return (
        f"vocabulary: the first {shape.vocab_size} of {shape.padded_vocab_size} rows kept "
        "(Megatron-LM's padding dropped)"
    )


def _family(shape: LlamaShape) -> str:
    if shape.qkv_bias:
        return "Qwen2"
    if shape.qk_norm:
        return "Qwen3"
    return "Mixtral" if shape.num_experts else "Llama"


def _kept_pieces(
    url: str, meta: DcpMetadata, model_keys: list[str], args: MegatronArgs
) -> list[HfPiece]:
    """`--keep-names`: every model tensor in Megatron's names, each stacked one
    (`decoder.layers.X`) unstacked into `decoder.layers.N.X`; any architecture.

    Raises:
        CheckpointFormatError: If a stacked tensor's first dimension is not the args' layers.
    """
    num_layers = args.int_field("num_layers")
    experts = args.int_field("num_experts") if args.get("num_experts") is not None else 0
    shapes = {k: meta.tensors[k].size for k in model_keys}
    bad = [
        k for k, s in shapes.items()
        if k.startswith(STACKED) and s[:1] != (num_layers,)
        or ".experts.experts." in k and experts and s[1:2] != (experts,)
    ]  # fmt: skip
    if bad:
        raise CheckpointFormatError(
            f"{url}: '{bad[0]}' is {list(shapes[bad[0]])}, expected the args' {num_layers} "
            f"layers stacked first (then {experts} experts for an expert's); the args are not "
            "this model's, so it cannot be unstacked. "
            "Convert the save as it was written"
        )
    return kept_pieces(shapes, num_layers, experts)


def _facts(
    url: str,
    args: MegatronArgs,
    shape: LlamaShape | None,
    meta: DcpMetadata,
    dcp: InspectFacts | None,
) -> InspectFacts:
    optimizer = [k for k in meta.tensors if _OPTIMIZER.match(k)]
    fields: dict[str, object] = {
        "iteration": args.iteration,
        "architecture": None if shape is None else hf_config(args, shape, dtype="float32"),
        "tensor_model_parallel_size": args.get("tensor_model_parallel_size"),
        "optimizer_buffers": optimizer,
        "non_tensor_items": list(meta.byte_entries),
    }
    if dcp is not None:
        fields["dcp"] = dcp.fields
    return InspectFacts(
        fields=fields,
        about=[
            f"Checkpoint  {url}  ({FORMAT_NAME}, iteration {args.iteration}, "
            + (
                "`--keep-names`: Megatron's names)"
                if shape is None
                else f"{_family(shape)}: {shape.num_layers} layers, hidden {shape.hidden_size}"
                + (f", {shape.num_experts} experts)" if shape.num_experts else ")")
            )
        ],
        read_labels=ReadLabels(
            main="model chunks",
            other="other chunks",
            metadata="metadata and args",
            never="optimizer buffers and non-tensor items are never read",
        ),  # fmt: skip
    )
