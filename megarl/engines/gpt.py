"""Build the Megatron GPT model chunks of this rank from an HF config.

`build_gpt` creates the chunks this (TP, PP, EP) rank holds (one per VPP chunk; the
embedding only on the first chunk, the output layer only on the last; a rank's block
of experts for MoE families) with megatron's Transformer Engine or local layer spec
(`transformer_impl`: "auto" takes TE when it imports and CUDA is present), its
TransformerConfig and RoPE at the caller's position ids. Both specs keep megarl's
core attention (`attention.PackedDotProductAttention`): TE's fused attention would
need the THD packed format and ignores the padding masks the engines pass. The
weights are left uninitialised: `hf_weights` loads HF weights into them, `checkpoint`
a distributed checkpoint. `chunk_weights` gives a chunk's weights under the
local-spec names whatever the layer spec (`megarl.models.canonical_name`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megarl.engines.attention import PackedDotProductAttention
from megarl.engines.lora import ADAPTERS_ATTR
from megarl.errors import InputError
from megarl.models.layout import canonical_name, padded_vocab_size
from megarl.models.sharding import stage_roles, tp_split_dim
from megarl.models.spec import Arch, arch_from_hf

Tensor = torch.Tensor
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRANSFORMER_IMPLS = ("auto", "transformer_engine", "local")
ADAPTERS_PREFIX = ADAPTERS_ATTR + "."


@dataclass
class GPTModelChunks:
    """The model chunks of this rank plus what is needed to map them back to HF."""

    chunks: list[GPTModel]
    arch: Arch
    config: TransformerConfig
    padded_vocab: int
    transformer_impl: str  # the resolved layer spec: "transformer_engine" or "local"

    @property
    def vocab_start(self) -> int:
        """First vocab row of this TP rank's slice of the (padded) vocab."""
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        return parallel_state.get_tensor_model_parallel_rank() * (self.padded_vocab // tp_size)


def resolve_dtype(params_dtype: str | torch.dtype | None) -> torch.dtype:
    """None -> float32 on CPU, bfloat16 on GPU; names as in recipes ("bfloat16", ...)."""
    if params_dtype is None:
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if isinstance(params_dtype, torch.dtype):
        return params_dtype
    if params_dtype not in _DTYPES:
        raise ValueError(f"params_dtype={params_dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[params_dtype]


def transformer_engine_usable() -> bool:
    """Whether megatron found transformer-engine (it imports TE's modules at import time) and CUDA is present."""
    return gpt_layer_specs.HAVE_TE and torch.cuda.is_available()


def resolve_transformer_impl(choice: str) -> str:
    """"auto" -> "transformer_engine" when usable, else "local"; InputError for TE where it cannot run."""
    if choice not in TRANSFORMER_IMPLS:
        raise InputError(f"model.transformer_impl: {choice!r} is not one of {', '.join(TRANSFORMER_IMPLS)}")
    if choice == "auto":
        return "transformer_engine" if transformer_engine_usable() else "local"
    if choice == "transformer_engine" and not transformer_engine_usable():
        why = "no CUDA device" if gpt_layer_specs.HAVE_TE else "transformer_engine does not import"
        raise InputError(f"model.transformer_impl: transformer_engine needs transformer-engine and CUDA ({why}); "
                         "use auto or local")
    return choice


def chunk_weights(chunk: torch.nn.Module) -> dict[str, Tensor]:
    """A chunk's weights by local-spec name (`canonical_name`), without megatron's / TE's `_extra_state` entries
    (None in local layers, FP8 metadata tensors in TE layers) and without LoRA adapters (`megarl.engines.lora`)."""
    return {
        canonical_name(name): value
        for name, value in chunk.state_dict().items()
        if isinstance(value, Tensor) and not name.endswith("._extra_state") and not name.startswith(ADAPTERS_PREFIX)
    }


def transformer_config(arch: Arch, *, params_dtype: torch.dtype) -> TransformerConfig:
    """The TransformerConfig for `arch` at the parallel layout megatron was initialised with."""
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Weights always come from an HF-layout state dict (loaded or seeded), so
        # megatron's own initialisation would be wasted work.
        perform_initialization=False,
        # On GPU the parameters are allocated on the device directly (CPU initialisation
        # would build each TE layer's full master weight in host memory first).
        use_cpu_initialization=not torch.cuda.is_available(),
        # Fused kernels need CUDA extensions; the causal softmax kernel would also
        # ignore our padding mask.
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Batched isend/irecv computes wrong VPP gradients on gloo (forward fine, gradients silently off).
        batch_p2p_comm=False,
        **_moe_config(arch),
    )


def _moe_config(arch: Arch) -> dict:
    """TransformerConfig fields of a mixture-of-experts model (none for a dense one)."""
    if not arch.is_moe:
        return {}
    tp = parallel_state.get_tensor_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    if tp > 1:
        # Megatron's MoE layer refuses to train with TP but without sequence parallelism,
        # which the engines do not run: scale MoE models with EP (and PP) instead.
        raise ValueError(f"MoE models need tp=1 (got tp={tp}); split the experts with ep instead")
    _allow_moe_without_te()
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_router_topk,
        # HF: softmax over all experts, top-k, renormalised only with norm_topk_prob.
        # Megatron: pre-softmax = softmax then top-k; otherwise softmax over the top-k
        # logits, which equals the renormalised probabilities.
        "moe_router_pre_softmax": not arch.moe_norm_topk_prob,
        "moe_router_load_balancing_type": "none",  # RL updates add no load-balancing loss
        "moe_aux_loss_coeff": 0.0,
        # All-to-all copes with packed (variable-length) micro-batches; expert-TP is 1
        # (see distributed.set_model_parallel), so experts are never split over TP.
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,
    }


