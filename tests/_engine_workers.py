"""Spawn targets for the engine tests: each runs inside an initialised gloo rank and
returns plain tensors/dicts; all assertions against references happen in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _hf_config(checkpoint: str) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def forward_outputs(*, rank: int, checkpoints: dict[str, str], batch: dict, response_length: int) -> dict:
    """Raw logits (real vocab columns), log-probs at T=1 and T=0.7 and entropy, per checkpoint."""
    from megarl.engines.actor import PolicyEngine
    from megarl.engines.schedule import causal_padding_mask

    results = {}
    for name, checkpoint in checkpoints.items():
        hf_config = _hf_config(checkpoint)
        engine = PolicyEngine(hf_config=hf_config, weights=checkpoint, trainable=False)
        with torch.no_grad():
            logits = engine.model.chunks[0](
                input_ids=batch["input_ids"],
                position_ids=batch["position_ids"],
                attention_mask=causal_padding_mask(batch["attention_mask"]),
            )
        common = dict(response_length=response_length, **batch)
        log_probs, entropy = engine.compute_log_prob(temperature=1.0, micro_batch_size=3, with_entropy=True, **common)
        log_probs_t, none = engine.compute_log_prob(temperature=0.7, micro_batch_size=4, with_entropy=False, **common)
        results[name] = {
            "logits": logits[..., : hf_config["vocab_size"]].clone(),
            "padded_vocab": logits.shape[-1],
            "log_probs": log_probs,
            "entropy": entropy,
            "log_probs_t07": log_probs_t,
            "entropy_t07": none,
        }
    return results


def _hf_grads(engine) -> dict[str, torch.Tensor]:
    """The accumulated gradient (DDP main_grad) of every parameter, in HF names."""
    from megarl.models.layout import megatron_to_hf

    module = engine.train.ddp_chunks[0].module
    grads = {name: param.main_grad.detach().float().clone() for name, param in module.named_parameters()}
    return megatron_to_hf(grads, engine.model.arch)


def actor_outputs(*, rank: int, checkpoint: str, batch: dict, ppo: dict, sft_batch: dict, other_weights: dict) -> dict:
    """Everything the actor tests assert on, from one process (three engines)."""
    from megarl.engines.actor import PolicyEngine

    hf_config = _hf_config(checkpoint)
    out: dict = {}
    lp_inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    response_length = batch["response_mask"].shape[1]

    reference = PolicyEngine(hf_config=hf_config, weights=checkpoint, trainable=False)
    out["ref_requires_grad"] = any(p.requires_grad for c in reference.model.chunks for p in c.parameters())
    out["ref_lp_before"], _ = reference.compute_log_prob(
        response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=False, **lp_inputs
    )

    # Gradients at fixed weights (lr = 0): one micro-batch, two, and an uneven split with padding.
    grad_engine = PolicyEngine(hf_config=hf_config, weights=checkpoint, lr=0.0, clip_grad=0.0)
    rows = batch["input_ids"].shape[0]
    for label, micro in (("grads_1mb", rows), ("grads_2mb", rows // 2), ("grads_uneven", 4)):
        metrics = grad_engine.update_policy(micro_batch_size=micro, shuffle=False, **batch, **ppo)
        out[label] = _hf_grads(grad_engine)
        out[label + "_metrics"] = metrics

    out["sft_loss_at_checkpoint"] = grad_engine.sft_step(micro_batch_size=4, **sft_batch)["sft/loss"]

    # One real update on the same batch.
    actor = PolicyEngine(hf_config=hf_config, weights=checkpoint, lr=1e-3, clip_grad=1.0)
    out["weights_before"] = actor.hf_state_dict()
    lp0, entropy0 = actor.compute_log_prob(
        response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=True, **lp_inputs
    )
    update_batch = {**batch, "old_log_probs": lp0}
    out["lp_before"], out["entropy_before"] = lp0, entropy0
    plain_ppo = {**ppo, "entropy_coeff": 0.0, "use_kl_loss": False}
    out["update_metrics"] = actor.update_policy(
        micro_batch_size=4, ppo_epochs=1, shuffle=True, seed=7, **update_batch, **plain_ppo
    )
    out["lp_after"], _ = actor.compute_log_prob(
        response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=False, **lp_inputs
    )
    out["weights_after"] = actor.hf_state_dict()

    out["sft_metrics"] = [actor.sft_step(micro_batch_size=3, lr=1e-2, **sft_batch) for _ in range(5)]
    out["lr_after_sft"] = actor.train.optimizer.param_groups[0]["lr"]

    actor.load_hf_state_dict(other_weights)
    out["reloaded"] = actor.hf_state_dict()

    out["ref_lp_after"], _ = reference.compute_log_prob(
        response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=False, **lp_inputs
    )
    out["ref_weights_after"] = reference.hf_state_dict()
    try:
        reference.update_policy(micro_batch_size=4, **update_batch)
        out["ref_update_error"] = None
    except RuntimeError as error:
        out["ref_update_error"] = str(error)
    return out


def layout_outputs(*, rank: int, hf_config: dict, batch: dict, ppo: dict) -> dict:
    """Log-probs, metrics, weights and gradients (HF names) of this DP rank's share of `batch`.

    Random weights from a seed (generated in HF layout, so the same model at every layout),
    lr = 0 so the gradient of the update is left in the buffers at unchanged weights.
    """
    from megatron.core import parallel_state

    from megarl.engines.actor import PolicyEngine

    engine = PolicyEngine(hf_config=hf_config, weights=None, seed=21, lr=0.0, clip_grad=0.0)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    shard = {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}
    log_probs, entropy = engine.compute_log_prob(
        input_ids=shard["input_ids"],
        attention_mask=shard["attention_mask"],
        position_ids=shard["position_ids"],
        response_length=shard["response_mask"].shape[1],
        temperature=0.8,
        micro_batch_size=2,
        with_entropy=True,
    )
    metrics = engine.update_policy(micro_batch_size=2, shuffle=False, **shard, **ppo)
    weights = engine.hf_state_dict()
    # Swap each parameter's data for its gradient buffer to gather gradients like weights.
    for chunk in engine.train.ddp_chunks:
        for param in chunk.module.parameters():
            param.data = param.main_grad.to(param.dtype)
    return {
        "dp_rank": dp_rank,
        "log_probs": log_probs,
        "entropy": entropy,
        "metrics": metrics,
        "weights": weights,
        "grads": engine.hf_state_dict(),
    }
