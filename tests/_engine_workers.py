"""Spawn targets for the engine tests: each runs inside an initialised gloo rank and
returns plain tensors/dicts; all assertions against references happen in the tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def _hf_config(checkpoint: str) -> dict:
    return json.loads((Path(checkpoint) / "config.json").read_text())


def full_logits(engine, batch: dict) -> torch.Tensor:
    """[B, S, vocab] logits gathered over TP (test-only: the engines never gather the vocab),
    computed through the pipeline schedule so PP/VPP layouts work, on every rank."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    from megarl.engines.schedule import broadcast_from_last_stage, is_output_stage, make_micro_batches, run_schedule

    vocab = engine.model.arch.vocab_size

    def loss_fn(mb, logits):
        full = gather_from_tensor_model_parallel_region(logits)[..., :vocab]
        return logits.new_zeros(()), {"logits": full.detach().cpu()}

    with torch.no_grad():
        micro = make_micro_batches(
            batch, micro_batch_size=2, max_tokens_per_microbatch=None, num_chunks=len(engine._chunks)
        )
        outputs = run_schedule(engine._chunks, micro, loss_fn=loss_fn, forward_only=True)
    rows, seq = batch["input_ids"].shape
    logits = micro.scatter_rows([o["logits"] for o in outputs], rows) if is_output_stage() else None
    return broadcast_from_last_stage(logits, (rows, seq, vocab))


def gathered_grads(engine) -> dict[str, torch.Tensor]:
    """The accumulated gradients in HF names, gathered like weights (collective over TP/PP):
    each parameter's data is swapped for its gradient buffer for the gather, then back."""
    params = [p for chunk in engine.train.ddp_chunks for p in chunk.module.parameters()]
    weights = [p.data for p in params]
    for param in params:
        param.data = param.main_grad.to(param.dtype)
    try:
        return engine.hf_state_dict()
    finally:
        for param, weight in zip(params, weights):
            param.data = weight


def dp_shard(batch: dict) -> dict:
    """This DP rank's contiguous share of every `[B, ...]` tensor in `batch`."""
    from megatron.core import parallel_state

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}


# Token budgets of the packed runs: at 12 the longest row (13 tokens) exceeds the budget.
PACKED_LOG_PROB_TOKENS, PACKED_TRAIN_TOKENS = 12, 16


def _model_outputs(checkpoint: str, batch: dict, response_length: int) -> dict:
    from megarl.engines.actor import PolicyEngine

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    engine = PolicyEngine(hf_config=_hf_config(checkpoint), weights=checkpoint, lr=0.0, clip_grad=0.0)
    common = dict(response_length=response_length, **inputs)
    log_probs, entropy = engine.compute_log_prob(temperature=1.0, micro_batch_size=3, with_entropy=True, **common)
    log_probs_t, none = engine.compute_log_prob(temperature=0.7, micro_batch_size=4, with_entropy=False, **common)
    packed_log_probs, packed_entropy = engine.compute_log_prob(
        temperature=1.0,
        micro_batch_size=3,
        with_entropy=True,
        max_tokens_per_microbatch=PACKED_LOG_PROB_TOKENS,
        **common,
    )
    shard = dp_shard({**inputs, "loss_mask": batch["loss_mask"]})
    sft = engine.sft_step(micro_batch_size=1, **shard)  # lr = 0: the weights stay
    grads = gathered_grads(engine)
    packed_sft = engine.sft_step(micro_batch_size=1, max_tokens_per_microbatch=PACKED_TRAIN_TOKENS, **shard)
    return {
        "logits": full_logits(engine, inputs),
        "padded_vocab": engine.model.padded_vocab,
        "log_probs": log_probs,
        "entropy": entropy,
        "log_probs_t07": log_probs_t,
        "entropy_t07": none,
        "sft": sft,
        "grads": grads,
        "packed_log_probs": packed_log_probs,
        "packed_entropy": packed_entropy,
        "packed_sft": packed_sft,
        "packed_grads": gathered_grads(engine),
    }


def _ppo_outputs(checkpoint: str, batch: dict, ppo: dict) -> dict:
    from megarl.engines.actor import PolicyEngine

    engine = PolicyEngine(hf_config=_hf_config(checkpoint), weights=checkpoint, lr=0.0, clip_grad=0.0)
    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    shard = dp_shard({key: batch[key] for key in (*keys, "ref_log_prob")})
    metrics = engine.update_policy(micro_batch_size=1, shuffle=False, **shard, **ppo)
    grads = gathered_grads(engine)
    packed_metrics = engine.update_policy(
        micro_batch_size=1, shuffle=False, max_tokens_per_microbatch=PACKED_TRAIN_TOKENS, **shard, **ppo
    )
    packed_grads = gathered_grads(engine)
    return {"metrics": metrics, "grads": grads, "packed_metrics": packed_metrics, "packed_grads": packed_grads}


