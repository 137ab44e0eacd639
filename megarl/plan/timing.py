"""Step-time estimates per phase: generation, log-prob/value forwards, updates, weight sync.

Every figure is a bound with a stated efficiency, not a measurement:
- generation: a roofline per decode step. Each step a server GPU reads its weights
  once and the KV cache of every running sequence (on average the prompt and half
  the response), at `BANDWIDTH_EFFICIENCY` of the data-sheet bandwidth, and does 2
  FLOPs per weight and attention's 4 x q x context per running sequence, at `mfu`;
  the slower of the two bounds the step (memory at the batch sizes GPUs run,
  compute on a CPU). Prefill is compute-bound (2 FLOPs per weight and prompt token). Responses are
  assumed to run to `max_response_length` (an upper bound; `--synthetic` benches do).
- forwards and updates: model FLOPs (`megarl.bench.flops`, PaLM's 6N / 2N + attention
  convention, no recompute) of every token of the step, over all the role's devices at `mfu`.
- weight sync: the model's bytes once through the transport's bandwidth
  (`TRANSPORT_GBS`; `tensor` moves between processes on the same devices, at the
  device link or, without one, at half the memory bandwidth).
"""

from __future__ import annotations

from dataclasses import dataclass

from megarl.bench.flops import flops_per_token, matmul_weights
from megarl.models.spec import Arch
from megarl.plan.kv_cache import KvPool

BANDWIDTH_EFFICIENCY = 0.7
DEFAULT_MFU = 0.35
# GB/s of the transports that leave the node: a 400 Gb/s NIC per GPU is ~50 GB/s; NCCL broadcast reaches about
# half; disk: a parallel filesystem's write then read by every server.
TRANSPORT_GBS = {"distributed": 25.0, "disk": 2.0}


@dataclass(frozen=True)
class PhaseTime:
    phase: str
    seconds: float
    basis: str


def generation_time(arch: Arch, pool: KvPool, *, prompt_tokens: int, response_tokens: int, tp: int,
                    bandwidth_gbs: float, tflops: float, mfu: float) -> PhaseTime:
    """One step's generation on one server (the servers run in parallel)."""
    if pool.waves == 0:
        return PhaseTime("gen", float("inf"), "no sequence fits the KV pool")
    bandwidth, compute = bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY, tp * tflops * 1e12 * mfu
    context = prompt_tokens + response_tokens / 2
    step_flops = 2 * matmul_weights(arch) + 4 * arch.num_layers * arch.num_attention_heads * arch.head_dim * context
    decode, bound = 0.0, set()
    for wave in range(pool.waves):
        running = min(pool.concurrent, pool.sequences - wave * pool.concurrent)
        memory_s = (pool.weight_bytes + running * context * pool.token_bytes) / bandwidth
        compute_s = running * step_flops / compute
        bound.add("memory" if memory_s >= compute_s else "compute")
        decode += response_tokens * max(memory_s, compute_s)
    prefill = 2 * matmul_weights(arch) * prompt_tokens * pool.sequences / compute
    basis = (f"{pool.waves} wave(s) x {response_tokens} decode steps, {'/'.join(sorted(bound))}-bound (weights + KV "
             f"at {BANDWIDTH_EFFICIENCY:.0%} of {bandwidth_gbs:g} GB/s, FLOPs at {mfu:.0%} MFU); prefill at {mfu:.0%} "
             "MFU")
    return PhaseTime("gen", decode + prefill, basis)


def compute_time(phase: str, arch: Arch, *, tokens: int, seq_len: int, backward: bool, value_head: bool,
                 devices: int, tflops: float, mfu: float, passes: int = 1) -> PhaseTime:
    """A forward (or forward + backward) over `tokens` tokens, `passes` times, on `devices` devices."""
    flops = flops_per_token(arch, seq_len=seq_len, backward=backward, value_head=value_head) * tokens * passes
    seconds = flops / (devices * tflops * 1e12 * mfu)
    return PhaseTime(phase, seconds, f"{flops:.3g} model FLOPs on {devices} device(s) at {mfu:.0%} MFU of "
                                     f"{tflops:g} TFLOP/s")


def sync_time(*, model_bytes: int, transport: str, link_gbs: float, bandwidth_gbs: float) -> PhaseTime:
    """One weight sync of `model_bytes` through `transport`."""
    if transport in TRANSPORT_GBS:
        gbs = TRANSPORT_GBS[transport]
    else:
        gbs = link_gbs or bandwidth_gbs / 2
    return PhaseTime("update_weights", model_bytes / (gbs * 1e9), f"{model_bytes / 2**30:.2f} GiB at {gbs:g} GB/s "
                     f"({transport})")
