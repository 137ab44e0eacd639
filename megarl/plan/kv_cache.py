"""SGLang's KV-cache pool on one rollout server's GPU, and the tokens it holds against what a step asks for.

SGLang sizes the pool once, at start-up (`mem_cache/kv_cache_configurator.py` in
0.5.23): it measures the memory free before it loads its weights (F, after its own
CUDA context), loads them, and keeps `(1 - mem_fraction_static) x F` of what is then
free for activations and graphs: the pool is `mem_fraction_static x F - weights`, and
SGLang refuses to start when that is not positive. So `mem_fraction_static` is a share
of what the device has free when that server starts, not of its capacity: a second
server on the same device (a judge beside the rollout) takes its share of what the
first one left.
Each token of the pool costs, per GPU, K and V of every layer for the GPU's share
of the KV heads (heads are replicated when TP exceeds them) in the model dtype.
A step asks each server for `train_batch_size x n / num_servers` sequences of up to
`max_prompt_length + max_response_length` tokens; fewer fit at once when the pool
is short, and the rest wait (SGLang queues, it does not fail), so the plan reports
the waves a full-length batch needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megarl.models.spec import Arch
from megarl.plan.memory import DTYPE_BYTES
from megarl.plan.params import model_params

# What a CUDA context and the libraries' workspaces hold outside torch's allocator, per process on a device.
CONTEXT_BYTES = 1 << 29


def kv_bytes_per_token(arch: Arch, *, tp: int, dtype: str) -> int:
    """Bytes one cached token takes on one GPU of a TP-`tp` server."""
    heads = max(1, arch.num_query_groups // tp)
    return 2 * arch.num_layers * heads * arch.head_dim * DTYPE_BYTES[dtype]


def server_weight_bytes(arch: Arch, *, tp: int, dtype: str) -> int:
    """Weights on one GPU of a TP-`tp` server (everything split over TP but the norms, a rounding here)."""
    return model_params(arch) * DTYPE_BYTES[dtype] // tp


@dataclass(frozen=True)
class KvPool:
    """One server GPU's pool: `bytes`, `tokens` it holds (of `free_bytes` free at the server's start), and the
    step's need of that server."""

    weight_bytes: int
    free_bytes: int
    bytes: int
    tokens: int
    token_bytes: int
    sequences: int
    sequence_tokens: int
    max_running: int

    @property
    def needed_tokens(self) -> int:
        """Tokens the server's sequences of one step hold at their longest, all at once."""
        return self.sequences * self.sequence_tokens

    @property
    def concurrent(self) -> int:
        """Sequences that run at once: as many full-length ones as the pool holds, at most `max_running`."""
        return max(0, min(self.sequences, self.max_running, self.tokens // self.sequence_tokens))

    @property
    def waves(self) -> int:
        """Rounds of generation a step needs (0: not even one sequence fits)."""
        return math.ceil(self.sequences / self.concurrent) if self.concurrent else 0


def pool_bytes(*, free_bytes: int, mem_fraction: float, weight_bytes: int) -> int:
    """SGLang's rule: `mem_fraction` of the memory free at the server's start (`free_bytes`), less its weights
    (0 where SGLang would refuse to start)."""
    return max(0, int(free_bytes * mem_fraction) - weight_bytes)


def kv_pool(arch: Arch, *, tp: int, dtype: str, free_bytes: int, mem_fraction: float, sequences: int,
            sequence_tokens: int, max_running: int) -> KvPool:
    """The pool of one GPU of a TP-`tp` server that finds `free_bytes` free when it starts."""
    weights = server_weight_bytes(arch, tp=tp, dtype=dtype)
    size = pool_bytes(free_bytes=free_bytes, mem_fraction=mem_fraction, weight_bytes=weights)
    token_bytes = kv_bytes_per_token(arch, tp=tp, dtype=dtype)
    return KvPool(weight_bytes=weights, free_bytes=free_bytes, bytes=size,
                  tokens=size // token_bytes, token_bytes=token_bytes, sequences=sequences,
                  sequence_tokens=sequence_tokens, max_running=max_running)
