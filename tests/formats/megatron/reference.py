"""The reference: the live Megatron weights mapped to Hugging Face Llama (Qwen2, Qwen3) names
with plain torch, independently of zerosafe's reader (which never builds a tensor)."""

from __future__ import annotations

import torch


def hf_reference(live: dict[str, torch.Tensor], args: dict[str, object]) -> dict[str, torch.Tensor]:
    """`live` (Megatron's per-layer names, full size) as `LlamaForCausalLM` weights (or
    Qwen2's, with the QKV biases, or Qwen3's, with `q_norm`/`k_norm`, or Mixtral's, with its
    releases' per-expert `w1`/`w2`/`w3`), in that model's `state_dict()` order (Mixtral: its
    releases' per-layer order)."""
    heads, groups = int(args["num_attention_heads"]), int(args["num_query_groups"])  # type: ignore[call-overload]
    d, vocab = int(args["kv_channels"]), int(args["vocab_size"])  # type: ignore[call-overload]
    out = {"model.embed_tokens.weight": live["embedding.word_embeddings.weight"][:vocab]}
    for i in range(int(args["num_layers"])):  # type: ignore[call-overload]
        m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = live[m + "self_attention.linear_qkv.weight"]
        per_group = qkv.view(groups, (heads // groups + 2) * d, -1)
        q, k, v = per_group.split([heads // groups * d, d, d], dim=1)
        bias = live.get(m + "self_attention.linear_qkv.bias")
        if bias is None:
            out |= {
                p + "self_attn.q_proj.weight": q.reshape(heads * d, -1),
                p + "self_attn.k_proj.weight": k.reshape(groups * d, -1),
                p + "self_attn.v_proj.weight": v.reshape(groups * d, -1),
            }
        else:
            qb, kb, vb = bias.view(groups, -1).split([heads // groups * d, d, d], dim=1)
            out |= {
                p + "self_attn.q_proj.weight": q.reshape(heads * d, -1),
                p + "self_attn.q_proj.bias": qb.reshape(-1),
                p + "self_attn.k_proj.weight": k.reshape(groups * d, -1),
                p + "self_attn.k_proj.bias": kb.reshape(-1),
                p + "self_attn.v_proj.weight": v.reshape(groups * d, -1),
                p + "self_attn.v_proj.bias": vb.reshape(-1),
            }
        out[p + "self_attn.o_proj.weight"] = live[m + "self_attention.linear_proj.weight"]
        if m + "self_attention.q_layernorm.weight" in live:
            out[p + "self_attn.q_norm.weight"] = live[m + "self_attention.q_layernorm.weight"]
            out[p + "self_attn.k_norm.weight"] = live[m + "self_attention.k_layernorm.weight"]
        if m + "mlp.router.weight" in live:  # Mixtral's names, as its releases store them
            moe = p + "block_sparse_moe."
            for j in range(int(args["num_experts"])):  # type: ignore[call-overload]
                expert = f"{m}mlp.experts.local_experts.{j}."
                w1, w3 = live[expert + "linear_fc1.weight"].chunk(2, dim=0)
                out[f"{moe}experts.{j}.w1.weight"] = w1
                out[f"{moe}experts.{j}.w2.weight"] = live[expert + "linear_fc2.weight"]
                out[f"{moe}experts.{j}.w3.weight"] = w3
            out[moe + "gate.weight"] = live[m + "mlp.router.weight"]
        else:
            gate, up = live[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
            out |= {
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": live[m + "mlp.linear_fc2.weight"],
            }
        out |= {
            p + "input_layernorm.weight": live[m + "input_layernorm.weight"],
            p + "post_attention_layernorm.weight": live[m + "pre_mlp_layernorm.weight"],
        }
    out["model.norm.weight"] = live["decoder.final_layernorm.weight"]
    if "output_layer.weight" in live:  # tied: no head of its own, the config ties it
        out["lm_head.weight"] = live["output_layer.weight"][:vocab]
    return {k: v.contiguous() for k, v in out.items()}
