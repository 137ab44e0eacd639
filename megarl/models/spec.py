"""Architecture specs: which HF decoder families megarl supports and their dimensions.

A registry (`megarl.registry.MODEL_SPECS`) keyed by the HF config's explicit
`model_type` (never a substring of a model name) says how each family differs from
plain Llama: Qwen2 always has a QKV
bias, Qwen3 RMS-normalises q and k per head, Qwen3-MoE is Qwen3 with a top-k routed
mixture of experts in place of every MLP. `arch_from_hf` turns an HF config dict
into an `Arch` (the dimensions every layout map and the engine builder use) and
`transformer_kwargs` into the keyword arguments a Megatron GPT model needs. Pure:
no megatron import, so the resharding plan can reuse it anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import InputError
from megarl.registry import MODEL_SPECS


@dataclass(frozen=True)
class ModelSpec:
    """How one HF `model_type` maps onto Megatron's local GPT layer spec."""

    model_type: str
    # True: the family always has q/k/v biases (Qwen2); False: read `attention_bias`.
    always_qkv_bias: bool
    qk_layernorm: bool
    # Every decoder layer's MLP is a mixture of experts (HF keys num_experts, moe_intermediate_size, ...).
    moe: bool = False


for _spec in (
    ModelSpec("llama", always_qkv_bias=False, qk_layernorm=False),
    ModelSpec("qwen2", always_qkv_bias=True, qk_layernorm=False),
    ModelSpec("qwen3", always_qkv_bias=False, qk_layernorm=True),
    ModelSpec("qwen3_moe", always_qkv_bias=False, qk_layernorm=True, moe=True),
):
    MODEL_SPECS.add(_spec.model_type, _spec)

# Megatron's RotaryEmbedding hard-codes these Llama-3 scaling constants.
_LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class Arch:
    """Dimensions of one decoder-only model, in HF terms (unpadded vocab)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    qk_layernorm: bool
    rotary_base: float
    rope_scaling_factor: float | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    # Mixture of experts (0 experts: a dense MLP of ffn_hidden_size).
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    # True: the top-k routing weights are renormalised to sum to 1 (HF norm_topk_prob).
    moe_norm_topk_prob: bool = False

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def get_spec(hf_config: dict) -> ModelSpec:
    """The registered spec for `hf_config["model_type"]`; InputError for anything else."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_SPECS:
        raise InputError(
            f"model config: model_type={model_type!r} is not supported; known: {', '.join(MODEL_SPECS.names())}"
        )
    return MODEL_SPECS.get(model_type).target


def _rope(hf_config: dict) -> tuple[float, float | None]:
    """(rotary base, Llama-3 scaling factor or None) from either HF config generation."""
    params = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    base = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return base, None
    if rope_type == "llama3" and all(params.get(k, v) == v for k, v in _LLAMA3_ROPE_DEFAULTS.items()):
        return base, float(params["factor"])
    raise InputError(f"model config: rope scaling {params!r} is not supported (only default and standard llama3)")


def arch_from_hf(hf_config: dict) -> Arch:
    """Validate an HF config dict and extract the dimensions; InputError names each bad key."""
    spec = get_spec(hf_config)
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [f"model config: missing key {key!r}" for key in required if key not in hf_config]
    if missing:
        raise InputError(missing)
    heads = int(hf_config["num_attention_heads"])
    groups = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config["hidden_size"] // heads)
    problems = []
    if heads % groups:
        problems.append(f"model config: num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"model config: hidden_act={hf_config['hidden_act']!r} is not supported (only 'silu')")
    # Megatron's add_bias_linear would add biases to every linear; these families only
    # ever ship q/k/v biases, so an o_proj or MLP bias has no Megatron counterpart here.
    if hf_config.get("mlp_bias"):
        problems.append("model config: mlp_bias=True is not supported")
    if hf_config.get("attention_bias") and not spec.always_qkv_bias:
        problems.append(f"model config: attention_bias=True (o_proj bias) is not supported for {spec.model_type}")
    if hf_config.get("use_sliding_window"):
        problems.append("model config: use_sliding_window=True is not supported")
    moe = _moe_fields(hf_config) if spec.moe else {}
    if problems:
        raise InputError(problems)
    rotary_base, rope_scaling_factor = _rope(hf_config)
    return Arch(
        model_type=spec.model_type,
        num_layers=int(hf_config["num_hidden_layers"]),
        hidden_size=int(hf_config["hidden_size"]),
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=int(hf_config["vocab_size"]),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        qkv_bias=spec.always_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        rotary_base=rotary_base,
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        initializer_range=float(hf_config.get("initializer_range", 0.02)),
        **moe,
    )


def _moe_fields(hf_config: dict) -> dict:
    """The MoE fields of `Arch` from a Qwen3-MoE config; InputError names each bad key."""
    problems = []
    # transformers 5 writes `num_local_experts` for what the hub configs call `num_experts`.
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if num_experts is None:
        problems.append("model config: missing key 'num_experts'")
    problems += [
        f"model config: missing key {key!r}"
        for key in ("moe_intermediate_size", "num_experts_per_tok")
        if key not in hf_config
    ]
    if problems:
        raise InputError(problems)
    topk = int(hf_config["num_experts_per_tok"])
    if not 0 < topk <= int(num_experts):
        problems.append(f"model config: num_experts_per_tok={topk} must be in 1..num_experts={num_experts}")
    # Megatron's local spec puts experts in every layer; dense layers in between are not mapped.
    if int(hf_config.get("decoder_sparse_step", 1)) != 1:
        step = hf_config["decoder_sparse_step"]
        problems.append(f"model config: decoder_sparse_step={step} is not supported (only 1)")
    if hf_config.get("mlp_only_layers"):
        problems.append(f"model config: mlp_only_layers={hf_config['mlp_only_layers']} is not supported (only [])")
    if problems:
        raise InputError(problems)
    return {
        "num_experts": int(num_experts),
        "moe_ffn_hidden_size": int(hf_config["moe_intermediate_size"]),
        "moe_router_topk": topk,
        "moe_norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)),
    }


def transformer_kwargs(hf_config: dict) -> dict:
    """What a Megatron TransformerConfig + GPTModel need for this HF model (framework-neutral names).

    `activation` is a name ("silu", gated through `gated_linear_unit`); `rotary_base`,
    `rope_scaling_factor`, `max_position_embeddings`, `tie_word_embeddings` and
    `vocab_size` (unpadded) are GPTModel arguments, the rest TransformerConfig fields
    (the `moe_*` ones None / 0 / False for dense models).
    """
    arch = arch_from_hf(hf_config)
    return {
        "num_layers": arch.num_layers,
        "hidden_size": arch.hidden_size,
        "ffn_hidden_size": arch.ffn_hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_query_groups": arch.num_query_groups,
        "kv_channels": arch.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": arch.rms_norm_eps,
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
        "add_qkv_bias": arch.qkv_bias,
        "qk_layernorm": arch.qk_layernorm,
        "rotary_base": arch.rotary_base,
        "rope_scaling_factor": arch.rope_scaling_factor,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "vocab_size": arch.vocab_size,
        "num_moe_experts": arch.num_experts or None,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size or None,
        "moe_router_topk": arch.moe_router_topk,
        # Softmax-then-top-k keeps HF's probabilities un-renormalised (norm_topk_prob=False).
        "moe_router_pre_softmax": arch.is_moe and not arch.moe_norm_topk_prob,
    }
