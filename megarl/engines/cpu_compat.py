"""Process-wide CPU compatibility layer for megatron-core (CPU-only machines).

Megatron-core hard-codes CUDA in dozens of call sites (`device=torch.cuda.current_device()`,
`tensor.cuda()`, CUDA RNG state, streams/events, `param.type() == 'torch.cuda.FloatTensor'`).
No config flag avoids them, so on a machine without CUDA `install()` rewrites them to
CPU: a TorchFunctionMode for device arguments plus a few `torch.cuda` stubs, two
megatron RNG hooks and the MoE all-to-all's split sizes as lists for gloo. Call it
before importing megatron; it is idempotent and a no-op when CUDA is available (GPU
runs use megatron unmodified with NCCL).

The function mode lives on a thread-local stack in torch, so `install()` pushes it on
the calling thread only; engines call it again at every entry point (cheap) because
Ray may run actor methods on a different thread than the one that built the model.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

_STUBS_LOCK = threading.Lock()
_stubs_installed = False
_hooks_installed = False

# Tensor.type() names megatron's optimizer and grad clipping assert on.
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _to_cpu_device(device):
    """Map "cuda", "cuda:N", torch.device("cuda") and bare GPU indices to CPU; leave the rest."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _is_device_like(value) -> bool:
    return isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool))


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.autograd.backward, torch.Tensor.backward):
            return self._backward_with_mode(func, args, kwargs)
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _CUDA_TYPE_NAMES.get(args[0].dtype, func(*args))
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_device_like(args[1]):
            args = (args[0], _to_cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)

    def _backward_with_mode(self, func, args, kwargs):
        # torch disables a mode inside its own handler, so a plain func(*args) would run the
        # whole backward pass (incl. megatron's custom autograd Functions that allocate
        # buffers with device=cuda) un-rewritten. Run the engine ourselves with the mode on.
        if func is torch.Tensor.backward:
            tensor, *rest = args
            names = ("gradient", "retain_graph", "create_graph", "inputs")
            call = dict(zip(names, rest), **kwargs)
            tensors, grads = (tensor,), (call.get("gradient"),)
            retain_graph, create_graph = call.get("retain_graph"), call.get("create_graph", False)
            inputs = call.get("inputs")
        else:
            names = ("tensors", "grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
            call = dict(zip(names, args), **kwargs)
            tensors = call["tensors"]
            tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
            grads = call.get("grad_tensors")
            grads = (grads,) if grads is None or isinstance(grads, torch.Tensor) else tuple(grads)
            if len(grads) == 1 and len(tensors) > 1 and grads[0] is None:
                grads = (None,) * len(tensors)
            retain_graph, create_graph = call.get("retain_graph"), call.get("create_graph", False)
            inputs = call.get("inputs")
        inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
        grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
        if retain_graph is None:
            retain_graph = create_graph
        with self:
            torch.autograd.graph._engine_run_backward(
                tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True
            )


class _DummyStream:
    """Stands in for torch.cuda.Stream: work on CPU is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _DummyEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _DummyEvent:
    """Stands in for torch.cuda.Event (used by DDP overlap, MoE alltoall and inference timing)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _install_cuda_stubs() -> None:
    cuda = torch.cuda
    # Megatron asks for "the current GPU" to place every buffer; the mode maps index 0 to CPU.
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda device=None: None
    cuda.empty_cache = lambda: None
    # RNG: megatron's RNG tracker saves/restores "the CUDA generator"; on CPU that is the
    # default generator. torch.manual_seed would call back into cuda.manual_seed_all and
    # recurse, so seed the generator object directly.
    cuda.get_rng_state = lambda device="cuda": torch.default_generator.get_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.default_generator.set_state(new_state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.manual_seed = cuda.manual_seed
    # Streams and events: DDP and the pipeline schedules create them unconditionally.
    cuda.Stream = _DummyStream
    cuda.Event = _DummyEvent
    cuda.current_stream = lambda device=None: _DummyStream()
    cuda.default_stream = lambda device=None: _DummyStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = lambda stream: None


def _cpu_rng_state(device="cuda", clone=False, graph_safe=False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device=-1, graph_safe=False) -> None:
    torch.default_generator.set_state(new_state)


def _as_int_list(split_sizes):
    if split_sizes is None or isinstance(split_sizes, list):
        return split_sizes
    return [int(size) for size in split_sizes]


def _install_megatron_hooks() -> None:
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as tp_random

    # The RNG tracker reads/writes generator state through these private helpers, which
    # go straight to torch.cuda.default_generators (empty on a CPU build).
    tp_random._get_cuda_rng_state = _cpu_rng_state
    tp_random._set_cuda_rng_state = _set_cpu_rng_state

    # The MoE all-to-all token dispatcher passes its split sizes as tensors; gloo's
    # all_to_all_single only takes Python int sequences.
    all_to_all_forward = mappings._AllToAll.forward

    def forward(ctx, group, input, output_split_sizes, input_split_sizes):
        return all_to_all_forward(ctx, group, input, _as_int_list(output_split_sizes), _as_int_list(input_split_sizes))

    mappings._AllToAll.forward = staticmethod(forward)


def _mode_active() -> bool:
    return any(isinstance(m, _CudaToCpuMode) for m in torch.overrides._get_current_function_mode_stack())


def cpu_mode_needed() -> bool:
    """True on a machine without CUDA, where megatron needs this layer."""
    return not torch.cuda.is_available()


def install_stubs() -> None:
    """The process-wide part (torch.cuda stubs) only; `import megarl.engines` runs it so the
    stubs exist before any engines module imports megatron. No-op when CUDA is available."""
    global _stubs_installed
    if not cpu_mode_needed():
        return
    with _STUBS_LOCK:
        if not _stubs_installed:
            _install_cuda_stubs()
            _stubs_installed = True


def install() -> None:
    """Install the CPU layer for this process and push the device mode on the calling thread.

    Idempotent (per process for the stubs and hooks, per thread for the mode); does
    nothing when CUDA is available.
    """
    global _hooks_installed
    if not cpu_mode_needed():
        return
    install_stubs()
    with _STUBS_LOCK:
        if not _hooks_installed:
            _install_megatron_hooks()
            _hooks_installed = True
    if not _mode_active():
        _CudaToCpuMode().__enter__()
