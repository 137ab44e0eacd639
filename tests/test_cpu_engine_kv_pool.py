"""The CPU engine's KV-cache pool (`megarl.rollout.cpu_engine.kv_pool`), sized, reported and enforced as SGLang's, and
`megarl plan`'s prediction of it.

- Sizing: `mem_fraction_static x the free memory - the weights`, in tokens of 2 x layers x KV heads x head_dim x
  dtype bytes, lowered by `--max-total-tokens`; nothing left is SGLang's start-up error.
- The plan's KV pool for the same memory (from config.json alone) equals what a served model reports in
  `/get_server_info` (`max_total_num_tokens`, and the weights it measured in `internal_states`).
- Requests: a prompt of `max_req_input_len` tokens is refused with SGLang's message; `max_new_tokens` is lowered to
  what the pool leaves; sequences that the pool cannot hold together run one after the other.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _tiny import SERVED, served_model
from test_cpu_engine import API_KEY, call, word_tokenizer

from megarl.models.spec import arch_from_hf
from megarl.plan.kv_cache import kv_bytes_per_token, kv_pool
from megarl.rollout.cpu_engine.kv_pool import model_bytes, size_pool, token_bytes
from megarl.rollout.cpu_engine.scheduler import Scheduler
from megarl.rollout.cpu_engine.sequence import SamplingSettings, Sequence

POOL_TOKENS = 100  # the served pool: smaller than the context (256), so the pool, not the context, bounds requests
FRACTION = 0.5


def _rotary_bytes(model) -> int:
    """What the model holds beyond its parameters: the rotary embedding's frequency buffers (not in config.json)."""
    return sum(buffer.nbytes for buffer in model.buffers())


def _device_for(model, tokens: float) -> int:
    """Free memory at which SGLang's rule leaves a pool of `tokens` (fractional: away from a token boundary)."""
    weights = sum(param.nbytes for param in model.parameters())
    return int((weights + tokens * token_bytes(model.config, torch.float32)) / FRACTION)


