"""Spawn targets for the engine tests: each runs inside an initialised gloo rank and
returns plain tensors/dicts; all assertions against references happen in the tests."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import torch

from _settings import batching, optimizer, policy_update


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


def _gathered_per_param(engine, tensor_of) -> dict[str, torch.Tensor]:
    """`tensor_of(param)` for every parameter, in HF names, gathered like weights (collective over TP/PP):
    each parameter's data is swapped for that tensor for the gather, then back."""
    params = [p for chunk in engine.train.ddp_chunks for p in chunk.module.parameters()]
    weights = [p.data for p in params]
    for param in params:
        param.data = tensor_of(param).to(param.dtype)
    try:
        return engine.hf_state_dict()
    finally:
        for param, weight in zip(params, weights):
            param.data = weight


def gathered_grads(engine) -> dict[str, torch.Tensor]:
    """The accumulated gradients (DDP main_grad) in HF names."""
    return _gathered_per_param(engine, lambda param: param.main_grad)


def gathered_adam_state(engine, key: str) -> dict[str, torch.Tensor]:
    """Adam's `key` ("exp_avg" or "exp_avg_sq") per parameter in HF names (an fp32 model: the optimizer's
    parameters are the model's)."""
    (optimizer,) = engine.train.torch_optimizers()
    return _gathered_per_param(engine, lambda param: optimizer.state[param][key])


def dp_shard(batch: dict) -> dict:
    """This DP rank's contiguous share of every `[B, ...]` tensor in `batch`."""
    from megatron.core import parallel_state

    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return {key: value.chunk(dp_size)[dp_rank] for key, value in batch.items()}


# Token budgets of the packed runs: at 12 the longest row (13 tokens) exceeds the budget.
PACKED_LOG_PROB_TOKENS, PACKED_TRAIN_TOKENS = 12, 16


def policy_engine(checkpoint: str | None, *, optim=None, seed: int = 0, hf_config: dict | None = None):
    """A float32 PolicyEngine from an HF checkpoint dir (None: random weights from `seed`); frozen without `optim`."""
    from megarl.engines.actor import PolicyEngine

    return PolicyEngine(hf_config=hf_config or _hf_config(checkpoint), weights=checkpoint, seed=seed,
                        params_dtype=None, transformer_impl="local", optimizer=optim)


def log_prob_rows(batch: dict, response_length: int) -> dict:
    """The rows a log-prob forward reads: the sequences plus a `responses` tensor of the response width."""
    rows = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    rows["responses"] = batch["input_ids"][:, batch["input_ids"].shape[1] - response_length :]
    return rows


def _model_outputs(checkpoint: str, batch: dict, response_length: int) -> dict:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    engine = policy_engine(checkpoint, optim=optimizer(lr=0.0))
    rows = log_prob_rows(batch, response_length)
    log_probs, entropy = engine.compute_log_prob(rows, temperature=1.0, with_entropy=True, batching=batching(3))
    log_probs_t, none = engine.compute_log_prob(rows, temperature=0.7, with_entropy=False, batching=batching(4))
    packed_log_probs, packed_entropy = engine.compute_log_prob(
        rows, temperature=1.0, with_entropy=True, batching=batching(3, PACKED_LOG_PROB_TOKENS)
    )
    shard = dp_shard({**inputs, "loss_mask": batch["loss_mask"]})
    sft = engine.sft_step(shard, batching=batching(1), lr=0.0)  # lr = 0: the weights stay
    grads = gathered_grads(engine)
    packed_sft = engine.sft_step(shard, batching=batching(1, PACKED_TRAIN_TOKENS), lr=0.0)
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
    engine = policy_engine(checkpoint, optim=optimizer(lr=0.0))
    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    shard = dp_shard({key: batch[key] for key in (*keys, "ref_log_prob")})
    metrics = engine.update(shard, policy_update(micro_batch_size=1, **ppo))
    grads = gathered_grads(engine)
    packed_metrics = engine.update(shard, policy_update(micro_batch_size=1, max_tokens=PACKED_TRAIN_TOKENS, **ppo))
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


