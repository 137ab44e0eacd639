"""Core attention that runs each sequence of a packed row on its own.

Megatron's local (non-TE) `DotProductAttention` has no packed-sequence (THD) support,
and a block-diagonal mask over a packed row of T tokens would cost O(T^2) attention
for sequences that only need O(sum of length^2). `PackedDotProductAttention` replaces
the local spec's core attention: without `packed_seq_params` it is megatron's class
unchanged (padding masks, left/right padding); with them (`qkv_format="sbhd"`,
`cu_seqlens_q` = sequence boundaries in the row) it calls megatron's attention once per
sequence slice with its default causal mask, so numerics match the unpacked rows.
Tokens after the last boundary (row padding) get a zero context.
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

Tensor = torch.Tensor


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type=None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if query.shape[1] != 1:
            raise ValueError(f"packed attention expects one packed row per micro-batch, got {query.shape[1]}")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        # [s, b, np, hn] slices per sequence; mask None = megatron's causal mask of that length.
        contexts = [
            super(PackedDotProductAttention, self).forward(
                query[start:end], key[start:end], value[start:end], None, attn_mask_type, attention_bias
            )
            for start, end in zip(bounds[:-1], bounds[1:])
            if end > start
        ]
        tail = query.shape[0] - bounds[-1]
        if tail:
            contexts.append(query.new_zeros(tail, 1, self.hidden_size_per_partition))
        return torch.cat(contexts)


def packed_seq_params(cu_seqlens: Tensor) -> PackedSeqParams:
    """What the model's forward needs to find the sequences of a packed row."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
    return PackedSeqParams(
        qkv_format="sbhd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )
