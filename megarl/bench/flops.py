"""Model FLOPs of a decoder's forward and backward passes, per token: the numerator of MFU.

The convention of PaLM (Chowdhery et al. 2022, appendix B) and Megatron: a token's
forward pass multiplies it with every weight matrix once (2 FLOPs per weight, N weights)
and attends over S positions in every layer (QK^T and AV: 4 * q * S FLOPs, q = heads x
head dim); the backward pass costs twice the forward. So a training token costs
6N + 12 * L * q * S and a forward-only token (log-probs, values) 2N + 4 * L * q * S.
N counts the attention and MLP projections (of a mixture of experts: the router and the
top-k experts a token visits) and the output layer (the LM head, or a critic's value
head); not the embedding lookup, the norms or the biases. Model FLOPs count no
activation recomputation: the figure of useful work, not of what the hardware did.
"""

from __future__ import annotations

from megarl.models.spec import Arch

FORMULA = ("training token: 6N + 12*L*q*S FLOPs, forward-only token (log-probs, values): 2N + 4*L*q*S "
           "(PaLM appendix B); N = weights a token multiplies with (attention and MLP projections, MoE router and "
           "top-k experts, the output layer), L = layers, q = attention heads x head dim, S = the step's mean "
           "sequence length (prompt + response tokens per sample)")


def matmul_weights(arch: Arch, *, value_head: bool = False) -> int:
    """N: the weights one token multiplies with in a forward pass (`value_head`: a critic's h x 1 output layer)."""
    h, q, kv = arch.hidden_size, arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    attention = 2 * h * q + 2 * h * kv  # q and o projections, k and v
    if arch.is_moe:
        mlp = arch.num_experts * h + arch.moe_router_topk * 3 * h * arch.moe_ffn_hidden_size
    else:
        mlp = 3 * h * arch.ffn_hidden_size  # gate, up, down
    output = h if value_head else h * arch.vocab_size
    return arch.num_layers * (attention + mlp) + output


def flops_per_token(arch: Arch, *, seq_len: float, backward: bool, value_head: bool = False) -> float:
    """Model FLOPs of one token at mean sequence length `seq_len`: forward only, or forward and backward."""
    forward = 2 * matmul_weights(arch, value_head=value_head) + 4 * arch.num_layers * (
        arch.num_attention_heads * arch.head_dim) * seq_len
    return 3 * forward if backward else forward