def _allow_moe_without_te() -> None:
    # megatron-core 0.16.1 reads `te_general_gemm` in the router's linear without defining it
    # when transformer-engine is missing (NameError); None selects its plain torch path.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class PositionIdsRotary(torch.nn.Module):
    """RoPE at the caller's `position_ids` instead of megatron's 0..S-1 for every row.

    Megatron's GPTModel only uses position ids for learned absolute embeddings; its
    RoPE always rotates by the index in the row. Packed rows hold several sequences whose
    positions must restart at 0 (the block-diagonal mask alone would leave each sequence
    rotated by its offset: equal in exact arithmetic, not in float32 at long offsets), and
    left-padded rows then match HF's `cumsum - 1` positions exactly. A forward pre-hook on
    the model hands this module the position ids of the current call.
    """

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        if inner.rotary_interleaved or inner.seq_len_interpolation_factor is not None:
            raise ValueError("PositionIdsRotary supports plain (non-interleaved, unscaled-sequence) RoPE only")
        self.inner = inner
        self.position_ids: Tensor | None = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.inner.get_rotary_seq_len(*args, **kwargs)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None) -> Tensor:
        if self.position_ids is None:
            return self.inner(max_seq_len, offset, packed_seq, cp_group)
        inv_freq = self.inner.inv_freq.to(self.position_ids.device)
        freqs = self.position_ids.to(inv_freq.dtype).unsqueeze(-1) * inv_freq  # [b, s, dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim], broadcast over heads


def _remember_position_ids(rotary: PositionIdsRotary):
    def hook(module, args, kwargs):
        position_ids = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
        rotary.position_ids = position_ids

    return hook


def _layer_spec(arch: Arch, transformer_impl: str) -> ModuleSpec:
    """Megatron's TE or local layer spec with core attention that can run packed rows per sequence."""
    if transformer_impl == "transformer_engine":
        # TE reads the norm kind (RMSNorm) from the TransformerConfig.
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=arch.num_experts or None,
            moe_grouped_gemm=False,
            qk_layernorm=arch.qk_layernorm,
            normalization="RMSNorm",
        )
    attention = spec.submodules.self_attention
    submodules = dataclasses.replace(attention.submodules, core_attention=PackedDotProductAttention)
    self_attention = dataclasses.replace(attention, submodules=submodules)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention))


class ValueHead(torch.nn.Module):
    """Scalar value head in place of the LM output layer: hidden [s, b, h] -> ([s, b, 1], None).

    Called by GPTModel's post-processing exactly like the output layer it replaces (same
    arguments, same tuple result), so the model returns [b, s, 1] values instead of logits.
    Replicated across TP: its input (the final-norm hidden state) is the same on every TP rank.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        return F.linear(hidden_states, self.weight, self.bias), None


def _build_chunk(
    arch: Arch, config: TransformerConfig, spec: ModuleSpec, padded_vocab: int, vpp_rank: int | None,
    value_head: bool,
) -> GPTModel:
    pp_rank, pp_size = (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    vpp_size = config.virtual_pipeline_model_parallel_size or 1
    pre_process, post_process = stage_roles(pp_rank, pp_size, vpp_rank or 0, vpp_size)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        # A value model has no LM output to tie the embedding to.
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=arch.rotary_base,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        vp_stage=vpp_rank,
    )
    model.rotary_pos_emb = PositionIdsRotary(model.rotary_pos_emb)
    model.register_forward_pre_hook(_remember_position_ids(model.rotary_pos_emb), with_kwargs=True)
    # Megatron tags TP-split parameters only inside its weight initialisers, which we skip;
    # untagged, grad-norm and optimizer code would treat every shard as a TP replica.
    for name, param in model.named_parameters():
        dim = tp_split_dim(canonical_name(name))
        if dim is None:
            continue
        if not hasattr(param, "tensor_model_parallel"):
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)
        elif param.partition_dim != dim:
            raise ValueError(f"{name}: megatron splits dim {param.partition_dim}, the layout map says {dim}")
    if value_head and post_process:
        # Replaced after the TP tagging above: the head is replicated, not vocab-split.
        model.output_layer = ValueHead(arch.hidden_size, config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def build_gpt(
    hf_config: dict,
    *,
    params_dtype: str | torch.dtype | None = None,
    transformer_impl: str,
    make_vocab_size_divisible_by: int = 128,
    value_head: bool = False,
) -> GPTModelChunks:
    """This rank's GPT chunks for `hf_config` at the current parallel layout, weights uninitialised.

    `transformer_impl`: "auto", "transformer_engine" or "local" (`resolve_transformer_impl`).
    `value_head=True` builds a value model: the last stage ends in a `ValueHead` ([b, s, 1]
    values) instead of the LM output layer, and embeddings are never tied.
    """
    impl = resolve_transformer_impl(transformer_impl)
    arch = arch_from_hf(hf_config)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(arch, params_dtype=resolve_dtype(params_dtype))
    padded_vocab = padded_vocab_size(
        arch.vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by, tp_size=tp_size
    )
    vpp_size = config.virtual_pipeline_model_parallel_size
    vpp_ranks = list(range(vpp_size)) if vpp_size else [None]
    spec = _layer_spec(arch, impl)
    chunks = [_build_chunk(arch, config, spec, padded_vocab, v, value_head) for v in vpp_ranks]
    return GPTModelChunks(chunks, arch, config, padded_vocab, impl)
