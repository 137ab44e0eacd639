"""Micro-batching and one pass of megatron's pipeline schedule over a batch.

The engines hand a batch (dict of `[B, ...]` tensors) and a per-micro-batch loss
function to `run_schedule`; it pads the batch so every micro-batch has the same shape
(the pipeline's p2p buffers are fixed-size; interleaved VPP also needs the number of
micro-batches to be a multiple of PP), builds the attention mask and runs
`get_forward_backward_func()` forward-only or forward+backward. Padding rows carry
`valid_row = 0` so losses can ignore them. Results live on the last pipeline stage;
`broadcast_from_last_stage` shares them with the other stages.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

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


def num_micro_batches(rows: int, micro_batch_size: int, num_chunks: int) -> int:
    """Micro-batches `run_schedule` runs for `rows` rows: interleaved VPP (num_chunks > 1)
    needs a multiple of the pipeline size."""
    multiple = parallel_state.get_pipeline_model_parallel_world_size() if num_chunks > 1 else 1
    return -(-rows // (min(micro_batch_size, rows) * multiple)) * multiple


def pad_rows(batch: dict[str, Tensor], target_rows: int) -> dict[str, Tensor]:
    """Repeat row 0 up to `target_rows` rows; adds `valid_row` [B] (1 real, 0 padding)."""
    rows = next(iter(batch.values())).shape[0]
    padded = {
        key: torch.cat([value, value[:1].expand(target_rows - rows, *value.shape[1:])]) for key, value in batch.items()
    }
    padded["valid_row"] = (torch.arange(target_rows) < rows).float()
    return padded


def micro_batches(batch: dict[str, Tensor], micro_batch_size: int) -> list[dict[str, Tensor]]:
    rows = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + micro_batch_size] for k, v in batch.items()} for i in range(0, rows, micro_batch_size)]


def _forward_step(loss_fn: Callable, data_iterator: Iterator, model):
    mb = {key: value.to(device(), non_blocking=True) for key, value in next(data_iterator).items()}
    output = model(
        input_ids=mb["input_ids"],
        position_ids=mb["position_ids"],
        attention_mask=causal_padding_mask(mb["attention_mask"]),
    )
    return output, functools.partial(loss_fn, mb)


def run_schedule(
    chunks: list[torch.nn.Module],
    batch: dict[str, Tensor],
    *,
    micro_batch_size: int,
    loss_fn: Callable[[dict[str, Tensor], Tensor], tuple[Tensor, dict]],
    forward_only: bool,
) -> list[dict]:
    """Run the pipeline schedule over `batch`; returns loss_fn's dicts per micro-batch (last stage only).

    `batch` must hold input_ids, attention_mask, position_ids ([B, S]); it is padded (see
    `pad_rows`). `loss_fn(micro_batch, logits [b, S, V_local]) -> (loss, info)`. The schedule
    divides the loss in place by the number of micro-batches; the caller compensates.
    """
    interleaved = len(chunks) > 1
    rows = next(iter(batch.values())).shape[0]
    micro_batch_size = min(micro_batch_size, rows)  # a micro-batch larger than the batch is all padding
    padded = pad_rows(batch, num_micro_batches(rows, micro_batch_size, len(chunks)) * micro_batch_size)
    mbs = micro_batches(padded, micro_batch_size)
    # Every VPP chunk reads the same micro-batch stream (for masks and position ids).
    iterators = [iter(mbs) for _ in chunks] if interleaved else iter(mbs)
    return get_forward_backward_func()(
        forward_step_func=functools.partial(_forward_step, loss_fn),
        data_iterator=iterators,
        model=chunks if interleaved else chunks[0],
        num_microbatches=len(mbs),
        seq_length=padded["input_ids"].shape[1],
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


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
