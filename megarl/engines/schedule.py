"""Micro-batching and one pass of megatron's pipeline schedule over a batch.

`make_micro_batches` splits a batch (dict of `[B, ...]` tensors) either into fixed-size
micro-batches (rows padded so every micro-batch has the same shape; padding rows carry
`valid_row = 0`) or, with a token budget, into packed rows (see `packing`): bins are
agreed over the DP group so every DP rank runs the same number of micro-batches (the
MoE all-to-all and the pipeline would hang otherwise), and interleaved VPP gets a
multiple of PP micro-batches of one common length. `run_schedule` runs
`get_forward_backward_func()` forward-only or forward+backward with a per-micro-batch
loss function. Results live on the last pipeline stage; `broadcast_from_last_stage`
shares them with the other stages and `MicroBatches.scatter_rows` puts per-row results
back in the caller's row order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megarl.engines.attention import packed_seq_params
from megarl.engines.packing import first_fit_decreasing, pack_rows, split_to_count

Tensor = torch.Tensor


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def causal_padding_mask(attention_mask: Tensor) -> Tensor:
    """[B, S] 1 = real token -> megatron's [B, 1, S, S] bool mask, True = may NOT attend.

    A query attends to earlier-or-same real tokens. Rows of padding queries end up fully
    masked; megatron fills them with a finite value, so they stay finite (and unused).
    """
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal.unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    return ~allowed.unsqueeze(1)


@dataclass
class MicroBatches:
    """The micro-batches of one schedule run and which input row each output row is."""

    batches: list[dict[str, Tensor]]
    # For the concatenated per-row outputs of all micro-batches: the input row, -1 for padding.
    row_order: Tensor
    packed: bool

    def __len__(self) -> int:
        return len(self.batches)

    def scatter_rows(self, per_micro_batch: list[Tensor], rows: int) -> Tensor:
        """[rows, ...] from the per-micro-batch `[n_i, ...]` results, in the input row order."""
        stacked = torch.cat(per_micro_batch)
        out = stacked.new_zeros((rows, *stacked.shape[1:]))
        keep = self.row_order >= 0
        out[self.row_order[keep]] = stacked[keep]
        return out

    def token_counts(self) -> tuple[int, int]:
        """(real tokens, token slots computed) over all micro-batches."""
        if self.packed:
            real = sum(int(mb["cu_seqlens"][-1]) for mb in self.batches)
        else:
            real = sum(int(mb["attention_mask"][mb["valid_row"].bool()].sum()) for mb in self.batches)
        return real, sum(mb["input_ids"].numel() for mb in self.batches)


def _pipeline_multiple(num_chunks: int) -> int:
    # The interleaved (VPP) schedule needs a multiple of the pipeline size of micro-batches.
    return parallel_state.get_pipeline_model_parallel_world_size() if num_chunks > 1 else 1


def _fixed_micro_batches(batch: dict[str, Tensor], micro_batch_size: int, num_chunks: int) -> MicroBatches:
    """Rows in order, `micro_batch_size` per micro-batch; row 0 repeated as padding."""
    rows = next(iter(batch.values())).shape[0]
    size = min(micro_batch_size, rows)  # a micro-batch larger than the batch is all padding
    multiple = _pipeline_multiple(num_chunks)
    count = -(-rows // (size * multiple)) * multiple
    target = count * size
    padded = {key: torch.cat([v, v[:1].expand(target - rows, *v.shape[1:])]) for key, v in batch.items()}
    padded["valid_row"] = (torch.arange(target) < rows).float()
    batches = [{k: v[i : i + size] for k, v in padded.items()} for i in range(0, target, size)]
    row_order = torch.where(torch.arange(target) < rows, torch.arange(target), -1)
    return MicroBatches(batches, row_order, packed=False)


def _dp_max(value: int) -> int:
    if parallel_state.get_data_parallel_world_size() == 1:
        return value
    buffer = torch.tensor([value], dtype=torch.long, device=device())
    torch.distributed.all_reduce(
        buffer, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
    )
    return int(buffer.item())


def _packed_micro_batches(batch: dict[str, Tensor], max_tokens: int, num_chunks: int) -> MicroBatches:
    lengths = batch["attention_mask"].bool().sum(-1).tolist()
    bins = first_fit_decreasing(lengths, max_tokens)
    multiple = _pipeline_multiple(num_chunks)
    count = -(-_dp_max(len(bins)) // multiple) * multiple
    bins = split_to_count(bins, count, lengths)
    # Interleaved VPP at PP=2 exchanges shapes with batched isend/irecv that gloo pairs out
    # of order (the same trap as batch_p2p_comm), so its micro-batches share one length.
    pad_to = max(max(sum(lengths[r] for r in b) for b in bins), 1) if num_chunks > 1 else None
    batches = [pack_rows(batch, rows, pad_to=pad_to) for rows in bins]
    row_order = torch.tensor([r for rows in bins for r in rows], dtype=torch.long)
    return MicroBatches(batches, row_order, packed=True)


def make_micro_batches(
    batch: dict[str, Tensor], *, micro_batch_size: int, max_tokens_per_microbatch: int | None, num_chunks: int
) -> MicroBatches:
    """Fixed `micro_batch_size` rows per micro-batch, or packed rows of at most
    `max_tokens_per_microbatch` tokens when given (collective over DP then)."""
    if max_tokens_per_microbatch is None:
        return _fixed_micro_batches(batch, micro_batch_size, num_chunks)
    return _packed_micro_batches(batch, max_tokens_per_microbatch, num_chunks)


def _forward_step(loss_fn: Callable, data_iterator: Iterator, model):
    mb = {key: value.to(device(), non_blocking=True) for key, value in next(data_iterator).items()}
    if "cu_seqlens" in mb:  # packed: attention keeps each sequence to itself, no mask needed
        output = model(
            input_ids=mb["input_ids"],
            position_ids=mb["position_ids"],
            attention_mask=None,
            packed_seq_params=packed_seq_params(mb["cu_seqlens"]),
        )
    else:
        mask = causal_padding_mask(mb["attention_mask"])
        output = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], attention_mask=mask)
    return output, functools.partial(loss_fn, mb)


def run_schedule(
    chunks: list[torch.nn.Module],
    micro: MicroBatches,
    *,
    loss_fn: Callable[[dict[str, Tensor], Tensor], tuple[Tensor, dict]],
    forward_only: bool,
) -> list[dict]:
    """Run the pipeline schedule over `micro`; returns loss_fn's dicts per micro-batch (last stage only).

    `loss_fn(micro_batch, logits [b, T, V_local]) -> (loss, info)`. The schedule divides
    the loss in place by the number of micro-batches; the caller compensates.
    """
    interleaved = len(chunks) > 1
    # Every VPP chunk reads the same micro-batch stream (for masks and position ids).
    iterators = [iter(micro.batches) for _ in chunks] if interleaved else iter(micro.batches)
    config = get_model_config(chunks[0])
    lengths = {mb["input_ids"].shape[1] for mb in micro.batches}
    # Packed rows differ in length: pipeline stages then exchange shapes before tensors.
    config.variable_seq_lengths = len(lengths) > 1
    try:
        return get_forward_backward_func()(
            forward_step_func=functools.partial(_forward_step, loss_fn),
            data_iterator=iterators,
            model=chunks if interleaved else chunks[0],
            num_microbatches=len(micro),
            seq_length=max(lengths),
            micro_batch_size=micro.batches[0]["input_ids"].shape[0],
            forward_only=forward_only,
        )
    finally:
        config.variable_seq_lengths = False


def is_output_stage() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def broadcast_from_last_stage(tensor: Tensor | None, shape: tuple[int, ...]) -> Tensor:
    """The last PP stage's `tensor` (float32, given `shape`) on every stage of the pipeline."""
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    if pp_size == 1:
        return tensor
    group = parallel_state.get_pipeline_model_parallel_group()
    buffer = (
        tensor.float().to(device()) if is_output_stage() else torch.empty(shape, dtype=torch.float32, device=device())
    )
    torch.distributed.broadcast(buffer, src=torch.distributed.get_global_rank(group, pp_size - 1), group=group)
    return buffer.cpu()
