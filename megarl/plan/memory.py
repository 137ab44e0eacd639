"""Device memory of one training role's rank: weights, gradients, optimizer state, activations.

Bytes per parameter, as megarl's engines set megatron up (`megarl.engines.optim`):
weights in the model dtype; gradients in megatron's DDP buffer, float32
(`grad_reduce_in_fp32`); Adam's two float32 moments, plus a float32 master copy of
each weight when the model is bf16/fp16. Frozen roles (reference, reward model
during RL) hold weights only. With a distributed optimizer (`distributed_optimizer`,
a what-if: megarl's engines run without one) the master copies and moments are
split over the DP ranks (experts' over the expert-DP ranks); the gradient buffer
stays whole.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), written for this model family (RMSNorm, SwiGLU,
grouped-query attention, no dropout). Per token and layer, in 16-bit values:
the two norm inputs and the QKV and fc1 inputs (8h bytes, split over TP only
with sequence parallelism), Q, K and V and the attention output (2(2q + 2kv)
bytes), fc1's output and fc2's input (6F), all split over TP; plus the softmax
output (2as bytes) unless the attention is flash (it recomputes the scores) or
recompute is `selective`. `full` recompute keeps each layer's input (2h) and one
layer's full set. The first pipeline stage holds `pp` micro-batches in flight
(x (1 + (pp-1)/(pp vpp)) when interleaved): one micro-batch's worth of all
layers. The last stage adds the logits: bf16 out of the output layer and their
float32 log-softmax (6 bytes per vocab entry / TP).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.models.spec import Arch
from megarl.plan.params import RankParams, rank_params

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """A role's Megatron layout (what `megarl.config.TrainingLayout` resolves to)."""

    tp: int
    pp: int
    dp: int
    vpp: int | None = None
    ep: int = 1
    sequence_parallel: bool = False


@dataclass(frozen=True)
class RoleMemory:
    """Bytes one rank of a role holds on its device, by kind."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def state(self) -> int:
        """Everything but the activations: what stays between micro-batches."""
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.activations


def state_bytes(params: RankParams, *, dtype: str, trainable: bool, layout: Layout,
                distributed_optimizer: bool = False) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of a rank holding `params`."""
    weight_bytes = DTYPE_BYTES[dtype]
    weights = params.total * weight_bytes
    if not trainable:
        return weights, 0, 0
    per_param = 8 + (4 if weight_bytes < 4 else 0)  # Adam moments (+ the float32 master weight)
    if distributed_optimizer:
        expert_dp = max(1, layout.tp * layout.dp // layout.ep)
        optimizer = -(-params.dense // layout.dp) * per_param + -(-params.expert // expert_dp) * per_param
    else:
        optimizer = params.total * per_param
    return weights, params.total * 4, optimizer


def layer_activation_bytes(arch: Arch, *, seq_len: int, tp: int, sequence_parallel: bool, flash: bool,
                           recompute: str) -> float:
    """Bytes one token keeps for the backward pass in one layer (16-bit activations)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}; expected one of {RECOMPUTE}")
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    if recompute == "full":
        return 2 * h / (tp if sequence_parallel else 1)
    ffn = arch.moe_router_topk * arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    replicated = 8 * h / (tp if sequence_parallel else 1)
    split = (2 * (2 * q + 2 * kv) + 6 * ffn) / tp
    scores = 0.0 if flash or recompute == "selective" else 2 * arch.num_attention_heads * seq_len / tp
    return replicated + split + scores


def activation_bytes(arch: Arch, *, layout: Layout, micro_batch: int, seq_len: int, microbatches: int,
                     dtype: str, flash: bool, recompute: str, value_head: bool) -> int:
    """Peak activation bytes of the busiest pipeline stage for one training micro-batch shape."""
    tokens = micro_batch * seq_len
    scale = DTYPE_BYTES[dtype] / 2
    per_layer = layer_activation_bytes(arch, seq_len=seq_len, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                       flash=flash, recompute=recompute) * tokens * scale
    layers_per_stage = arch.num_layers // layout.pp
    in_flight = min(layout.pp, microbatches)
    if layout.vpp and layout.vpp > 1:
        in_flight *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    if recompute == "full":
        full_layer = layer_activation_bytes(arch, seq_len=seq_len, tp=layout.tp, flash=flash, recompute="none",
                                            sequence_parallel=layout.sequence_parallel) * tokens * scale
    else:
        full_layer = 0.0
    first = per_layer * layers_per_stage * in_flight + full_layer
    logits = 0.0 if value_head else 6 * tokens * arch.vocab_size / layout.tp * scale
    last = per_layer * layers_per_stage + full_layer + logits
    return int(max(first, last))


def forward_bytes(arch: Arch, *, layout: Layout, micro_batch: int, seq_len: int, dtype: str, value_head: bool) -> int:
    """Peak activation bytes of a forward-only pass (log-probs, values, scores): one layer's tensors at a time,
    and the logits of the last stage."""
    tokens = micro_batch * seq_len
    scale = DTYPE_BYTES[dtype] / 2
    per_layer = layer_activation_bytes(arch, seq_len=seq_len, tp=layout.tp, sequence_parallel=layout.sequence_parallel,
                                       flash=True, recompute="none") * tokens * scale
    logits = 0.0 if value_head else 6 * tokens * arch.vocab_size / layout.tp * scale
    return int(per_layer + logits)


def role_memory(arch: Arch, *, layout: Layout, dtype: str, trainable: bool, value_head: bool, micro_batch: int,
                seq_len: int, microbatches: int, flash: bool, recompute: str = "none",
                distributed_optimizer: bool = False) -> RoleMemory:
    """The memory of the busiest rank of one role: its state, and the activations of its largest pass."""
    params = rank_params(arch, tp=layout.tp, pp=layout.pp, ep=layout.ep, value_head=value_head)
    weights, gradients, optimizer = state_bytes(params, dtype=dtype, trainable=trainable, layout=layout,
                                                distributed_optimizer=distributed_optimizer)
    if trainable:
        activations = activation_bytes(arch, layout=layout, micro_batch=micro_batch, seq_len=seq_len,
                                       microbatches=microbatches, dtype=dtype, flash=flash, recompute=recompute,
                                       value_head=value_head)
    else:
        activations = forward_bytes(arch, layout=layout, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype,
                                    value_head=value_head)
    return RoleMemory(weights, gradients, optimizer, activations)
