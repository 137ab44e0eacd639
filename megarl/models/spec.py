"""Architecture specs: which HF decoder families megarl supports and their dimensions.

A registry (`megarl.registry.MODEL_SPECS`) keyed by the HF config's explicit
`model_type` (never a substring of a model name) says how each family differs from
plain Llama: Qwen2 always has a QKV
bias, Qwen3 RMS-normalises q and k per head, Qwen3-MoE is Qwen3 with a top-k routed
mixture of experts in place of every MLP. `arch_from_hf` turns an HF config dict
into an `Arch` (the dimensions every layout map and the engine builder use) and
`transformer_kwargs` into the keyword arguments a Megatron GPT model needs;
`config_problems` lists everything wrong with a config first (the recipe checks
reach it through the registered spec, so `validate` refuses what the engines
could not build); `reward_model_hf_config` is the HF config of a one-label reward
model on a family's backbone. Pure: no megatron import, so the resharding plan can
reuse it anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megarl.errors import InputError
from megarl.registry import MODEL_SPECS


# (key, message, value): one problem of an HF config, for the caller to place (model.config.<key>, a file).
ConfigProblem = tuple[str, str, Any]


@dataclass(frozen=True)
class ModelSpec:
    """How one HF `model_type` maps onto Megatron's local GPT layer spec."""

    model_type: str
    # True: the family always has q/k/v biases (Qwen2); False: read `attention_bias`.
    always_qkv_bias: bool
    qk_layernorm: bool
    # Every decoder layer's MLP is a mixture of experts (HF keys num_experts, moe_intermediate_size, ...).
    moe: bool = False

    def config_problems(self, hf_config: dict) -> list[ConfigProblem]:
        """Every reason this family's model cannot be built from `hf_config` (see `config_problems`)."""
        return config_problems(hf_config, self)


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


# Sizes are tensor dimensions and counts: positive integers that index like C ints do.
MAX_SIZE = 2**31 - 1
_REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings")
_MOE_SIZES = ("moe_intermediate_size", "num_experts_per_tok")
DEFAULT_MAX_POSITIONS = 4096


def _size_problem(key: str, value: Any) -> ConfigProblem | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
        return key, f"must be an integer in 1..{MAX_SIZE}", value
    return None


def _positive_float_problem(key: str, value: Any) -> ConfigProblem | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return key, "must be a finite number > 0", value
    return None


def _supported_features(hf_config: dict, spec: ModelSpec) -> list[ConfigProblem]:
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(("hidden_act", "is not supported (only 'silu')", hf_config["hidden_act"]))
    # Megatron's add_bias_linear would add biases to every linear; these families only
    # ever ship q/k/v biases, so an o_proj or MLP bias has no Megatron counterpart here.
    if hf_config.get("mlp_bias"):
        problems.append(("mlp_bias", "True is not supported", hf_config["mlp_bias"]))
    if hf_config.get("attention_bias") and not spec.always_qkv_bias:
        problems.append(("attention_bias", f"True (o_proj bias) is not supported for {spec.model_type}",
                         hf_config["attention_bias"]))
    if hf_config.get("use_sliding_window"):
        problems.append(("use_sliding_window", "True is not supported", hf_config["use_sliding_window"]))
    if not isinstance(hf_config.get("tie_word_embeddings", False), bool):
        problems.append(("tie_word_embeddings", "must be true or false", hf_config["tie_word_embeddings"]))
    initializer_range = hf_config.get("initializer_range", 0.02)
    if isinstance(initializer_range, bool) or not isinstance(initializer_range, (int, float)) or not (
            0 <= initializer_range < math.inf):
        problems.append(("initializer_range", "must be a finite number >= 0", initializer_range))
    return problems


def get_spec(hf_config: dict) -> ModelSpec:
    """The registered spec for `hf_config["model_type"]`; InputError for anything else."""
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_SPECS:
        raise InputError(
            f"model config: model_type={model_type!r} is not supported; known: {', '.join(MODEL_SPECS.names())}"
        )
    return MODEL_SPECS.get(model_type).target


