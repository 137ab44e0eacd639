"""Offload and onload of a trainable actor: a step, offload (optimizer, then weights too), onload, another step.

Compared with a twin engine that never offloads. On CPU nothing can move (the host is
the device) but megatron's gradient buffers are freed and re-allocated, and the twin's
weights after the second step must be bitwise equal: the cycle lost no optimizer state
and left no stale gradient. On CUDA (`gpu`) every weight, fp32 main weight and Adam
moment must sit in host memory while offloaded, the device memory they and the
gradient buffers took must be free, and after onload each tensor is back, bitwise, on
the device it came from (torch Adam's `step` counters stay on the host throughout).
Run both with `pytest tests/test_engine_offload.py`; the CUDA one is part of
`benchmarks/gpu_check.sh`.
"""

from __future__ import annotations

import pytest
import torch

from _engine_spawn import run_spawned
from _engine_workers import offload_cycle
from megarl.data.padding import position_ids_from_mask

CONFIG = {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
PPO = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, entropy_coeff=0.0, temperature=1.0)
ROWS, PROMPT, RESPONSE = 4, 5, 6


def _batch() -> dict:
    gen = torch.Generator().manual_seed(2)
    input_ids = torch.randint(0, 512, (ROWS, PROMPT + RESPONSE), generator=gen)
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0
    mask[2, PROMPT + 3:] = 0
    return {"input_ids": input_ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "response_mask": mask[:, PROMPT:].clone(), "old_log_probs": -6.2 + 0.3 * torch.randn(ROWS, RESPONSE,
                                                                                                 generator=gen),
            "advantages": torch.randn(ROWS, RESPONSE, generator=gen)}


def _cycle(params_dtype: str) -> dict:
    return run_spawned(offload_cycle, hf_config=CONFIG, batch=_batch(), params_dtype=params_dtype, ppo=PPO)[0]


def _assert_restored(out: dict) -> None:
    assert out["before"].keys() == out["after"].keys()
    for name, (tensor, device) in out["before"].items():
        after, device_after = out["after"][name]
        assert device_after == device, name
        assert torch.equal(after, tensor), name
    assert all(size > 0 for size in out["grad_bytes_before"])
    assert out["grad_bytes_offloaded"] == [0] * len(out["grad_bytes_before"])  # freed, not just zeroed
    assert out["grad_bytes_after"] == out["grad_bytes_before"]


@pytest.mark.dist
def test_offload_onload_keeps_training_exact_on_cpu():
    out = _cycle("float32")
    _assert_restored(out)
    assert out["first"] == out["twin_first"] and out["second"] == out["twin_second"]
    for name, tensor in out["twin_weights"].items():
        assert torch.equal(out["weights"][name], tensor), name
    assert not torch.equal(out["weights"]["model.norm.weight"], torch.ones(128))  # the steps moved the weights


@pytest.mark.gpu
def test_offload_frees_the_device_and_onload_restores_it_on_cuda():
    out = _cycle("bfloat16")
    _assert_restored(out)
    # Offloaded: everything on the host (`_assert_restored` checked each went back where it was, so torch
    # Adam's `step` counters, host tensors from the start, did not land on the device).
    assert set(out["offloaded_devices"].values()) == {"cpu"}
    device_tensors = sum(t.numel() * t.element_size() for t, device in out["before"].values() if device != "cpu")
    freed = device_tensors + sum(out["grad_bytes_before"])
    # Everything counted in `freed` left the device (a little slack for allocator rounding).
    assert out["bytes_before"] - out["bytes_offloaded"] >= freed - (1 << 20)
    assert out["bytes_optimizer_offloaded"] < out["bytes_before"]
    assert out["bytes_after"] >= out["bytes_before"] - (1 << 20)
    # Training goes on as the twin's. GPU kernels may sum in another order (atomics in the embedding
    # backward), which moves a bf16 weight by at most about one ulp (2^-8 relative); a lost Adam moment
    # would change the second update itself, by O(lr) = 1e-2, far above that.
    for name, tensor in out["twin_weights"].items():
        assert torch.allclose(out["weights"][name], tensor, rtol=2**-7, atol=1e-4), name
