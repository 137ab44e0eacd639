"""Distributed checkpoints: saved at TP2xPP2, loaded at TP1PP1 (DP4) in the same processes.

The reference is the run that never stopped: after loading, eval log-probs equal those
at save time, and one more training step (warm-up LR from the restored schedule, Adam
moments from the restored optimizer) gives the weights of the continued run. Loading
weights only must not: that shows the optimizer state is what makes the step equal.
"""

from __future__ import annotations

import json

import pytest
import torch

from _engine_jobs import checkpoint_job

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one shared multi-process job, 20-50 s


@pytest.fixture(scope="module")
def job():
    return checkpoint_job()


def test_metadata_records_config_tokenizer_and_layout(job):
    info = json.loads((job["ckpt_dir"] / "megarl_checkpoint.json").read_text())
    assert info["hf_config"]["model_type"] == "qwen2" and info["hf_config"]["tie_word_embeddings"] is True
    assert info["tokenizer_path"] == str(job["hf_dir"])
    assert info["params_dtype"] == "float32" and info["has_optimizer"] is True
    assert info["saved_layout"] == {"tp": 2, "pp": 2, "vpp": 1, "dp": 1, "world_size": 4}
    assert (job["ckpt_dir"] / "metadata.json").is_file()  # megatron's own


def test_load_at_another_layout_gives_the_saved_model(job):
    for out in job["out"]:
        assert torch.allclose(out["resumed_log_probs"], out["saved_log_probs"], atol=1e-5, rtol=0)
        assert torch.allclose(out["weights_only_log_probs"], out["saved_log_probs"], atol=1e-5, rtol=0)


def test_resumed_step_equals_the_continued_run(job):
    for out in job["out"]:
        continued, resumed = out["continued_weights"], out["resumed_weights"]
        saved = out["saved_weights"]
        assert set(resumed) == set(continued)
        for name, weight in continued.items():
            assert not torch.equal(weight, saved[name]), name  # the step moved every weight
            if name.endswith("k_proj.bias"):
                # Softmax ignores a key bias: its gradient is 0 up to float noise, which Adam
                # normalises into a full-size step whose sign depends on the layout.
                continue
            assert torch.allclose(resumed[name], weight, atol=1e-6, rtol=1e-5), name
        for key in ("actor/lr", "actor/pg_loss", "actor/grad_norm"):
            assert out["resumed_metrics"][key] == pytest.approx(out["metrics_2"][key], rel=1e-5, abs=1e-7), key
        # Warm-up: the second step runs at 2/4 of the peak LR, the first ran at 1/4.
        assert out["metrics_1"]["actor/lr"] == pytest.approx(2.5e-3)
        assert out["metrics_2"]["actor/lr"] == pytest.approx(5e-3)


def test_weights_only_load_does_not_restore_the_optimizer(job):
    for out in job["out"]:
        # A fresh schedule restarts the warm-up, fresh Adam moments change the step.
        assert out["weights_only_metrics"]["actor/lr"] == pytest.approx(2.5e-3)
        diffs = [
            (out["weights_only_weights"][name] - weight).abs().max().item()
            for name, weight in out["continued_weights"].items()
        ]
        assert max(diffs) > 1e-4
