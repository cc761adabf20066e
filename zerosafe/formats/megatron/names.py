"""Megatron's stacked tensors as Hugging Face Llama tensors: pure integer math on element runs.

megatron-core's `torch_dist` save (megatron/core/transformer/transformer_block.py,
`sharded_state_dict`, 0.19.2) stores each per-layer parameter once, stacked: a leading layer
dimension (`decoder.layers.self_attention.linear_qkv.weight` of shape `[num_layers, ...]`).
A Hugging Face tensor is then a set of runs of that stacked tensor's row-major elements:
- a layer's slice: one run (`num_layers` unstacks);
- `linear_qkv` is interleaved per query group (megatron/core/transformer/attention.py,
  `get_query_key_value_tensors`): for each of the `G` groups, its `n/G` query heads, then one
  key head, then one value head, `kv_channels` rows each; `q_proj` is `G` runs, `k_proj` and
  `v_proj` `G` runs each;
- `linear_qkv.bias` (Qwen2) is interleaved the same way, one element per row;
- `linear_fc1` with SwiGLU is `[gate; up]` (the first `ffn_hidden_size` rows, then the rest);
- SequentialMLP experts are stacked after the layers, `[num_layers, num_experts, ...]`, each
  expert's `linear_fc1` again `[gate; up]` (Mixtral's `w1`, `w3`), its `linear_fc2` Mixtral's
  `w2`; the router is `[num_layers, num_experts, hidden]`;
- the embedding and output layer keep their first `vocab_size` rows (Megatron-LM pads the
  vocabulary, `_vocab_size_with_padding` in megatron/training/tokenizer).
`compose` turns those runs and the stacked tensor's fragments (`zerosafe.formats.base`) into
the Hugging Face tensor's fragments: every split is a slice of the stored bytes.

Nothing here touches files (tests/formats/megatron/test_names.py).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from zerosafe.formats.base import Fragment

__all__ = ["STACKED", "HfPiece", "LlamaShape", "compose", "kept_pieces", "llama_pieces"]

_EXPERTS = ".experts.experts."
"""Where megatron-core's SequentialMLP keeps its experts stacked (`local_experts.J` live)."""
STACKED = "decoder.layers."
"""The prefix of megatron-core's per-layer tensors, stacked along a first layer dimension."""

