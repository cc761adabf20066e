"""Model shapes: Llama-like param shapes of about a given size, and the default module buffers."""

from __future__ import annotations

import re

# One object each for the names `transformer_shapes` gives and the default tie (`Spec`) refers to:
# the pickler memoizes strings by identity, so a tied alias's name written a second time is a memo
# reference exactly when it is the same object (as when these were constants of one module).
EMBED_WEIGHT = "embed.weight"
LM_HEAD_WEIGHT = "lm_head.weight"


def parse_count(text: str | int | float) -> int:
    """'500M' -> 500_000_000, '7B' -> 7_000_000_000, '1.5e9', 1000 -> 1000."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMbBgGtT]?)\s*", text)
    if not m:
        raise ValueError(f"not a count: {text!r}")
    mult = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def transformer_shapes(
    num_params: int | str | None = None,
    *,
    vocab: int | None = None,
    width: int | None = None,
    layers: int | None = None,
    ffn: int | None = None,
    kv_width: int | None = None,
    qkv_bias: bool = True,
    out_bias: bool = True,
    tied: bool = True,
) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like param shapes, in module order, with about `num_params` parameters.

    An embedding `embed.weight` [vocab, width]; per layer an attention norm, q/k/v/o projections
    (q/k/v with biases when `qkv_bias`; k/v narrower: grouped-query attention), an MLP norm and a
    gated MLP (gate/up [ffn, width], down [width, ffn]); a final `norm.weight`; and
    `lm_head.weight` [vocab, width] unless `tied` (then forge it with `tied=True`, which records
    `lm_head.weight` as an alias of `embed.weight`), then `lm_head.bias` [vocab] when `out_bias`.
    Sizes are deliberately odd: vocab and ffn are odd, and `lm_head.bias` has an odd element
    count, so ZeRO padding shows up at any world size. Any size given explicitly is kept."""
    n_target = parse_count(num_params) if num_params is not None else None
    if width is None:
        if n_target is None:
            raise ValueError("give num_params or width")
        # ~12 * width**2 per layer, layers ~ width / 128: total ~ 0.094 * width**3
        width = max(64, 64 * round((n_target / 0.09375) ** (1 / 3) / 64))
    if vocab is None:
        if n_target is None or n_target >= 100_000_000:
            vocab = 32003
        else:  # keep the embedding near a tenth of the model
            vocab = max(67, int(n_target * 0.1 / width)) | 1
    if ffn is None:
        ffn = (8 * width // 3) | 1
    if kv_width is None:
        kv_width = width // 4 if width >= 256 else width // 2
    per_layer = (
        2 * width * width
        + 2 * kv_width * width
        + 3 * width * ffn
        + 2 * width
        + (width + 2 * kv_width if qkv_bias else 0)
    )
    fixed = vocab * width * (1 if tied else 2) + width + (vocab if out_bias else 0)
    if layers is None:
        layers = 1 if n_target is None else max(1, round((n_target - fixed) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [(EMBED_WEIGHT, (vocab, width))]
    for i in range(layers):
        p = f"layers.{i}."
        shapes.append((p + "attn_norm.weight", (width,)))
        for proj, out in (("q_proj", width), ("k_proj", kv_width), ("v_proj", kv_width)):
            shapes.append((f"{p}attn.{proj}.weight", (out, width)))
            if qkv_bias:
                shapes.append((f"{p}attn.{proj}.bias", (out,)))
        shapes.append((p + "attn.o_proj.weight", (width, width)))
        shapes.append((p + "mlp_norm.weight", (width,)))
        shapes.append((p + "mlp.gate_proj.weight", (ffn, width)))
        shapes.append((p + "mlp.up_proj.weight", (ffn, width)))
        shapes.append((p + "mlp.down_proj.weight", (width, ffn)))
    shapes.append(("norm.weight", (width,)))
    if not tied:
        shapes.append((LM_HEAD_WEIGHT, (vocab, width)))
    if out_bias:
        shapes.append(("lm_head.bias", (vocab,)))
    return shapes


DEFAULT_BUFFERS: tuple[tuple[str, tuple[int, ...], str], ...] = (
    ("rotary.inv_freq", (37,), "float32"),
    ("position_ids", (1, 129), "int64"),
)
