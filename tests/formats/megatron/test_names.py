"""The Megatron-to-Hugging-Face runs and their composition with fragments, on plain integers."""

from __future__ import annotations

from zerosafe.formats.megatron.names import LlamaShape, compose, kept_pieces, llama_pieces

SHAPE = LlamaShape(
    num_layers=2, hidden_size=4, ffn_hidden_size=3, num_attention_heads=4, num_query_groups=2,
    kv_channels=1, vocab_size=5, padded_vocab_size=8,
)  # fmt: skip
KEYS = {r: r for r in ("embedding", "input_norm", "qkv", "proj", "mlp_norm", "fc1", "fc2",
                       "final_norm", "output")}  # fmt: skip


def test_compose_cuts_fragments_at_run_edges() -> None:
    # a stored tensor of 10 elements in two slots: [0, 6) in slot 0, [6, 10) in slot 1 at 2
    fragments = [(1, 2, 4, 6), (0, 0, 6, 0)]
    assert compose([(4, 4, 0)], fragments) == ((0, 4, 2, 0), (1, 2, 2, 2))
    assert compose([(7, 2, 0), (0, 1, 2)], fragments) == ((1, 3, 2, 0), (0, 0, 1, 2))
    assert compose([(6, 4, 3)], fragments) == ((1, 2, 4, 3),)


def test_qkv_is_split_per_query_group() -> None:
    pieces = {p.name: p for p in llama_pieces(SHAPE, KEYS)}
    # per group: 2 query rows, 1 key row, 1 value row (of 4 elements); 16 rows per layer
    layer1 = 1 * 8 * 4
    assert pieces["model.layers.1.self_attn.q_proj.weight"].runs == (
        (layer1 + 0, 8, 0), (layer1 + 16, 8, 8),
    )  # fmt: skip
    assert pieces["model.layers.1.self_attn.k_proj.weight"].runs == (
        (layer1 + 8, 4, 0), (layer1 + 24, 4, 4),
    )  # fmt: skip
    assert pieces["model.layers.1.self_attn.v_proj.weight"].runs == (
        (layer1 + 12, 4, 0), (layer1 + 28, 4, 4),
    )  # fmt: skip
    assert pieces["model.layers.0.mlp.up_proj.weight"].runs == ((12, 12, 0),)
    assert pieces["model.embed_tokens.weight"].shape == (5, 4)
    assert pieces["lm_head.weight"].runs == ((0, 20, 0),)
    assert list(pieces)[-2:] == ["model.norm.weight", "lm_head.weight"]


def test_experts_are_cut_from_the_layer_then_expert_stack() -> None:
    moe = LlamaShape(
        num_layers=2, hidden_size=4, ffn_hidden_size=3, num_attention_heads=4,
        num_query_groups=2, kv_channels=1, vocab_size=5, padded_vocab_size=8,
        num_experts=3, moe_ffn_hidden_size=2,
    )  # fmt: skip
    keys = {**KEYS, "router": "router", "experts_fc1": "fc1s", "experts_fc2": "fc2s"}
    pieces = {p.name: p for p in llama_pieces(moe, keys)}
    e = "model.layers.1.block_sparse_moe."
    # fc1 of layer 1, expert 2: [gate (2 rows of 4); up] at (1 * 3 + 2) * 16 elements
    assert pieces[e + "experts.2.w1.weight"].runs == ((80, 8, 0),)
    assert pieces[e + "experts.2.w3.weight"].runs == ((88, 8, 0),)
    assert pieces[e + "experts.2.w2.weight"].runs == ((40, 8, 0),)
    assert pieces[e + "gate.weight"].runs == ((12, 12, 0),)
    assert not any("mlp.gate_proj" in n for n in pieces)


def test_keep_names_unstacks_layers_and_experts() -> None:
    shapes = {
        "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 3, 4, 2),
        "embedding.word_embeddings.weight": (8, 4),
        "decoder.layers.mlp.router.weight": (2, 3, 4),
        "output_layer.weight": (8, 4),
    }
    pieces = kept_pieces(shapes, num_layers=2, num_experts=3)
    names = [p.name for p in pieces]
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "output_layer.weight"
    fc2 = {p.name: p for p in pieces}[
        "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.weight"
    ]
    assert fc2.shape == (4, 2) and fc2.runs == ((5 * 8, 8, 0),)
    assert "decoder.layers.1.mlp.router.weight" in names and len(names) == 2 + 2 * (3 + 1)
