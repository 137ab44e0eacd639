"""Spawn targets for the LoRA engine tests: each runs in an initialised gloo rank and returns plain tensors; the
tests compare them with a `peft`-wrapped HF model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from _engine_workers import dp_shard, full_logits, log_prob_rows
from _settings import batching, optimizer

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def lora_engine(checkpoint: str, settings, *, optim=None, transformer_impl: str = "local", **kwargs):
    """A float32 PolicyEngine with LoRA adapters from an HF checkpoint dir (trainable at lr 0 by default)."""
    from megarl.engines.actor import PolicyEngine

    hf_config = json.loads((Path(checkpoint) / "config.json").read_text())
    return PolicyEngine(hf_config=hf_config, weights=checkpoint, seed=0, params_dtype="float32",
                        transformer_impl=transformer_impl, optimizer=optim or optimizer(lr=0.0),
                        lora_settings=settings, **kwargs)


def adapter_grads(engine) -> dict[str, tuple[int, torch.Tensor]]:
    """{full-layout adapter name: (TP rank, this rank's gradient shard)} (DDP main_grad)."""
    from megatron.core import parallel_state

    from megarl.engines import lora

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for container in lora.containers(engine.model.chunks):
        for adapter in container.by_path.values():
            for part in ("lora_A", "lora_B"):
                grad = getattr(adapter, part).main_grad.detach().clone()
                out[f"{adapter.full_name}.{part}"] = (0 if adapter.expert else tp_rank, grad)
    return out


def frozen_base_facts(engine) -> dict:
    """What shows the base is frozen: parameters with grads or requires_grad outside the adapters, the
    parameters the optimizer holds and the size of DDP's gradient buffers, both against the adapters' size."""
    from megarl.engines import lora

    adapters = {id(p) for c in lora.containers(engine.model.chunks) for p in c.parameters()}
    base = [p for chunk in engine.model.chunks for p in chunk.parameters() if id(p) not in adapters]
    optimized = [p for inner in engine.train.torch_optimizers() for g in inner.param_groups for p in g["params"]]
    buffers = [b for ddp in engine.train.ddp_chunks for b in [*ddp.buffers, *ddp.expert_parallel_buffers]]
    return {
        "base_params": len(base),
        "base_requiring_grad": sum(p.requires_grad for p in base),
        "base_with_grad": sum(p.grad is not None or getattr(p, "main_grad", None) is not None for p in base),
        "optimizer_is_adapters": {id(p) for p in optimized} == adapters and len(optimized) == len(adapters),
        "grad_buffer_numel": sum(b.numel for b in buffers),
        "adapter_numel": sum(p.numel() for c in lora.containers(engine.model.chunks) for p in c.parameters()),
        "optimizer_state_params": sum(len(inner.state) for inner in engine.train.torch_optimizers()),
        "weight_bytes": sum(p.numel() * p.element_size() for chunk in engine.model.chunks for p in chunk.parameters()),
        "train_state_bytes": engine.train_state_bytes(),
    }


def lora_outputs(*, rank: int, layouts: dict, checkpoint: str, settings, adapters: dict, batch: dict,
                 response_length: int) -> dict:
    """Per layout (switched in place): full logits with adapters on and off, log-probs both ways, one SFT step at
    lr 0 on this DP rank's share (loss, grad norm, adapter gradients), the merged HF weights, and the facts
    that show the base is frozen."""
    from megarl.engines import lora
    from megarl.engines.distributed import parallel_layout, set_model_parallel

    inputs = {k: batch[k] for k in SEQUENCE_KEYS}
    rows = log_prob_rows(batch, response_length)
    results = {}
    for name, parallel in layouts.items():
        set_model_parallel(**parallel)
        engine = lora_engine(checkpoint, settings)
        lora.load_full_adapters(engine.model, adapters)
        out = {"where": parallel_layout(), "logits": full_logits(engine, inputs)}
        with lora.adapters_disabled(engine.model):
            out["logits_off"] = full_logits(engine, inputs)
        out["log_probs"], _ = engine.compute_log_prob(rows, temperature=1.0, with_entropy=False, batching=batching(3))
        out["log_probs_off"], _ = engine.compute_log_prob(rows, temperature=1.0, with_entropy=False,
                                                          batching=batching(3), adapters=False)
        out["sft"] = engine.sft_step(dp_shard({**inputs, "loss_mask": batch["loss_mask"]}), batching=batching(2),
                                     lr=0.0)
        out["grads"] = adapter_grads(engine)
        out["frozen"] = frozen_base_facts(engine)
        out["merged"] = engine.hf_state_dict()
        results[name] = out
    return results


def lora_specs_side_by_side(*, rank: int, checkpoint: str, settings, adapters: dict, batch: dict,
                            impls: tuple[str, ...]) -> dict:
    """Per layer spec, the same base weights and adapters: full logits with adapters on and off, one SFT step's
    adapter gradients (lr 0), and whether the spec fused the norms into linear_qkv."""
    from megarl.engines import lora

    inputs = {k: batch[k] for k in SEQUENCE_KEYS}
    out = {}
    for impl in impls:
        engine = lora_engine(checkpoint, settings, transformer_impl=impl)
        lora.load_full_adapters(engine.model, adapters)
        with lora.adapters_disabled(engine.model):
            logits_off = full_logits(engine, inputs)
        sft = engine.sft_step({**inputs, "loss_mask": batch["loss_mask"]}, batching=batching(2), lr=0.0)
        out[impl] = {"logits": full_logits(engine, inputs), "logits_off": logits_off, "sft": sft,
                     "grads": {name: grad for name, (_, grad) in adapter_grads(engine).items()},
                     "fused_norm": any(name.endswith("linear_qkv.layer_norm_weight")
                                       for chunk in engine.model.chunks for name, _ in chunk.named_parameters())}
    return out


def adapters_full(engine) -> dict[str, torch.Tensor]:
    """The engine's adapters in the full layout on every rank (TP shards all-gathered, PP stages shared)."""
    from megatron.core import parallel_state

    from megarl.engines import lora
    from megarl.models.lora import merge_adapter

    mine = {name: t.clone() for (_, name), t in lora.adapter_shards(engine.model).items()}
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (parallel_state.get_tensor_model_parallel_rank(), mine))
    shards: dict[str, dict[int, torch.Tensor]] = {}
    for tp_rank, tensors in gathered:
        for name, tensor in tensors.items():
            shards.setdefault(name, {})[0 if ".experts." in name else tp_rank] = tensor
    return {name: merge_adapter(name, [parts[r] for r in sorted(parts)]) for name, parts in shards.items()}


def adam_moments_full(engine) -> dict[str, torch.Tensor]:
    """Adam's exp_avg_sq of every adapter tensor in the full layout (swapped in for the adapters, gathered)."""
    (optimizer,) = engine.train.torch_optimizers()
    return _swapped_in(engine, lambda param: optimizer.state[param]["exp_avg_sq"])


def adapter_grads_full(engine) -> dict[str, torch.Tensor]:
    """The adapters' accumulated gradients (DDP main_grad) in the full layout."""
    return _swapped_in(engine, lambda param: param.main_grad)


def _swapped_in(engine, tensor_of) -> dict[str, torch.Tensor]:
    from megarl.engines import lora

    params = [p for container in lora.containers(engine.model.chunks) for p in container.parameters()]
    saved = [p.data for p in params]
    for param in params:
        param.data = tensor_of(param)
    try:
        return adapters_full(engine)
    finally:
        for param, data in zip(params, saved):
            param.data = data


def lora_checkpoint_outputs(*, rank: int, checkpoint: str, settings, batch: dict, ckpt_dir: str, train: dict,
                            ppo: dict) -> dict:
    """A LoRA actor takes a PPO step at TP2 and saves; it takes a second step (the reference). Engines with other
    initial adapters then load the checkpoint at TP1 (DP2) and at TP2 and take the same second step. A full-weights
    engine and a frozen follower must refuse the adapters-only checkpoint."""
    from _settings import policy_update
    from megarl.engines.distributed import set_model_parallel
    from megarl.errors import InputError

    keys = ("input_ids", "attention_mask", "position_ids", "response_mask", "old_log_probs", "advantages")
    rows = log_prob_rows(batch, batch["response_mask"].shape[1])

    def step(engine) -> dict:
        return engine.update(dp_shard({k: batch[k] for k in keys}), policy_update(micro_batch_size=2, **ppo))

    out: dict = {}
    set_model_parallel(tp=2, pp=1)
    engine = lora_engine(checkpoint, settings, optim=optimizer(**train))
    out["metrics_1"] = step(engine)
    engine.save_checkpoint(ckpt_dir)
    out["saved_adapters"] = adapters_full(engine)
    out["saved_moments"] = adam_moments_full(engine)
    out["saved_logits"] = full_logits(engine, {k: batch[k] for k in SEQUENCE_KEYS})
    out["saved_log_probs"] = engine.compute_log_prob(rows, temperature=1.0, with_entropy=False,
                                                     batching=batching(4))[0]
    out["metrics_2"] = step(engine)
    out["continued_adapters"] = adapters_full(engine)
    out["continued_grads"], out["continued_moments"] = adapter_grads_full(engine), adam_moments_full(engine)

    for label, parallel in (("tp1", dict(tp=1, pp=1)), ("tp2", dict(tp=2, pp=1))):
        set_model_parallel(**parallel)
        resumed = lora_engine(checkpoint, replace(settings, seed=settings.seed + 17), optim=optimizer(**train))
        resumed.load_checkpoint(ckpt_dir, load_optimizer=True)
        out[f"{label}_loaded_adapters"] = adapters_full(resumed)
        out[f"{label}_loaded_moments"] = adam_moments_full(resumed)
        out[f"{label}_metrics"] = step(resumed)
        out[f"{label}_adapters"] = adapters_full(resumed)
        out[f"{label}_grads"] = adapter_grads_full(resumed)

    def refusal(load) -> str | None:
        try:
            load()
        except InputError as error:
            return str(error)
        return None

    full = lora_engine(checkpoint, None, optim=optimizer(**train))
    wider = lora_engine(checkpoint, replace(settings, rank=settings.rank * 2), optim=optimizer(**train))
    frozen = lora_engine(checkpoint, None, optim=None)
    out["refusals"] = [refusal(lambda: full.load_checkpoint(ckpt_dir, load_optimizer=True)),
                       refusal(lambda: wider.load_checkpoint(ckpt_dir, load_optimizer=True)),
                       refusal(lambda: frozen.load_policy_checkpoint(ckpt_dir))]
    return out


def lora_sync_pushes(*, rank: int, checkpoint: str, settings, versions: dict, api_key: str,
                     disk_dir: str, prompts: list[list[int]], steps: int) -> dict:
    """A TP2 LoRA actor behind its `MegatronWorker` pushes each version's adapters (`versions`: version -> (full
    adapters, {server: (url, weight_sync.lora, transport)})) as the controller does. After each version, rank 0
    asks every server for greedy continuations of `prompts` (naming the version's adapter where the sync was
    adapter-only). Returns rank 0's sync metrics and outputs per (version, server)."""
    from megarl.cluster.engine_worker import MegatronWorker
    from megarl.config.settings import WeightSyncSettings
    from megarl.engines import lora
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.weight_wire import lora_adapter_name

    worker = MegatronWorker(rank=rank, world_size=2)
    worker.engine = lora_engine(checkpoint, settings)
    metrics, outputs = {}, {}
    for version, (adapters, targets) in versions.items():
        lora.load_full_adapters(worker.engine.model, adapters)
        for server, (url, sync, transport) in targets.items():
            sync_settings = WeightSyncSettings(transport=transport, bucket_bytes=50_000, verify="none", timeout_s=60,
                                               disk_dir=disk_dir, lora=sync)
            metrics[(version, server)] = worker.push_weights(urls=[url], api_key=api_key, version=version,
                                                             settings=sync_settings)
            if rank == 0:
                body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": steps, "temperature": 0.0},
                        "return_logprob": True}
                if sync == "adapter":
                    body["lora_path"] = lora_adapter_name(version)
                with RolloutClient([url], api_key=api_key, timeout_s=60) as client:
                    outputs[(version, server)] = client.run(client.request(url, "POST", "/generate", body))
    worker.close_weight_sync()
    return {"metrics": metrics, "outputs": outputs}