def config_problems(hf_config: dict, spec: ModelSpec) -> list[ConfigProblem]:
    """Every reason megarl cannot build a `spec` model from `hf_config`: sizes that are not positive integers
    or do not divide, non-finite constants, unsupported features. Empty when `arch_from_hf` will succeed."""
    problems = [(key, "required key missing", None) for key in _REQUIRED_SIZES if key not in hf_config]
    problems += [problem for key in _REQUIRED_SIZES if key in hf_config
                 if (problem := _size_problem(key, hf_config[key])) is not None]
    problems += [problem for key in _OPTIONAL_SIZES if hf_config.get(key) is not None
                 if (problem := _size_problem(key, hf_config[key])) is not None]
    problems += [problem for key in ("rms_norm_eps", "rope_theta") if key in hf_config
                 if (problem := _positive_float_problem(key, hf_config[key])) is not None]
    problems += _supported_features(hf_config, spec)
    sized = {key for key in (*_REQUIRED_SIZES, *_OPTIONAL_SIZES) if key in hf_config
             and _size_problem(key, hf_config[key]) is None}
    if {"num_attention_heads", "num_key_value_heads"} <= sized:
        heads, groups = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
        if heads % groups:
            problems.append(("num_key_value_heads", f"must divide num_attention_heads = {heads}", groups))
    if {"num_attention_heads", "hidden_size"} <= sized and hf_config.get("head_dim") is None:
        # Without head_dim, HF derives it as hidden_size // num_attention_heads and drops the rest.
        heads, hidden = hf_config["num_attention_heads"], hf_config["hidden_size"]
        if hidden % heads:
            problems.append(("hidden_size", f"must be divisible by num_attention_heads = {heads} "
                             "(or give head_dim)", hidden))
        elif (hidden // heads) % 2:
            problems.append(("hidden_size", f"hidden_size / num_attention_heads = {hidden // heads} must be even "
                             "(rotary embeddings rotate pairs)", hidden))
    elif "head_dim" in sized and hf_config["head_dim"] % 2:
        problems.append(("head_dim", "must be even (rotary embeddings rotate pairs)", hf_config["head_dim"]))
    if not any(key == "rope_theta" for key, _, _ in problems):
        problems += _rope_problems(hf_config)
    if spec.moe:
        problems += _moe_problems(hf_config)
    return problems


def _rope_problems(hf_config: dict) -> list[ConfigProblem]:
    scaling = hf_config.get("rope_parameters") or hf_config.get("rope_scaling")
    try:
        base, factor = _rope(hf_config)
    except InputError as error:
        return [("rope_scaling", error.problems[0].removeprefix("model config: "), scaling)]
    except (AttributeError, KeyError, TypeError, ValueError) as error:
        return [("rope_scaling", f"cannot be read ({type(error).__name__}: {error})", scaling)]
    if not 0 < base < math.inf:
        return [("rope_theta", "must be a finite number > 0", base)]
    if factor is not None and not 0 < factor < math.inf:
        return [("rope_scaling", "factor must be a finite number > 0", scaling)]
    return []


def _moe_problems(hf_config: dict) -> list[ConfigProblem]:
    # transformers 5 writes `num_local_experts` for what the hub configs call `num_experts`.
    key = "num_experts" if "num_experts" in hf_config or "num_local_experts" not in hf_config else "num_local_experts"
    problems = [(name, "required key missing", None) for name in (key, *_MOE_SIZES) if name not in hf_config]
    problems += [problem for name in (key, *_MOE_SIZES) if name in hf_config
                 if (problem := _size_problem(name, hf_config[name])) is not None]
    if problems:
        return problems
    topk, experts = hf_config["num_experts_per_tok"], hf_config[key]
    if topk > experts:
        problems.append(("num_experts_per_tok", f"must be in 1..{key} = {experts}", topk))
    # Megatron's local spec puts experts in every layer; dense layers in between are not mapped.
    if hf_config.get("decoder_sparse_step", 1) != 1:
        problems.append(("decoder_sparse_step", "is not supported (only 1)", hf_config["decoder_sparse_step"]))
    if hf_config.get("mlp_only_layers"):
        problems.append(("mlp_only_layers", "is not supported (only [])", hf_config["mlp_only_layers"]))
    return problems


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
    """Validate an HF config dict and extract the dimensions; InputError names each bad key and value."""
    spec = get_spec(hf_config)
    problems = spec.config_problems(hf_config)
    if problems:
        raise InputError([f"model config: {key}: {message} (got {value!r})" for key, message, value in problems])
    heads = hf_config["num_attention_heads"]
    groups = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    rotary_base, rope_scaling_factor = _rope(hf_config)
    moe = {}
    if spec.moe:
        moe = {
            "num_experts": hf_config.get("num_experts", hf_config.get("num_local_experts")),
            "moe_ffn_hidden_size": hf_config["moe_intermediate_size"],
            "moe_router_topk": hf_config["num_experts_per_tok"],
            "moe_norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)),
        }
    return Arch(
        model_type=spec.model_type,
        num_layers=hf_config["num_hidden_layers"],
        hidden_size=hf_config["hidden_size"],
        ffn_hidden_size=hf_config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=hf_config["vocab_size"],
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        qkv_bias=spec.always_qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        rotary_base=rotary_base,
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=hf_config.get("max_position_embeddings") or DEFAULT_MAX_POSITIONS,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        initializer_range=float(hf_config.get("initializer_range", 0.02)),
        **moe,
    )


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


def reward_model_hf_config(hf_config: dict, *, pad_token_id: int, dtype: str) -> dict:
    """The config.json of an HF *ForSequenceClassification reward model with one label on `hf_config`'s backbone."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    architecture = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[hf_config["model_type"]]
    base = {key: value for key, value in hf_config.items() if key not in ("num_labels", "id2label", "label2id")}
    return {**base, "architectures": [architecture], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
            "pad_token_id": pad_token_id, "dtype": dtype, "torch_dtype": dtype}
