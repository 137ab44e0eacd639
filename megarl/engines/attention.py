"""Core attention for packed rows: the sequences of a row as one right-padded batch.

Megatron's local (non-TE) `DotProductAttention` has no packed-sequence (THD) support,
and a block-diagonal mask over a packed row of T tokens would cost O(T^2) attention
for sequences that only need O(sum of length^2). `PackedDotProductAttention` replaces
the local spec's core attention: without `packed_seq_params` it is megatron's class
unchanged (padding masks, left/right padding); with them (`qkv_format="sbhd"`,
`cu_seqlens_q` = sequence boundaries in the row) it gathers the row's sequences of each
length class [2^b, 2^(b+1)) into one right-padded batch [L_max, n, heads, dim], calls
megatron's attention once per class with its default causal mask, and puts each real
token's context back into packed order (a class costs at most 4x the scores of one call
per sequence; one batch for the whole row would cost up to n times more when a long
sequence shares its row with many short ones).
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
        if len(lengths) == 0:
            return query.new_zeros(total, 1, self.hidden_size_per_partition)
        # One call per length class [2^b, 2^(b+1)): a class of n sequences costs n * L_max^2 scores per head,
        # at most 4x the sum of its length^2 that one call per sequence would cost, so a long sequence never
        # pads many short ones up to its length (a packed row mixes both).
        classes = torch.floor(torch.log2(lengths.to(torch.float64))).long()
        contexts, positions = [], []
        for length_class in torch.unique(classes).tolist():
            members = classes == length_class
            context, position = self._padded_batch(query, key, value, starts[members], lengths[members],
                                                   attn_mask_type, attention_bias)
            contexts.append(context)
            positions.append(position)
        order = torch.cat(positions)
        contexts = torch.cat(contexts)
        # Every real token belongs to one sequence: `order` is a permutation of 0..real-1.
        packed = contexts.new_empty(real, contexts.shape[1]).index_copy(0, order, contexts)
        tail = query.new_zeros(total - real, self.hidden_size_per_partition)
        return torch.cat([packed, tail]).unsqueeze(1)

    def _padded_batch(self, query, key, value, starts, lengths, attn_mask_type, attention_bias):
        """Megatron's attention once over the sequences at `starts` (`lengths`) as one right-padded batch
        [L_max, n, ...]: (each real token's context [tokens, hp], that token's packed position)."""
        count, width = len(lengths), int(lengths.max())
        # padded[j, k] = packed position of token j of sequence k; slots past a sequence's end repeat its
        # last token (finite values, causally hidden from its real tokens).
        offsets = torch.arange(width, device=query.device)
        padded = starts + torch.minimum(offsets[:, None], lengths - 1)
        context = super().forward(
            query[padded, 0], key[padded, 0], value[padded, 0], None, attn_mask_type, attention_bias
        )  # [L_max, n, hp]
        # Token j of sequence k sits at slot j * n + k of the flattened [L_max * n] batch.
        sequence = torch.repeat_interleave(torch.arange(count, device=query.device), lengths)
        first = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(int(lengths.sum()), device=query.device) - first[sequence]
        context = context.reshape(width * count, -1).index_select(0, within * count + sequence)
        return context, starts[sequence] + within


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
