"""What the engines allocate, counted tensor by tensor, for `test_plan_bytes` (runs in spawned engine ranks).

One set of processes walks several layouts (`set_model_parallel` switches them;
start-up dominates): at each, a trainable policy engine and a value engine are built
as `megarl train` builds them, Adam's moments are created in place (megatron's own
`init_state_fn`, no step needed), and the bytes of the weights, of the DDP gradient
buffers and of the optimizer's tensors (moments, and master weights that are not
model storage) are summed. With `distributed_optimizer` a megatron optimizer with
`use_distributed_optimizer=True` is built over the same model chunks.
"""

from __future__ import annotations

import torch

from _settings import optimizer


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(megatron_optimizer, model_storages: set[int]) -> int:
    total = 0
    for inner in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
        inner.init_state_fn(inner.optimizer, inner.config)
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state[param]
                total += _bytes(state[key] for key in ("exp_avg", "exp_avg_sq"))
                if param.untyped_storage().data_ptr() not in model_storages:
                    total += _bytes([param])  # a float32 master copy (or shard) of a 16-bit weight
    return total


def _count(chunks, ddp_chunks, megatron_optimizer) -> dict[str, int]:
    params = [p for chunk in chunks for p in chunk.parameters()]
    buffers = [b for ddp in ddp_chunks for b in ddp.buffers + ddp.expert_parallel_buffers]
    storages = {p.untyped_storage().data_ptr() for p in params}
    return {"weights": _bytes(params), "gradients": _bytes(b.grad_data for b in buffers),
            "optimizer": _optimizer_bytes(megatron_optimizer, storages)}


def _distributed_optimizer_bytes(engine) -> dict[str, int]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = engine.model.config
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    ddp_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk)
                  for chunk in engine.model.chunks]
    megatron_optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, bf16=config.bf16, fp16=config.fp16,
                        params_dtype=config.params_dtype, use_distributed_optimizer=True), ddp_chunks)
    return _count([ddp.module for ddp in ddp_chunks], ddp_chunks, megatron_optimizer)


def allocated_bytes(*, rank: int, cases: list[dict]) -> list[dict]:
    """For each case {hf_config, tp, pp, vpp, ep, dtype, head ("lm" | "value"), distributed_optimizer}: this rank's
    counted bytes."""
    from megarl.engines.actor import PolicyEngine
    from megarl.engines.critic import ValueEngine
    from megarl.engines.distributed import set_model_parallel

    results = []
    for case in cases:
        set_model_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), ep=case.get("ep", 1))
        kind = ValueEngine if case["head"] == "value" else PolicyEngine
        engine = kind(hf_config=case["hf_config"], weights=None, seed=1, params_dtype=case["dtype"],
                      transformer_impl="local", optimizer=optimizer(lr=1e-3))
        if case.get("distributed_optimizer"):
            counted = _distributed_optimizer_bytes(engine)
        else:
            counted = _count(engine.model.chunks, engine.train.ddp_chunks, engine.train.optimizer)
        results.append(counted)
        del engine
    torch.distributed.barrier()
    return results
