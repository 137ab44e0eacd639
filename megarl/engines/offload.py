"""Moving an engine's device memory to host memory and back, between the phases that use it.

On colocated GPUs the rollout servers and the Megatron engines take turns on the
same device (the sleep/wake cycle): while the fleet generates, an engine's optimizer
state (Adam moments and, for a bf16 model, the fp32 main weights inside the
optimizer) lives in host memory, its gradient buffers are freed, and an idle role's
weights move out too. `offload` returns an `Offloaded` record of exactly what it
moved, and `onload` puts each of those back where it was, so tensors that were on
the host before (torch Adam's `step` counters) stay there.

Megatron's gradient buffers go through their own `offload_to_cpu` /
`reload_from_cpu` (`_ParamAndGradBuffer`, megatron-core >= 0.16): they free and
re-allocate the storage under `grad_data`, so `param.main_grad` and the buckets'
views stay valid, and with the distributed optimizer the weights live in the
buffer's `param_data`, which moves as one block with its parameters' views intact.
Every other tensor keeps its identity (only `.data` moves), so the optimizer's
per-parameter state and its fp32 main parameters stay attached. On a CPU-only
engine the host is the device: nothing moves, but the gradient buffers are still
freed until `onload`, so a missing `onload` fails on CPU as it would on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megarl.engines.optim import TrainState


@dataclass
class Offloaded:
    """What `offload` moved off `device`; `onload` undoes exactly this."""

    device: torch.device
    buffers: list = field(default_factory=list)  # megatron _ParamAndGradBuffers, grads (and param_data) offloaded
    params: list[torch.nn.Parameter] = field(default_factory=list)  # moved by `.data`
    states: list[tuple[dict, str]] = field(default_factory=list)  # optimizer state entries moved

    def merge(self, other: Offloaded) -> Offloaded:
        self.buffers += [b for b in other.buffers if all(b is not mine for mine in self.buffers)]
        self.params += other.params
        self.states += other.states
        return self


def _ddp_buffers(train: TrainState) -> list:
    return [buffer for ddp in train.ddp_chunks for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]]


def _device_of(chunks: list[torch.nn.Module], train: TrainState | None) -> torch.device:
    """The device the engine computes on: its model's, or (weights offloaded) the gradient buffers'."""
    for chunk in chunks:
        for param in chunk.parameters():
            if param.device.type != "cpu":
                return param.device
    if train is not None:
        for buffer in _ddp_buffers(train):
            if buffer.grad_data.device.type != "cpu":
                return buffer.grad_data.device
    return torch.device("cpu")


def offload(chunks: list[torch.nn.Module], train: TrainState | None, *, weights: bool) -> Offloaded:
    """Gradient buffers freed, optimizer state and main parameters to host memory (and the weights when
    `weights`); returns what moved. A second call (e.g. with `weights=True`) moves what is still on the device."""
    device, host = _device_of(chunks, train), torch.device("cpu")
    moved = Offloaded(device)
    model_params = {id(param) for chunk in chunks for param in chunk.parameters()}
    in_param_buffers: set[int] = set()
    if train is not None:
        for buffer in _ddp_buffers(train):
            # With the distributed optimizer the weights are views into `param_data`, which
            # moves as a whole; otherwise param_data is None and only the gradients go. On a
            # CPU engine param_data stays: megatron's host copy of it would be the tensor itself.
            buffer.offload_to_cpu(move_params=weights and device.type != "cpu", move_grads=True)
            moved.buffers.append(buffer)
            if buffer.param_data is not None:
                in_param_buffers |= {id(param) for param in buffer.params}
        for optimizer in train.torch_optimizers():
            for group in optimizer.param_groups:
                # The optimizer's own fp32 main copies always go; the model's weights only with `weights`.
                moved.params += [param for param in group["params"] if id(param) not in model_params
                                 and _move(param, host)]
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device != host:
                        state[key] = value.to(host)
                        moved.states.append((state, key))
    if weights:
        moved.params += [param for chunk in chunks for param in chunk.parameters()
                         if id(param) not in in_param_buffers and _move(param, host)]
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return moved


def _move(param: torch.nn.Parameter, device: torch.device) -> bool:
    if param.device == device:
        return False
    param.data = param.data.to(device)
    return True


def onload(moved: Offloaded) -> None:
    """Everything in `moved` back to its device; gradient buffers re-allocated and zeroed."""
    for buffer in moved.buffers:
        buffer.reload_from_cpu(move_params=True, move_grads=True)
    for param in moved.params:
        _move(param, moved.device)
    for state, key in moved.states:
        state[key] = state[key].to(moved.device)
    if moved.device.type == "cuda":
        torch.cuda.synchronize()