def actor_outputs(*, rank: int, checkpoint: str, batch: dict, ppo: dict, sft_batch: dict, other_weights: dict,
                  other_losses: dict) -> dict:
    """Everything the actor tests assert on, from one process (three engines); `other_losses` maps a label to
    the loss settings (over `ppo`) whose gradient the test also reads."""
    out: dict = {}
    response_length = batch["response_mask"].shape[1]
    lp_rows = log_prob_rows(batch, response_length)

    reference = policy_engine(checkpoint)
    out["ref_requires_grad"] = any(p.requires_grad for c in reference.model.chunks for p in c.parameters())
    out["ref_lp_before"], _ = reference.compute_log_prob(lp_rows, temperature=1.0, with_entropy=False,
                                                         batching=batching(4))

    # Gradients at fixed weights (lr = 0): one micro-batch, two, and an uneven split with padding.
    grad_engine = policy_engine(checkpoint, optim=optimizer(lr=0.0))
    rows = batch["input_ids"].shape[0]
    for label, micro in (("grads_1mb", rows), ("grads_2mb", rows // 2), ("grads_uneven", 4)):
        metrics = grad_engine.update(batch, policy_update(micro_batch_size=micro, **ppo))
        out[label] = _hf_grads(grad_engine)
        out[label + "_metrics"] = metrics
    for label, loss in other_losses.items():
        metrics = grad_engine.update(batch, policy_update(micro_batch_size=rows // 2, **{**ppo, **loss}))
        out[label] = _hf_grads(grad_engine)
        out[label + "_metrics"] = metrics

    out["sft_loss_at_checkpoint"] = grad_engine.sft_step(sft_batch, batching=batching(4), lr=0.0)["sft/loss"]

    # One real update on the same batch.
    actor = policy_engine(checkpoint, optim=optimizer(lr=1e-3, clip_grad=1.0))
    out["weights_before"] = actor.hf_state_dict()
    lp0, entropy0 = actor.compute_log_prob(lp_rows, temperature=1.0, with_entropy=True, batching=batching(4))
    update_batch = {**batch, "old_log_probs": lp0}
    out["lp_before"], out["entropy_before"] = lp0, entropy0
    plain_ppo = {**ppo, "entropy_coeff": 0.0, "use_kl_loss": False}
    out["update_metrics"] = actor.update(update_batch, policy_update(micro_batch_size=4, shuffle=True, seed=7,
                                                                     **plain_ppo))
    out["lp_after"], _ = actor.compute_log_prob(lp_rows, temperature=1.0, with_entropy=False, batching=batching(4))
    out["weights_after"] = actor.hf_state_dict()

    out["sft_metrics"] = [actor.sft_step(sft_batch, batching=batching(3), lr=1e-2) for _ in range(5)]
    out["lr_after_sft"] = actor.train.optimizer.param_groups[0]["lr"]

    actor.load_hf_state_dict(other_weights)
    out["reloaded"] = actor.hf_state_dict()

    # The sleep/wake cycle between phases: on a CPU engine the memory is host memory already.
    reference.offload(weights=True)
    actor.offload(weights=False)
    reference.onload()
    actor.onload()
    out["reloaded_after_cycle"] = actor.hf_state_dict()
    out["ref_lp_after"], _ = reference.compute_log_prob(lp_rows, temperature=1.0, with_entropy=False,
                                                        batching=batching(4))
    out["ref_weights_after"] = reference.hf_state_dict()
    try:
        reference.update(update_batch, policy_update(micro_batch_size=4))
        out["ref_update_error"] = None
    except NotImplementedError as error:
        out["ref_update_error"] = str(error)

    # A diverged step (NaN advantages: NaN loss and gradient) stops there, naming what went non-finite.
    from megarl.engines.engine_base import TrainingDiverged

    diverging = {**update_batch, "advantages": torch.full_like(update_batch["advantages"], float("nan"))}
    try:
        grad_engine.update(diverging, policy_update(micro_batch_size=rows, **plain_ppo))
        out["diverged"] = None
    except TrainingDiverged as error:
        out["diverged"] = str(error)
    return out


def checkpoint_outputs(*, rank: int, checkpoint: str, ckpt_dir: str, batch: dict, ppo: dict, train: dict) -> dict:
    """Train one step at TP2xPP2 and save; continue one step (the reference). Then switch
    the same processes to TP1PP1 (DP4), load the checkpoint into an engine with other
    weights and take the same step, with and without the optimizer state."""
    from megarl.engines.distributed import set_model_parallel

    hf_config = _hf_config(checkpoint)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    lp_rows = log_prob_rows(batch, batch["response_mask"].shape[1])

    def step(engine) -> dict:
        return engine.update(dp_shard({k: batch[k] for k in keys}), policy_update(micro_batch_size=2, **ppo))

    def eval_log_probs(engine):
        return engine.compute_log_prob(lp_rows, temperature=1.0, with_entropy=False, batching=batching(4))[0]

    def draws() -> list[torch.Tensor]:
        """The next numbers of this rank's torch generator and of megatron's model-parallel RNG stream."""
        from megatron.core import tensor_parallel

        with tensor_parallel.get_cuda_rng_tracker().fork():
            tracked = torch.rand(3)
        return [torch.rand(3), tracked]

    out: dict = {}
    set_model_parallel(tp=2, pp=2)
    engine = policy_engine(checkpoint, optim=optimizer(**train))
    out["metrics_1"] = step(engine)
    engine.save_checkpoint(ckpt_dir)
    # What a save leaves running in this rank: megatron's writers are joined; its spawn-started results
    # Manager (a process of its own) must not have been started (megarl.engines.checkpoint).
    out["children_after_save"] = [child.name for child in multiprocessing.active_children()]
    out["rng_after_save"] = draws()
    out["saved_weights"], out["saved_log_probs"] = engine.hf_state_dict(), eval_log_probs(engine)
    out["saved_logits"] = full_logits(engine, inputs)
    out["saved_moments"] = {key: gathered_adam_state(engine, key) for key in ("exp_avg", "exp_avg_sq")}
    out["metrics_2"] = step(engine)
    out["continued_weights"] = engine.hf_state_dict()
    out["continued_grads"] = gathered_grads(engine)
    out["continued_exp_avg_sq"] = gathered_adam_state(engine, "exp_avg_sq")

    set_model_parallel(tp=1, pp=1)
    for label, load_optimizer in (("resumed", True), ("weights_only", False)):
        resumed = policy_engine(None, optim=optimizer(**train), seed=99, hf_config=hf_config)
        draws()  # moves the streams off the freshly seeded state the saving engine also started from
        resumed.load_checkpoint(ckpt_dir, load_optimizer=load_optimizer)
        out[f"{label}_rng"] = draws()
        out[f"{label}_loaded_weights"] = resumed.hf_state_dict()
        if load_optimizer:
            out["loaded_moments"] = {key: gathered_adam_state(resumed, key) for key in ("exp_avg", "exp_avg_sq")}
        out[f"{label}_log_probs"] = eval_log_probs(resumed)
        out[f"{label}_metrics"] = step(resumed)
        out[f"{label}_weights"] = resumed.hf_state_dict()
        out[f"{label}_grads"] = gathered_grads(resumed)
    out.update(_followers_of(ckpt_dir, hf_config))  # at TP1PP1 too: every rank holds the critic's head

    set_model_parallel(tp=2, pp=2)  # back at the saved layout, the RNG streams come back too
    again = policy_engine(None, optim=optimizer(**train), seed=7, hf_config=hf_config)
    draws()  # as above
    again.load_checkpoint(ckpt_dir, load_optimizer=True)
    out["same_layout_rng"] = draws()
    out.update(_fused_reference(again, checkpoint, step=step, eval_log_probs=eval_log_probs))
    return out


def _fused_reference(actor, checkpoint: str, *, step, eval_log_probs) -> dict:
    """A frozen reference built beside a trainable actor in the same process and process group (the fused
    actor-reference worker, `MegatronWorker.init_reference`): its log-probs around one update of the actor and
    one offload/onload of its own, the actor's metrics of that update, and both after `copy_weights_from`."""
    reference = policy_engine(checkpoint, optim=None)
    out = {"fused_ref_before": eval_log_probs(reference)}
    out["fused_actor_metrics"] = step(actor)
    out["fused_ref_after_update"] = eval_log_probs(reference)
    reference.offload(weights=True)
    reference.onload()
    out["fused_ref_after_onload"] = eval_log_probs(reference)
    reference.copy_weights_from(actor)
    out["fused_ref_copied"], out["fused_actor_log_probs"] = eval_log_probs(reference), eval_log_probs(actor)
    return out


def _followers_of(ckpt_dir: str, hf_config: dict) -> dict:
    """A frozen reference and a critic (other seeds) loading the policy checkpoint's weights, and the keys the
    checkpoint's tensors are stored under."""
    from megarl.engines.checkpoint import sharded_model_state
    from megarl.engines.critic import ValueEngine

    reference = policy_engine(None, optim=None, seed=98, hf_config=hf_config)
    reference.load_policy_checkpoint(ckpt_dir)
    critic = ValueEngine(hf_config=hf_config, weights=None, seed=97, head_init_std=0.1, params_dtype=None,
                         transformer_impl="local", optimizer=optimizer(lr=1e-3))
    head_before = [t.detach().clone() for t in (critic.value_head.weight, critic.value_head.bias)]
    critic.load_policy_checkpoint(ckpt_dir)
    keys = sorted(item.key for chunk in sharded_model_state(reference.model).values() for item in chunk.values())
    return {"reference_loaded_weights": reference.hf_state_dict(), "critic_loaded_weights": critic.hf_state_dict(),
            "critic_head": (head_before, [critic.value_head.weight.detach(), critic.value_head.bias.detach()]),
            "checkpoint_keys": keys}


def moe_outputs(
    *, rank: int, layouts: dict, checkpoints: dict[str, str], batch: dict, response_length: int, ckpt_dir: str
) -> dict:
    """The matrix outputs of MoE checkpoints per layout (switched in place), plus the gathered HF
    weights; the first checkpoint is also saved at the first layout with EP > 1 and loaded
    back at every later layout (its log-probs then)."""
    from megarl.engines.checkpoint import sharded_model_state
    from megarl.engines.distributed import parallel_layout, set_model_parallel

    first = next(iter(checkpoints.values()))
    lp_rows = log_prob_rows(batch, response_length)
    results, saved = {}, False
    for layout_name, parallel in layouts.items():
        set_model_parallel(**parallel)
        out = {"where": parallel_layout()}
        for name, checkpoint in checkpoints.items():
            out[name] = _model_outputs(checkpoint, batch, response_length)
        engine = policy_engine(first)
        out["weights"] = engine.hf_state_dict()
        out["checkpoint_keys"] = sorted(item.key for chunk in sharded_model_state(engine.model).values()
                                        for item in chunk.values())
        if saved:
            engine = policy_engine(None, optim=optimizer(lr=0.0), seed=5, hf_config=_hf_config(first))
            engine.load_checkpoint(ckpt_dir, load_optimizer=True)
            out["loaded_log_probs"] = engine.compute_log_prob(lp_rows, temperature=1.0, with_entropy=False,
                                                              batching=batching(4))[0]
        elif parallel.get("ep", 1) > 1:
            policy_engine(first, optim=optimizer(lr=0.0)).save_checkpoint(ckpt_dir)
            saved = True
        results[layout_name] = out
    return results


def _optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """The optimizer's parameters (fp32 main copies for a bf16 model) and its per-parameter state tensors."""
    tensors = {}
    for i, inner in enumerate(engine.train.torch_optimizers()):
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                tensors[f"opt{i}.{g}.{j}"] = param
                for key, value in inner.state.get(param, {}).items():
                    if torch.is_tensor(value):
                        tensors[f"opt{i}.{g}.{j}.{key}"] = value
    return tensors


def _engine_tensors(engine) -> dict[str, tuple[torch.Tensor, str]]:
    """Every weight and optimizer tensor of `engine`: (a host copy, the device it lives on)."""
    named = {f"model.{name}": p for chunk in engine.model.chunks for name, p in chunk.named_parameters()}
    named.update(_optimizer_tensors(engine))
    return {name: (t.detach().cpu().clone(), str(t.device)) for name, t in named.items()}


def _grad_storage_bytes(engine) -> list[int]:
    return [buffer.grad_data.untyped_storage().nbytes() for ddp in engine.train.ddp_chunks
            for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]]


def offload_cycle(*, rank: int, hf_config: dict, batch: dict, params_dtype: str, ppo: dict) -> dict:
    """An actor trains a step, offloads (optimizer first, then the weights too), onloads and trains on; a twin
    that never offloads takes the same steps. Returns both engines' tensors around the cycle, the gradient
    buffers' storage sizes and the device memory at each point (None on CPU)."""
    from megarl.engines.actor import PolicyEngine

    def make():
        return PolicyEngine(hf_config=hf_config, weights=None, seed=3, params_dtype=params_dtype,
                            transformer_impl="local", optimizer=optimizer(lr=1e-2, clip_grad=1.0))

    def device_bytes():
        return torch.cuda.memory_allocated() if torch.cuda.is_available() else None

    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    rows, settings = {k: batch[k] for k in keys}, policy_update(micro_batch_size=2, **ppo)
    twin, cycled = make(), make()
    out = {"twin_first": twin.update(rows, settings), "first": cycled.update(rows, settings)}
    out["before"], out["grad_bytes_before"], out["bytes_before"] = (
        _engine_tensors(cycled), _grad_storage_bytes(cycled), device_bytes())
    cycled.offload(weights=False)
    out["bytes_optimizer_offloaded"] = device_bytes()
    cycled.offload(weights=True)  # the second call takes what is still on the device: the weights
    out["offloaded_devices"] = {name: device for name, (_, device) in _engine_tensors(cycled).items()}
    out["grad_bytes_offloaded"], out["bytes_offloaded"] = _grad_storage_bytes(cycled), device_bytes()
    cycled.onload()
    out["after"], out["grad_bytes_after"], out["bytes_after"] = (
        _engine_tensors(cycled), _grad_storage_bytes(cycled), device_bytes())
    out["second"], out["twin_second"] = cycled.update(rows, settings), twin.update(rows, settings)
    out["weights"], out["twin_weights"] = cycled.hf_state_dict(), twin.hf_state_dict()
    return out


def layer_specs_side_by_side(*, rank: int, checkpoint: str, batch: dict, impls: tuple[str, ...]) -> dict:
    """Per layer spec, the same HF weights: full logits, one SFT step's gradients (lr 0) in HF names, and the
    parameter names the spec built."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    out = {}
    for impl in impls:
        engine = spec_engine(checkpoint, impl)
        sft = engine.sft_step({**inputs, "loss_mask": batch["loss_mask"]}, batching=batching(2), lr=0.0)
        out[impl] = {"logits": full_logits(engine, inputs), "sft": sft, "grads": gathered_grads(engine),
                     "names": [name for chunk in engine.model.chunks for name, _ in chunk.named_parameters()],
                     "resolved": engine.model.transformer_impl}
    return out


def spec_engine(checkpoint: str, transformer_impl: str):
    """A float32 trainable PolicyEngine (lr 0) from `checkpoint` with the given layer spec."""
    from megarl.engines.actor import PolicyEngine

    return PolicyEngine(hf_config=_hf_config(checkpoint), weights=checkpoint, seed=0, params_dtype="float32",
                        transformer_impl=transformer_impl, optimizer=optimizer(lr=0.0))


def packed_attention_against_loop(*, rank: int, cu_seqlens: list[int], total: int) -> dict:
    """`PackedDotProductAttention` on one packed row (GQA: 4 heads, 2 KV groups) beside a plain loop that
    calls megatron's `DotProductAttention` once per sequence (zeros for the row padding): both contexts and
    the gradients of q, k, v under the same random upstream gradient."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megarl.engines.attention import PackedDotProductAttention, packed_seq_params

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0)
    torch.manual_seed(0)
    qkv = [torch.randn(total, 1, heads, 16, requires_grad=True) for heads in (4, 2, 2)]
    upstream = torch.randn(total, 1, 64)
    bounds = torch.tensor(cu_seqlens)
    out = {}
    for name, cls in (("packed", PackedDotProductAttention), ("loop", DotProductAttention)):
        attention = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        if name == "packed":
            context = attention(*qkv, None, packed_seq_params=packed_seq_params(bounds))
        else:
            pieces = [attention(*(t[start:end] for t in qkv), None)
                      for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]) if end > start]
            context = torch.cat(pieces + [torch.zeros(total - cu_seqlens[-1], 1, 64)])
        # An empty bin's context is constant zeros, so it has no graph and no gradient reaches q, k, v.
        grads = torch.autograd.grad(context, qkv, upstream, allow_unused=True) if context.requires_grad else [None] * 3
        out[name] = {"context": context.detach(),
                     "grads": [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(grads, qkv)]}
    return out
