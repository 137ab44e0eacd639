"""Per-micro-batch loss functions the engines hand to the pipeline schedule, and metric reduction.

Each loss is built so that the micro-batch losses of a mini-batch add up to the
mini-batch loss: normalisers (token / sequence counts) are those of the whole
mini-batch on all DP ranks. Megatron then divides each returned loss by the number of
micro-batches and DDP averages gradients over DP ranks, so every loss is multiplied by
`loss_scale = micro-batches * dp_size` to turn both back into plain sums. The result:
the gradient does not depend on how a mini-batch is split into micro-batches or ranks.
"""

from __future__ import annotations

import functools

import torch
from megatron.core import parallel_state

from megarl.algorithms.kl import kl_penalty
from megarl.algorithms.losses import agg_loss, policy_loss
from megarl.config.settings import PolicyLossSettings
from megarl.engines.gpt import GPTModelChunks
from megarl.engines.logprobs import token_log_probs
from megarl.engines.schedule import broadcast_from_last_stage, is_output_stage

Tensor = torch.Tensor
# `actor/entropy` is not among them: the step reports it once, from the old_log_prob phase.
PPO_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")
# Ratio metrics are averaged over tokens; the losses are already shares of the mini-batch value.
_TOKEN_WEIGHTED = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def dp_sum(values) -> Tensor:
    """Sum over the data-parallel group, float64 (token counts stay exact), on CPU."""
    total = torch.as_tensor(values, dtype=torch.float64).reshape(-1).clone()
    if parallel_state.get_data_parallel_world_size() > 1:
        buffer = total.to(torch.cuda.current_device()) if torch.cuda.is_available() else total
        torch.distributed.all_reduce(buffer, group=parallel_state.get_data_parallel_group())
        total = buffer.cpu()
    return total


def loss_scale(num_micro_batches: int) -> int:
    return num_micro_batches * parallel_state.get_data_parallel_world_size()


def response_log_probs(
    model: GPTModelChunks, mb: dict, logits: Tensor, *, response_length: int, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """Log-probs [n, R] (and entropy) of the last R tokens of each row: token t is predicted
    by the logits at t - 1. Packed micro-batches (one row holding n sequences, see
    `packing`) read those logits through `token_index`; positions whose token or
    predecessor is padding come out as 0 there (unpacked: computed but meaningless)."""
    common = dict(
        temperature=temperature,
        vocab_start=model.vocab_start,
        vocab_size=model.arch.vocab_size,
        with_entropy=with_entropy,
    )
    if "token_index" not in mb:
        seq = logits.shape[1]
        return token_log_probs(
            logits[:, seq - response_length - 1 : seq - 1], mb["input_ids"][:, seq - response_length :], **common
        )
    index = mb["token_index"]
    seq = index.shape[1]
    target_at = index[:, seq - response_length :]
    predictor_at = index[:, seq - response_length - 1 : seq - 1]
    valid = (target_at >= 0) & (predictor_at >= 0)
    log_probs, entropy = token_log_probs(
        logits[0][predictor_at.clamp(min=0)], mb["input_ids"][0][target_at.clamp(min=0)], **common
    )
    zero = torch.zeros((), device=log_probs.device)
    return (
        torch.where(valid, log_probs, zero),
        None if entropy is None else torch.where(valid, entropy, zero),
    )


def ppo_loss(
    mb: dict,
    logits: Tensor,
    *,
    model: GPTModelChunks,
    response_length: int,
    temperature: float,
    scale: int,
    normalisers: dict,
    ppo: PolicyLossSettings,
) -> tuple[Tensor, dict]:
    """The policy loss (`ppo.policy_loss`) - entropy_coeff * entropy (+ kl_loss_coef * KL) of one micro-batch,
    scaled by `scale`."""
    with_entropy = ppo.entropy_coeff != 0
    log_probs, entropy = response_log_probs(
        model, mb, logits, response_length=response_length, temperature=temperature, with_entropy=with_entropy
    )
    mask = mb["response_mask"] * mb["valid_row"].unsqueeze(-1)
    agg = functools.partial(agg_loss, loss_agg_mode=ppo.loss_agg_mode, **normalisers)
    pg_loss, pg_metrics = policy_loss(
        ppo.policy_loss,
        mb["old_log_probs"],
        log_probs,
        mb["advantages"],
        mask,
        clip_ratio_low=ppo.clip_ratio_low,
        clip_ratio_high=ppo.clip_ratio_high,
        clip_ratio_c=ppo.clip_ratio_c,
        loss_agg_mode=ppo.loss_agg_mode,
        **normalisers,
    )
    loss = pg_loss - ppo.entropy_coeff * agg(entropy, mask) if with_entropy else pg_loss
    tokens = mask.sum().detach()
    info = {"tokens": tokens, "actor/pg_loss": pg_loss.detach()}
    info.update({name: value * tokens for name, value in pg_metrics.items()})
    if ppo.use_kl_loss:
        kl_loss = agg(kl_penalty(log_probs, mb["ref_log_prob"], ppo.kl_loss_type), mask)
        loss = loss + ppo.kl_loss_coef * kl_loss
        info["actor/kl_loss"] = kl_loss.detach()
    return loss * scale, info


def sft_loss(mb: dict, logits: Tensor, *, model: GPTModelChunks, tokens: float, scale: int) -> tuple[Tensor, dict]:
    """Summed NLL of the `loss_mask` tokens of one micro-batch / `tokens` (the global count), scaled."""
    log_probs, _ = response_log_probs(
        model, mb, logits, response_length=mb["loss_mask"].shape[1] - 1, temperature=1.0, with_entropy=False
    )
    mask = mb["loss_mask"][:, 1:].float() * mb["valid_row"].unsqueeze(-1)
    loss = -(log_probs * mask).sum() / tokens
    return loss * scale, {"loss": loss.detach()}


def reduce_ppo_metrics(outputs: list[dict], *, with_kl: bool) -> dict[str, float]:
    """One mini-batch's metrics from the micro-batch infos: summed over micro-batches and DP ranks,
    ratios token-weighted; the same values on every pipeline stage."""
    names = list(PPO_METRICS) + (["actor/kl_loss"] if with_kl else [])
    local = torch.zeros(len(names) + 1, dtype=torch.float64)
    for info in outputs:  # empty on stages without the output layer
        local += torch.tensor([float(info[n]) for n in names] + [float(info["tokens"])], dtype=torch.float64)
    total = dp_sum(local).float()
    total = broadcast_from_last_stage(total if is_output_stage() else None, tuple(total.shape))
    tokens = max(float(total[-1]), 1.0)
    return {name: float(total[i]) / (tokens if name in _TOKEN_WEIGHTED else 1.0) for i, name in enumerate(names)}


def reduce_sft_loss(outputs: list[dict]) -> float:
    total = dp_sum(sum(float(info["loss"]) for info in outputs)).float()
    return float(broadcast_from_last_stage(total if is_output_stage() else None, (1,))[0])
