"""The training arguments a Megatron-LM `torch_dist` save keeps, read as inert data.

Megatron-LM's `save_checkpoint` (megatron/training/checkpointing.py, `generate_state_dict`)
saves `args` (the `argparse.Namespace` of megatron/training/arguments.py), `iteration` and
`checkpoint_version` beside the model; `dist_checkpointing.save` (megatron-core 0.19.2) puts
these non-tensor values into one DCP byte item, `common_state/shard_0_1`: a `torch.save`
pickle of `[{"args": Namespace(...), "iteration": N, ...}]` inside a `.distcp` file. It is read
with the restricted unpickler (`zerosafe.formats.torch_pickle`: the `Namespace` is an inert
record), never executed. The architecture fields make the Hugging Face names (`names.py`) and
`config.json` (`hf_config`: Llama, or Qwen2 with `--add-qkv-bias`, Qwen3 with
`--qk-layernorm`); a field this mapping does not cover is refused, naming it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from zerosafe.errors import CheckpointFormatError, UnsupportedCheckpointError
from zerosafe.formats.dcp.metadata import DcpMetadata
from zerosafe.formats.dcp.stored import ByteRangeSource
from zerosafe.formats.megatron.names import LlamaShape
from zerosafe.formats.torch_pickle import InertObject
from zerosafe.formats.torch_zip import TorchZipFile
from zerosafe.io.storage import Storage, join_url

__all__ = [
    "COMMON_STATE", "MegatronArgs", "check_llama", "hf_config", "llama_shape", "read_args",
]  # fmt: skip

COMMON_STATE = "common_state"
"""The byte item (`common_state/shard_0_1`) holding `args`, `iteration` and the rest."""
_COMMON_MAX_BYTES = 64 * 2**20
"""The common state is a few kilobytes (the args, the scheduler's numbers); read whole."""

_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("add_bias_linear", False, "linear biases"),
    ("apply_layernorm_1p", False, "zero-centred norms (`--apply-layernorm-1p`)"),
    ("rotary_interleaved", False, "interleaved RoPE"),
    ("use_rope_scaling", False, "RoPE scaling (Llama 3.1-style)"),
    ("multi_latent_attention", False, "multi-latent attention (DeepSeek-style)"),
    ("num_layers_per_virtual_pipeline_stage", None, "virtual pipeline stages"),
    ("pipeline_model_parallel_size", 1, "pipeline parallel"),
)
"""`(field, the value the mapping covers, what another value means)`: what `check_llama`
refuses. A field the save does not have counts as the covered value."""