Run = tuple[int, int, int]
"""`(src_offset, numel, dst_offset)`: elements of the stacked Megatron tensor to elements of
the output tensor."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaShape:
    """The sizes the mapping needs (from the args saved with the checkpoint)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    """The true vocabulary (the rows kept)."""
    padded_vocab_size: int
    """The rows stored (Megatron-LM's padding)."""
    qkv_bias: bool = False
    """`linear_qkv` has a bias (Qwen2), interleaved per query group like its weight."""
    qk_norm: bool = False
    """Query and key norms of `kv_channels` each (Qwen3: `q_norm`, `k_norm`)."""
    num_experts: int = 0
    """Experts of every layer's MLP (Mixtral); 0: a dense MLP."""
    moe_ffn_hidden_size: int = 0
    """Each expert's FFN size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HfPiece:
    """One Hugging Face tensor: which stacked Megatron tensor it comes from, and how."""

    name: str
    source: str
    """The Megatron key (stacked) its elements come from."""
    shape: tuple[int, ...]
    runs: tuple[Run, ...]


def _rows(layer: int, per_layer: int, row: int, count: int, width: int, dst: int) -> Run:
    return (layer * per_layer + row * width, count * width, dst * width)


def llama_pieces(shape: LlamaShape, keys: dict[str, str]) -> list[HfPiece]:
    """Every Hugging Face Llama tensor, in `LlamaForCausalLM.state_dict()` order.

    Args:
        shape: The model's sizes.
        keys: Megatron key of each role: `embedding`, `input_norm`, `qkv`, `proj`, `mlp_norm`,
            `fc1`, `fc2`, `final_norm`, (untied) `output`, and with `shape.qkv_bias`
            `qkv_bias`, with `shape.qk_norm` `q_norm` and `k_norm`, with
            `shape.num_experts` `router`, `experts_fc1` and `experts_fc2` (not `fc1`, `fc2`).
    """
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    n = shape.num_attention_heads
    fc1_layer = 2 * f * h
    out = [_vocab("model.embed_tokens.weight", keys["embedding"], shape)]
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        attn = [
            _qkv(p + "self_attn." + proj, keys, shape, i, bias=bias)
            for proj in ("q_proj", "k_proj", "v_proj")
            for bias in ((False, True) if shape.qkv_bias else (False,))
        ]  # `Qwen2Attention`'s order: each projection's weight, then its bias
        attn.append(_layer(p + "self_attn.o_proj.weight", keys["proj"], i, (h, n * d)))
        if shape.qk_norm:
            attn += [
                _layer(p + "self_attn.q_norm.weight", keys["q_norm"], i, (d,)),
                _layer(p + "self_attn.k_norm.weight", keys["k_norm"], i, (d,)),
            ]
        out += attn + (_experts(p, keys, shape, i) if shape.num_experts else [
            HfPiece(
                name=p + "mlp.gate_proj.weight", source=keys["fc1"], shape=(f, h),
                runs=(_rows(i, fc1_layer, 0, f, h, 0),),
            ),
            HfPiece(
                name=p + "mlp.up_proj.weight", source=keys["fc1"], shape=(f, h),
                runs=(_rows(i, fc1_layer, f, f, h, 0),),
            ),
            _layer(p + "mlp.down_proj.weight", keys["fc2"], i, (h, f)),
        ]) + [
            _layer(p + "input_layernorm.weight", keys["input_norm"], i, (h,)),
            _layer(p + "post_attention_layernorm.weight", keys["mlp_norm"], i, (h,)),
        ]  # fmt: skip
    out.append(
        HfPiece(name="model.norm.weight", source=keys["final_norm"], shape=(h,), runs=((0, h, 0),))
    )
    if "output" in keys:
        out.append(_vocab("lm_head.weight", keys["output"], shape))
    return out


def _qkv(
    module: str, keys: dict[str, str], shape: LlamaShape, layer: int, *, bias: bool
) -> HfPiece:
    """`module`'s (`...q_proj`, `k_proj`, `v_proj`) rows of `linear_qkv`'s weight or bias: one
    run per query group."""
    d, n, g = shape.kv_channels, shape.num_attention_heads, shape.num_query_groups
    width = 1 if bias else shape.hidden_size
    q_per_group = n // g
    block = (q_per_group + 2) * d  # rows of one query group in linear_qkv
    first, count = {"q_proj": (0, q_per_group * d), "k_proj": (q_per_group * d, d)}.get(
        module.rsplit(".", 1)[1], ((q_per_group + 1) * d, d)
    )
    runs = tuple(_rows(layer, g * block * width, k * block + first, count, width, k * count)
                 for k in range(g))  # fmt: skip
    return HfPiece(
        name=module + (".bias" if bias else ".weight"),
        source=keys["qkv_bias" if bias else "qkv"],
        shape=(g * count,) if bias else (g * count, width),
        runs=runs,
    )


def kept_pieces(
    shapes: dict[str, tuple[int, ...]], num_layers: int, num_experts: int = 0
) -> list[HfPiece]:
    """`--keep-names`: every tensor in Megatron's names, a stacked one (`decoder.layers.X`, of
    shape `[num_layers, ...]`) as `decoder.layers.N.X` per layer, and the experts megatron-core
    stacks after the layers (`mlp.experts.experts.X`, `[num_layers, num_experts, ...]`) as the
    SequentialMLP's own `mlp.experts.local_experts.J.X`; in the live model's order: the
    tensors before the layers (`embedding.*`), layer by layer, then the rest.

    Args:
        shapes: Each model tensor's stored (global) shape, in the save's order.
        num_layers: The stacked tensors' first dimension.
        num_experts: The experts' second dimension (0: no experts).
    """
    before = [k for k in shapes if k.startswith("embedding.")]
    stacked = [k for k in shapes if k.startswith(STACKED)]
    after = [k for k in shapes if k not in before and k not in stacked]
    out = [HfPiece(name=k, source=k, shape=shapes[k], runs=((0, math.prod(shapes[k]), 0),))
           for k in before]  # fmt: skip
    for i in range(num_layers):
        for key in stacked:
            name = f"{STACKED}{i}.{key[len(STACKED) :]}"
            head, experts, leaf = name.partition(_EXPERTS)
            if not experts or not num_experts:
                out.append(_layer(name, key, i, shapes[key][1:]))
                continue
            each = shapes[key][2:]
            out += [
                _layer(f"{head}.experts.local_experts.{j}.{leaf}", key, i * num_experts + j, each)
                for j in range(num_experts)
            ]
    out += [HfPiece(name=k, source=k, shape=shapes[k], runs=((0, math.prod(shapes[k]), 0),))
            for k in after]  # fmt: skip
    return out


def _experts(prefix: str, keys: dict[str, str], shape: LlamaShape, layer: int) -> list[HfPiece]:
    """Mixtral's MoE block of `layer`: the router as `block_sparse_moe.gate`, each expert's
    `linear_fc1` (`[gate; up]`) as `w1` and `w3`, its `linear_fc2` as `w2`. megatron-core
    stacks the experts after the layers: `[num_layers, num_experts, ...]`."""
    h, f, e = shape.hidden_size, shape.moe_ffn_hidden_size, shape.num_experts
    moe = prefix + "block_sparse_moe."
    out = []
    for j in range(e):
        fc1 = layer * e * 2 * f * h + j * 2 * f * h  # expert j's first element of linear_fc1
        out += [
            HfPiece(name=f"{moe}experts.{j}.w1.weight", source=keys["experts_fc1"], shape=(f, h),
                    runs=((fc1, f * h, 0),)),
            HfPiece(name=f"{moe}experts.{j}.w2.weight", source=keys["experts_fc2"], shape=(h, f),
                    runs=(((layer * e + j) * h * f, h * f, 0),)),
            HfPiece(name=f"{moe}experts.{j}.w3.weight", source=keys["experts_fc1"], shape=(f, h),
                    runs=((fc1 + f * h, f * h, 0),)),
        ]  # fmt: skip
    return [*out, _layer(moe + "gate.weight", keys["router"], layer, (e, h))]


def _layer(name: str, source: str, layer: int, shape: tuple[int, ...]) -> HfPiece:
    numel = math.prod(shape)
    return HfPiece(name=name, source=source, shape=shape, runs=((layer * numel, numel, 0),))


def _vocab(name: str, source: str, shape: LlamaShape) -> HfPiece:
    numel = shape.vocab_size * shape.hidden_size
    return HfPiece(
        name=name, source=source, shape=(shape.vocab_size, shape.hidden_size), runs=((0, numel, 0),)
    )


def compose(runs: Sequence[Run], fragments: Sequence[Fragment]) -> tuple[Fragment, ...]:
    """The fragments of an output tensor made of `runs` of a stored tensor with `fragments`.

    Args:
        runs: `(src_offset, numel, dst_offset)` of the stored tensor's elements.
        fragments: The stored tensor's fragments, tiling it (any order).

    Returns:
        The output's fragments, by destination offset: each a contiguous part of a slot.
    """
    ordered = sorted(fragments, key=lambda fr: fr[3])
    starts = [fr[3] for fr in ordered]
    out: list[Fragment] = []
    for src, numel, dst in runs:
        end = src + numel
        i = max(bisect.bisect_right(starts, src) - 1, 0)
        while i < len(ordered) and ordered[i][3] < end:
            slot, slot_offset, count, at = ordered[i]
            lo, hi = max(src, at), min(end, at + count)
            if lo < hi:
                out.append((slot, slot_offset + lo - at, hi - lo, dst + lo - src))
            i += 1
    out.sort(key=lambda fr: fr[3])
    return tuple(out)
