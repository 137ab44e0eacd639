"""Core attention for packed rows: the sequences of a row as one right-padded batch.

Megatron's local (non-TE) `DotProductAttention` has no packed-sequence (THD) support,
and a block-diagonal mask over a packed row of T tokens would cost O(T^2) attention
for sequences that only need O(sum of length^2). `PackedDotProductAttention` replaces
the local spec's core attention: without `packed_seq_params` it is megatron's class
unchanged (padding masks, left/right padding); with them (`qkv_format="sbhd"`,
`cu_seqlens_q` = sequence boundaries in the row) it gathers the row's n sequences into
one right-padded batch [L_max, n, heads, dim], calls megatron's attention once with its
default causal mask, and gathers each real token's context back into packed order.
Right padding sits after every real token of its sequence, so the causal mask hides it
from them: a real token still attends exactly to its own sequence's earlier tokens, as
one call per sequence would, and its masked scores soften to exact zeros either way (the
only difference is float summation order). The padded slots' outputs are dropped, so no
gradient reaches them. Tokens after the last boundary (row padding) get a zero context.
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
        total = query.shape[0]
        bounds = packed_seq_params.cu_seqlens_q.to(device=query.device, dtype=torch.long)
        starts, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
        keep = lengths > 0
        starts, lengths = starts[keep], lengths[keep]
        real = int(bounds[-1])
        tail = query.new_zeros(total - real, 1, self.hidden_size_per_partition)
        if len(lengths) == 0:
            return tail
        width = int(lengths.max())
        # padded[j, k] = packed position of token j of sequence k; slots past a sequence's end
        # repeat its last token (finite values, causally hidden from its real tokens).
        offsets = torch.arange(width, device=query.device)
        padded = starts + torch.minimum(offsets[:, None], lengths - 1)
        # The causal padded batch costs O(n * L_max^2) scores per head, as n fixed rows of the
        # row's longest length would: bounded by the row's token budget through n and L_max, the
        # same order as one call per sequence (sum of length^2) when the row's lengths are alike,
        # up to n times more when one long sequence shares its row with many short ones.
        context = super().forward(
            query[padded, 0], key[padded, 0], value[padded, 0], None, attn_mask_type, attention_bias
        )  # [L_max, n, hp]
        # Packed token t of sequence k sits at slot (t - start_k, k) of the flattened [L_max * n] batch.
        sequence = torch.repeat_interleave(torch.arange(len(lengths), device=query.device), lengths)
        slot = (torch.arange(real, device=query.device) - starts[sequence]) * len(lengths) + sequence
        gathered = context.reshape(width * len(lengths), -1).index_select(0, slot)
        return torch.cat([gathered.unsqueeze(1), tail])


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