def _micro_batch_counts(batch: dict) -> dict:
    """Packed micro-batches per DP rank (must agree) and the real / computed token counts."""
    from megarl.engines.schedule import make_micro_batches

    inputs = dp_shard({k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    counts = {}
    for label, tokens in (("fixed", None), ("packed", PACKED_TRAIN_TOKENS)):
        micro = make_micro_batches(inputs, micro_batch_size=1, max_tokens_per_microbatch=tokens, num_chunks=1)
        counts[label] = (len(micro), *micro.token_counts())
    return counts


def matrix_outputs(
    *, rank: int, layouts: dict, checkpoints: dict[str, str], batch: dict, response_length: int, ppo: dict
) -> dict:
    """For each layout (switched in place, same processes): per checkpoint the full logits,
    log-probs (T=1 with entropy, T=0.7 without, packed) of the whole batch, and SFT steps at
    lr=0 on this DP rank's share, unpacked and packed (loss, grad norm, gradients in HF names);
    plus PPO updates at lr=0 of the first checkpoint on the DP share (metrics, gradients)."""
    from megarl.engines.distributed import parallel_layout, set_model_parallel

    results = {}
    for layout_name, parallel in layouts.items():
        set_model_parallel(**parallel)
        out = {"where": parallel_layout(), "micro_batches": _micro_batch_counts(batch)}
        for name, checkpoint in checkpoints.items():
            out[name] = _model_outputs(checkpoint, batch, response_length)
        out["ppo"] = _ppo_outputs(next(iter(checkpoints.values())), batch, ppo)
        results[layout_name] = out
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


def checkpoint_outputs(*, rank: int, checkpoint: str, ckpt_dir: str, batch: dict, ppo: dict, train: dict) -> dict:
    """Train one step at TP2xPP2 and save; continue one step (the reference). Then switch
    the same processes to TP1PP1 (DP4), load the checkpoint into an engine with other
    weights and take the same step, with and without the optimizer state."""
    from megarl.engines.actor import PolicyEngine
    from megarl.engines.distributed import set_model_parallel

    hf_config = _hf_config(checkpoint)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    response_length = batch["response_mask"].shape[1]

    def step(engine) -> dict:
        return engine.update_policy(micro_batch_size=2, shuffle=False, **dp_shard({k: batch[k] for k in keys}), **ppo)

    def eval_log_probs(engine):
        return engine.compute_log_prob(
            response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=False, **inputs
        )[0]

    out: dict = {}
    set_model_parallel(tp=2, pp=2)
    engine = PolicyEngine(hf_config=hf_config, weights=checkpoint, **train)
    out["metrics_1"] = step(engine)
    engine.save_checkpoint(ckpt_dir)
    out["saved_weights"], out["saved_log_probs"] = engine.hf_state_dict(), eval_log_probs(engine)
    out["saved_logits"] = full_logits(engine, inputs)
    out["metrics_2"] = step(engine)
    out["continued_weights"] = engine.hf_state_dict()

    set_model_parallel(tp=1, pp=1)
    for label, load_optimizer in (("resumed", True), ("weights_only", False)):
        resumed = PolicyEngine(hf_config=hf_config, weights=None, seed=99, **train)
        resumed.load_checkpoint(ckpt_dir, load_optimizer=load_optimizer)
        out[f"{label}_log_probs"] = eval_log_probs(resumed)
        out[f"{label}_metrics"] = step(resumed)
        out[f"{label}_weights"] = resumed.hf_state_dict()
    return out


def moe_outputs(
    *, rank: int, layouts: dict, checkpoints: dict[str, str], batch: dict, response_length: int, ckpt_dir: str
) -> dict:
    """The matrix outputs of MoE checkpoints per layout (switched in place), plus the gathered HF
    weights; the first checkpoint is also saved at the first layout with EP > 1 and loaded
    back at every later layout (its log-probs then)."""
    from megarl.engines.actor import PolicyEngine
    from megarl.engines.distributed import parallel_layout, set_model_parallel

    first = next(iter(checkpoints.values()))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    lp_args = dict(response_length=response_length, temperature=1.0, micro_batch_size=4, with_entropy=False, **inputs)
    results, saved = {}, False
    for layout_name, parallel in layouts.items():
        set_model_parallel(**parallel)
        out = {"where": parallel_layout()}
        for name, checkpoint in checkpoints.items():
            out[name] = _model_outputs(checkpoint, batch, response_length)
        engine = PolicyEngine(hf_config=_hf_config(first), weights=first, trainable=False)
        out["weights"] = engine.hf_state_dict()
        if saved:
            engine = PolicyEngine(hf_config=_hf_config(first), weights=None, seed=5, lr=0.0)
            engine.load_checkpoint(ckpt_dir)
            out["loaded_log_probs"] = engine.compute_log_prob(**lp_args)[0]
        elif parallel.get("ep", 1) > 1:
            PolicyEngine(hf_config=_hf_config(first), weights=first, lr=0.0).save_checkpoint(ckpt_dir)
            saved = True
        results[layout_name] = out
    return results