_MOE_UNSUPPORTED: tuple[tuple[str, object, str], ...] = (
    ("moe_shared_expert_intermediate_size", None, "shared experts (Qwen-MoE, DeepSeek-style)"),
    ("moe_router_pre_softmax", False, "a softmax before the top-k (not Mixtral's routing)"),
    ("moe_router_score_function", "softmax", "router scores other than Mixtral's softmax"),
    ("moe_router_enable_expert_bias", False, "router expert biases (DeepSeek-V3-style)"),
    ("moe_router_topk_scaling_factor", None, "scaled top-k weights (DeepSeek-style)"),
    ("moe_router_num_groups", None, "group-limited routing (DeepSeek-style)"),
    ("moe_layer_freq", 1, "dense layers between the MoE ones"),
    ("moe_grouped_gemm", False, "grouped-GEMM experts (a layout not yet checked)"),
    ("moe_use_legacy_grouped_gemm", False, "legacy grouped-GEMM experts"),
    ("add_qkv_bias", False, "QKV biases with experts (Qwen2-MoE-style)"),
    ("qk_layernorm", False, "query/key norms with experts (Qwen3-MoE-style)"),
)
"""With `num_experts`: what the Mixtral mapping (every layer MoE, softmax top-k routing
renormalized over the chosen experts, no shared experts) does not cover."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronArgs:
    """The args of a save, as plain JSON-able values (`fields`), and its iteration."""

    url: str
    """The `.distcp` file they were read from, for messages."""
    fields: dict[str, object]
    iteration: int | None

    def get(self, name: str, default: object = None) -> object:
        return self.fields.get(name, default)

    def int_field(self, name: str) -> int:
        value = self.fields.get(name)
        if type(value) is not int:
            raise CheckpointFormatError(
                f"{self.url}: the saved args have {name}={value!r}, expected a whole number; "
                "the save's common state is not Megatron-LM's"
            )
        return value


def _plain(value: Any) -> object:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)  # dtypes, enums: their text, never their object


def read_args(url: str, meta: DcpMetadata, storage: Storage) -> MegatronArgs:
    """The args saved in the `common_state` byte item of the save at `url`.

    Raises:
        CheckpointFormatError: If the save has no `common_state`, or it holds no args.
        UnsafePickleError: If its pickle names a global outside the allowlist.
    """
    key = next((k for k in meta.byte_entries if k.split("/", 1)[0] == COMMON_STATE), None)
    info = meta.storage.get((key, None)) if key is not None else None
    if key is None or info is None:
        raise CheckpointFormatError(
            f"{url}: no '{COMMON_STATE}' item in the metadata (non-tensor items: "
            f"{list(meta.byte_entries)[:5]}); Megatron-LM saves its args there, which give the "
            "model's architecture. Was this saved by another program through megatron-core?"
        )
    file_url = join_url(url, info.relative_path)
    if info.length > _COMMON_MAX_BYTES:
        raise CheckpointFormatError(
            f"{file_url}: '{key}' is {info.length} bytes, expected the few kilobytes of "
            "Megatron-LM's args and counters; the metadata is not Megatron-LM's"
        )
    source = storage.open_source(file_url)
    try:
        view = ByteRangeSource(source, info.offset, info.length, f"{file_url} ('{key}')")
        common = TorchZipFile(view).load()
    finally:
        source.close()
    if isinstance(common, list) and len(common) == 1:
        common = common[0]  # a ShardedObject's value, as megatron-core 0.19.2 stores it
    args = common.get("args") if isinstance(common, Mapping) else None
    if not isinstance(args, InertObject) or args.qualname != "argparse.Namespace":
        raise CheckpointFormatError(
            f"{file_url}: '{key}' holds no `args` Namespace (found {type(args).__name__}); "
            "Megatron-LM's save_checkpoint stores its arguments there, which give the model's "
            "architecture"
        )
    state = args.state if isinstance(args.state, dict) else {}
    iteration = common.get("iteration") if isinstance(common, Mapping) else None
    return MegatronArgs(
        url=file_url,
        fields={str(k): _plain(v) for k, v in state.items()},
        iteration=iteration if type(iteration) is int else None,
    )


def check_llama(args: MegatronArgs) -> None:
    """Refuse what the Llama mapping does not cover, naming the field and its value.

    Raises:
        UnsupportedCheckpointError: One line per refusal (the first found).
    """
    for name, covered, what in _UNSUPPORTED:
        value = args.get(name)
        if value is not None and value != covered:  # absent or None: Megatron-LM's default
            _refuse(args, f"{name}={value!r}", what)
    wanted = (
        ("normalization", "RMSNorm"), ("swiglu", True), ("position_embedding_type", "rope"),
    )  # fmt: skip
    for name, want in wanted:
        if args.get(name) != want:
            _refuse(
                args, f"{name}={args.get(name)!r}", f"not the Llama family (which has {want!r})"
            )
    if args.get("num_experts") is not None:
        for name, covered, what in _MOE_UNSUPPORTED:
            value = args.get(name)
            if value is not None and value != covered:
                _refuse(args, f"num_experts={args.get('num_experts')!r}, {name}={value!r}", what)
    percent = args.get("rotary_percent", 1.0)
    if percent != 1.0:
        _refuse(args, f"rotary_percent={percent!r}", "partial rotary embeddings")
    if args.get("add_qkv_bias") and args.get("qk_layernorm"):
        _refuse(
            args, "add_qkv_bias=True and qk_layernorm=True",
            "QKV biases with query/key norms (neither Qwen2 nor Qwen3)",
        )  # fmt: skip


def _refuse(args: MegatronArgs, found: str, what: str) -> None:
    raise UnsupportedCheckpointError(
        f"{args.url}: the saved args say {found}: {what}, which zerosafe does not map to Hugging "
        "Face names yet (it maps Llama-family models: RMSNorm, SwiGLU, RoPE, no linear biases "
        "but Qwen2's QKV ones, Qwen3's query/key norms, Mixtral-style experts, no pipeline "
        "parallel); convert "
        "with Megatron-Bridge or Megatron-LM's own converter, or pass `--keep-names` for "
        "Megatron's own names"
    )


def llama_shape(args: MegatronArgs) -> LlamaShape:
    """The sizes of the model the args describe (`num_query_groups` defaults to the heads,
    `kv_channels` to `hidden_size / num_attention_heads`, as Megatron-LM's do)."""
    heads = args.int_field("num_attention_heads")
    hidden = args.int_field("hidden_size")
    groups = args.get("num_query_groups") if args.get("group_query_attention") else None
    kv = args.get("kv_channels")
    padded = args.int_field("padded_vocab_size")
    vocab = args.get("vocab_size")
    return LlamaShape(
        num_layers=args.int_field("num_layers"),
        hidden_size=hidden,
        ffn_hidden_size=args.int_field("ffn_hidden_size"),
        num_attention_heads=heads,
        num_query_groups=groups if type(groups) is int else heads,
        kv_channels=kv if type(kv) is int else hidden // heads,
        vocab_size=vocab if type(vocab) is int and 0 < vocab <= padded else padded,
        padded_vocab_size=padded,
        qkv_bias=bool(args.get("add_qkv_bias")),
        qk_norm=bool(args.get("qk_layernorm")),
        num_experts=args.int_field("num_experts") if args.get("num_experts") is not None else 0,
        moe_ffn_hidden_size=_moe_ffn(args),
    )


def _moe_ffn(args: MegatronArgs) -> int:
    """The experts' FFN size (`--moe-ffn-hidden-size`, which defaults to `ffn_hidden_size`)."""
    if args.get("num_experts") is None:
        return 0
    if args.get("moe_ffn_hidden_size") is None:
        return args.int_field("ffn_hidden_size")
    return args.int_field("moe_ffn_hidden_size")


def _float(args: MegatronArgs, name: str, default: float) -> float:
    value = args.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CheckpointFormatError(
            f"{args.url}: the saved args have {name}={value!r}, expected a number; the save's "
            "common state is not Megatron-LM's"
        )
    return float(value)


def hf_config(args: MegatronArgs, shape: LlamaShape, *, dtype: str) -> dict[str, object]:
    """The transformers config of the model, every architecture field from the args: a
    `LlamaConfig`, a `Qwen2Config` (QKV biases) or a `Qwen3Config` (query/key norms)."""
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.ffn_hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_query_groups,
        "head_dim": shape.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": args.get("max_position_embeddings"),
        "rms_norm_eps": args.get("norm_epsilon"),
        "rope_theta": _float(args, "rotary_base", 10000.0),
        "tie_word_embeddings": not args.get("untie_embeddings_and_output_weights", False),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": dtype,
    }
    if shape.qkv_bias:  # Qwen2: q/k/v biases always, none on o_proj or the MLP
        del config["attention_bias"], config["mlp_bias"]
        config |= {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
        config["use_sliding_window"] = False
    elif shape.qk_norm:  # Qwen3: `attention_bias` covers q/k/v/o; no `mlp_bias`
        del config["mlp_bias"]
        config |= {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        config["use_sliding_window"] = False
    elif shape.num_experts:  # Mixtral: no biases at all, the experts' FFN size
        del config["attention_bias"], config["mlp_bias"]
        config |= {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": shape.moe_ffn_hidden_size,
        }  # fmt: skip
        config |= {
            "num_local_experts": shape.num_experts,
            "num_experts_per_tok": args.int_field("moe_router_topk"),
            "sliding_window": None,
        }
    return config
