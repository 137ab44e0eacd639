"""The CPU engine's KV-cache pool: its size in tokens, the request limits it sets, and its admission rule, as
SGLang 0.5.23 has them.

Size (`mem_cache/kv_cache_configurator.py`): SGLang measures the memory free on its device before it loads
its weights (F), loads them, and keeps `(1 - mem_fraction_static) x F` of what is then free for activations
and graphs; the rest is the pool, `mem_fraction_static x F - weights`, in tokens of
`2 x layers x KV heads x head_dim x dtype bytes` each, lowered to `--max-total-tokens` when that is smaller.
When it is not positive SGLang refuses to start, with the message below. A CPU has no device to measure, so
`--device-memory-bytes` says what F is, and the weights are the bytes of every tensor the loaded model holds.
Without it, and without `--max-total-tokens`, the pool is what the engine can run at once (`--max-batch`
sequences of the context length): it never binds.

Limits (`tp_worker`, `managers/utils.validate_input_length`, `scheduler.init_req_max_new_tokens`):
`max_req_len = min(context - 1, pool - 1)`, `max_req_input_len = max_req_len - 5`; a prompt of
`max_req_input_len` tokens or more is refused (400, SGLang's message); `max_new_tokens` is lowered to what the
context and the pool leave after the prompt.

Admission: a sequence joins the running batch only while the pool holds its prompt and every token it may
still generate, first come first served (the head of the queue waits rather than be overtaken). SGLang admits
on an estimate of the tokens still to come and retracts running requests when decoding runs out; reserving
the whole length is the conservative form of that rule, which never needs a retraction.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

NOT_ENOUGH_MEMORY = "Not enough memory. Please try to increase --mem-fraction-static."


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters and buffers; a tied weight once)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def token_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one cached token takes: K and V of every layer for every KV head (one process: no TP split)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclass(frozen=True)
class KvPool:
    """The pool's size in tokens, what it and the weights take, and the limits it sets on one request."""

    max_total_num_tokens: int
    context_length: int
    weight_bytes: int
    token_bytes: int

    def memory_usage(self) -> dict:
        """SGLang's `memory_usage` entry of `/get_server_info`'s `internal_states` (GB are GiB there)."""
        return {"weight": self.weight_bytes / 2**30, "kvcache": self.max_total_num_tokens * self.token_bytes / 2**30,
                "token_capacity": self.max_total_num_tokens}

    @property
    def max_req_len(self) -> int:
        return min(self.context_length - 1, self.max_total_num_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    def input_problem(self, prompt_length: int) -> str | None:
        """SGLang's refusal of a prompt too long for the pool or the context (None when it fits)."""
        if prompt_length < self.max_req_input_len:
            return None
        return (f"Input length ({prompt_length} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")

    def max_new_tokens(self, asked: int, prompt_length: int) -> int:
        """`asked`, lowered to what the context and the pool leave after the prompt (page size 1)."""
        return max(0, min(asked, self.max_req_len - prompt_length - 1,
                          self.max_total_num_tokens - prompt_length - 2))


def size_pool(*, model: torch.nn.Module, dtype: torch.dtype, context_length: int, max_batch: int,
              device_memory_bytes: int | None, mem_fraction_static: float, max_total_tokens: int | None) -> KvPool:
    """The pool of a loaded model, by SGLang's rule (module docstring); RuntimeError when nothing is left for it."""
    weights, cell = model_bytes(model), token_bytes(model.config, dtype)
    if device_memory_bytes is None:
        tokens = max_batch * context_length
    else:
        pool_bytes = int(device_memory_bytes * mem_fraction_static) - weights
        tokens = pool_bytes // cell if pool_bytes > 0 else 0
        if tokens <= 0:
            raise RuntimeError(f"{NOT_ENOUGH_MEMORY} Current value: mem_fraction_static={mem_fraction_static}")
    if max_total_tokens is not None:
        if max_total_tokens > tokens:
            logger.warning("max_total_tokens=%d is larger than the profiled value %d. Use the profiled value instead.",
                           max_total_tokens, tokens)
        tokens = min(tokens, max_total_tokens)
    return KvPool(max_total_num_tokens=tokens, context_length=context_length, weight_bytes=weights, token_bytes=cell)
