"""Moving an engine's device memory to host memory and back, between the phases that use it.

On colocated GPUs the rollout servers and the Megatron engines take turns on the
same device (the sleep/wake cycle): while the fleet generates, an engine's
optimizer state (Adam moments and, for a bf16 model, the fp32 main weights inside
the optimizer) lives in host memory, its gradient buffers are freed, and an idle
role's weights move out too. Tensors keep their identity (only `.data` moves), so
the optimizer's per-parameter state and Megatron's `main_grad` views stay valid.
On a CPU-only engine everything is host memory already and these are no-ops.
"""

from __future__ import annotations

import torch

from megarl.engines.optim import TrainState


def _is_on_device(chunks: list[torch.nn.Module]) -> bool:
    return any(param.device.type == "cuda" for chunk in chunks for param in chunk.parameters())


def _move_optimizer(train: TrainState, device: torch.device, *, main_params: bool) -> None:
    for optimizer in train.torch_optimizers():
        if main_params:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.data = param.data.to(device, non_blocking=True)
        for state in optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != device:
                    state[key] = value.to(device, non_blocking=True)


def _grad_buffers(train: TrainState) -> list[torch.Tensor]:
    return [buffer.grad_data for ddp in train.ddp_chunks
            for buffer in [*ddp.buffers, *getattr(ddp, "expert_parallel_buffers", [])]]


def _move_weights(chunks: list[torch.nn.Module], device: torch.device) -> None:
    for chunk in chunks:
        for param in chunk.parameters():
            param.data = param.data.to(device, non_blocking=True)


def offload(chunks: list[torch.nn.Module], train: TrainState | None, *, weights: bool, mixed_precision: bool) -> bool:
    """Optimizer state and gradient buffers (and the weights when `weights`) to host memory.

    Returns whether anything moved (False on a CPU engine). A mixed-precision optimizer's
    parameters are its own fp32 main copies and always move; with an fp32 model they are the
    model's weights, so they move only with `weights`.
    """
    if not _is_on_device(chunks):
        return False
    host = torch.device("cpu")
    if train is not None:
        _move_optimizer(train, host, main_params=weights or mixed_precision)
        for grad_data in _grad_buffers(train):
            grad_data.untyped_storage().resize_(0)
    if weights:
        _move_weights(chunks, host)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return True


def onload(chunks: list[torch.nn.Module], train: TrainState | None) -> None:
    """Everything `offload` moved back to the current device; gradient buffers re-allocated and zeroed."""
    device = torch.device("cuda", torch.cuda.current_device())
    _move_weights(chunks, device)
    if train is not None:
        _move_optimizer(train, device, main_params=True)
        for grad_data in _grad_buffers(train):
            storage = grad_data.untyped_storage()
            if storage.size() == 0:
                storage.resize_(grad_data.numel() * grad_data.element_size())
                grad_data.zero_()
    torch.cuda.synchronize()
