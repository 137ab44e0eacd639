"""Token log-probs and entropy from (vocab-parallel) logits, without gathering the vocab.

At TP > 1 each rank holds the logits of one slice of the padded vocab. Softmax
statistics are combined across the TP group instead: the max by a (no-grad) MAX
all-reduce, the sum of exponentials, the target logit and the entropy's sum(p*z) by
megatron's autograd-aware SUM all-reduce (backward = identity, because every TP rank
computes the same loss from the reduced values). At TP = 1 the reductions are no-ops.
Vocab padding columns (Megatron pads the vocab to a multiple of 128 * TP) are masked.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

Tensor = torch.Tensor


def _tp_max(values: Tensor) -> Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        values = values.clone()
        torch.distributed.all_reduce(
            values, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    return values


def _tp_sum(values: Tensor) -> Tensor:
    return reduce_from_tensor_model_parallel_region(values)


def scaled_logits(logits: Tensor, *, temperature: float, vocab_start: int, vocab_size: int) -> Tensor:
    """float32 `logits / temperature` (when temperature > 0) with padding columns (>= vocab_size) masked.

    The mask is a large finite negative number: its probability is exactly 0 and 0 * it
    stays 0 in the entropy (-inf would give NaN there).
    """
    z = logits.float()
    if temperature > 0:
        z = z / temperature
    local_vocab = z.shape[-1]
    if vocab_start + local_vocab > vocab_size:
        columns = torch.arange(vocab_start, vocab_start + local_vocab, device=z.device)
        z = z.masked_fill(columns >= vocab_size, torch.finfo(torch.float32).min / 4)
    return z


def token_log_probs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float,
    vocab_start: int,
    vocab_size: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """log p(target) and the entropy of the softmax, per position.

    logits: [..., V_local] this TP rank's vocab slice, starting at global id `vocab_start`;
    targets: [...] global token ids; vocab_size: the real (unpadded) vocab size.
    Returns ([...] log-probs, [...] entropy or None), float32, differentiable.
    """
    z = scaled_logits(logits, temperature=temperature, vocab_start=vocab_start, vocab_size=vocab_size)
    # Shifting by the global max changes neither result but keeps exp() finite.
    z = z - _tp_max(z.detach().max(dim=-1).values).unsqueeze(-1)
    exp_z = z.exp()
    sum_exp = _tp_sum(exp_z.sum(dim=-1))
    log_sum_exp = sum_exp.log()

    local_target = targets - vocab_start
    in_slice = (local_target >= 0) & (local_target < z.shape[-1])
    picked = z.gather(-1, local_target.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _tp_sum(torch.where(in_slice, picked, torch.zeros_like(picked)))
    log_probs = target_logit - log_sum_exp

    entropy = None
    if with_entropy:
        # H = log(sum exp z) - sum(p * z) for the shifted z (the shift cancels).
        p_times_z = _tp_sum((exp_z * z).sum(dim=-1)) / sum_exp
        entropy = log_sum_exp - p_times_z
    return log_probs, entropy