def test_the_pool_is_the_fraction_of_free_memory_less_the_weights_and_max_total_tokens_only_lowers_it():
    model = served_model(0)
    cell = token_bytes(model.config, torch.float32)
    assert cell == 2 * 2 * 2 * (64 // 4) * 4  # layers x KV heads x head_dim, K and V, float32
    device = 10 * model_bytes(model)
    sized = size_pool(model=model, dtype=torch.float32, context_length=256, max_batch=8, device_memory_bytes=device,
                      mem_fraction_static=FRACTION, max_total_tokens=None)
    assert sized.max_total_num_tokens == (int(device * FRACTION) - model_bytes(model)) // cell > 0
    lowered = size_pool(model=model, dtype=torch.float32, context_length=256, max_batch=8, device_memory_bytes=device,
                        mem_fraction_static=FRACTION, max_total_tokens=50)
    assert lowered.max_total_num_tokens == 50
    raised = size_pool(model=model, dtype=torch.float32, context_length=256, max_batch=8, device_memory_bytes=device,
                       mem_fraction_static=FRACTION, max_total_tokens=10**9)
    assert raised.max_total_num_tokens == sized.max_total_num_tokens
    # Without a device figure the pool holds what the engine runs at once: it never binds.
    assert size_pool(model=model, dtype=torch.float32, context_length=256, max_batch=8, device_memory_bytes=None,
                     mem_fraction_static=FRACTION, max_total_tokens=None).max_total_num_tokens == 8 * 256
    with pytest.raises(RuntimeError, match=r"^Not enough memory\. Please try to increase --mem-fraction-static\. "
                                           r"Current value: mem_fraction_static=0\.5$"):
        size_pool(model=model, dtype=torch.float32, context_length=256, max_batch=8,
                  device_memory_bytes=model_bytes(model), mem_fraction_static=FRACTION, max_total_tokens=None)


def test_sequences_the_pool_cannot_hold_together_wait_their_turn():
    """Three streamed sequences of 10 + 40 tokens: a pool of 100 runs two at once, the third only once one has
    finished; a pool of 150 runs all three at once (so the check can fail)."""
    model = served_model(0)

    def alive_counts(pool_tokens: int) -> list[int]:
        events: list[tuple[str, int]] = []
        done = threading.Event()
        scheduler = Scheduler(model, max_batch=8, eos_token_ids=frozenset(), decode=None, seed=0,
                              pool_tokens=pool_tokens)
        seqs = []
        for index in range(3):
            seq = Sequence(rid=f"r{index}", request_rid=f"r{index}", prompt_ids=list(range(5, 15)), stream=True,
                           sampling=SamplingSettings(max_new_tokens=40, temperature=0.0, ignore_eos=True))
            seq.on_progress = lambda s, n, i=index: events.append(("token", i))
            seq.on_finish = lambda s, i=index: (events.append(("finish", i)),
                                                 all(x.done for x in seqs) and done.set())
            seqs.append(seq)
        scheduler.start()
        try:
            scheduler.submit(seqs)
            assert done.wait(60)
        finally:
            scheduler.stop()
        assert all(len(seq.output_ids) == 40 for seq in seqs)
        alive, counts = set(), []
        for kind, index in events:
            (alive.add if kind == "token" else alive.discard)(index)
            counts.append(len(alive))
        return counts

    assert max(alive_counts(100)) == 2
    assert max(alive_counts(150)) == 3


@pytest.fixture(scope="module")
def served(tmp_path_factory, cpu_engine):
    """A served model whose pool holds ~POOL_TOKENS tokens: (server, model)."""
    root = tmp_path_factory.mktemp("kv_pool_model")
    model = served_model(0)
    model.save_pretrained(root)
    word_tokenizer(eos=2).save_pretrained(root)
    server = cpu_engine(root, api_key=API_KEY, device_memory_bytes=_device_for(model, POOL_TOKENS + 0.5),
                        mem_fraction_static=FRACTION)
    return server, model


@pytest.mark.dist
def test_the_plans_kv_pool_is_what_the_engine_reports_for_the_same_memory(served):
    server, model = served
    status, info = call(server, "/get_server_info", method="GET")
    assert status == 200, info
    arch = arch_from_hf(model.config.to_dict())
    free = _device_for(model, POOL_TOKENS + 0.5)
    planned = kv_pool(arch, tp=1, dtype="float32", free_bytes=free, mem_fraction=FRACTION, sequences=1,
                      sequence_tokens=1, max_running=1)
    assert kv_bytes_per_token(arch, tp=1, dtype="float32") == token_bytes(model.config, torch.float32)
    # The engine measures its model's tensors; the plan counts config.json's parameters: they differ by the rotary
    # buffers alone (64 bytes here), less than the half token of margin `_device_for` leaves.
    measured_weights = round(info["internal_states"][0]["memory_usage"]["weight"] * 2**30)
    assert measured_weights == planned.weight_bytes + _rotary_bytes(model)
    assert info["max_total_num_tokens"] == planned.tokens == POOL_TOKENS
    assert info["internal_states"][0]["memory_usage"]["token_capacity"] == POOL_TOKENS
    assert info["max_req_input_len"] == min(SERVED["max_position_embeddings"] - 1, POOL_TOKENS - 1) - 5 == 94


@pytest.mark.dist
def test_requests_are_bounded_by_the_pool_as_sglang_bounds_them(served):
    server, _ = served
    status, reply = call(server, "/generate", {"input_ids": [5] * 94, "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and reply["error"]["message"] == (
        "Input length (94 tokens) exceeds the maximum allowed length (94 tokens). Use a shorter input or enable "
        "--allow-auto-truncate."), reply
    # A prompt of 10 asking for 200 tokens gets what the pool leaves: min(99 - 10 - 1, 100 - 10 - 2) = 88.
    status, reply = call(server, "/generate", {"input_ids": [5] * 10,
                                                "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}})
    assert status == 200 and reply["meta_info"]["completion_tokens"] == 88, reply
    assert reply["meta_info"]["finish_reason"] == {"type": "length", "length": 88}
