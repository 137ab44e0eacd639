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
    # A synchronous save starts no process that outlives it on any rank (no spawn-started results Manager).
    assert [rank_out["children_after_save"] for rank_out in job["out"]] == [[]] * 4


def test_rank_rng_states_are_restored_at_the_saved_layout_only(job):
    for out in job["out"]:
        # The draws right after the save come again after a load at TP2xPP2 ...
        for drawn, expected in zip(out["same_layout_rng"], out["rng_after_save"]):
            assert torch.equal(drawn, expected)
        # ... but not at DP4, where a rank has no counterpart in the saved layout.
        assert not torch.equal(out["resumed_rng"][0], out["rng_after_save"][0])
    info = json.loads((job["ckpt_dir"] / "megarl_checkpoint.json").read_text())
    assert info["has_rng_state"] is True
    # Megatron's model-parallel stream differs between TP ranks: each rank saved its own.
    assert not torch.equal(job["out"][0]["rng_after_save"][1], job["out"][1]["rng_after_save"][1])


def test_load_at_another_layout_gives_the_saved_model(job):
    for out in job["out"]:
        assert torch.allclose(out["resumed_log_probs"], out["saved_log_probs"], atol=1e-5, rtol=0)
        assert torch.allclose(out["weights_only_log_probs"], out["saved_log_probs"], atol=1e-5, rtol=0)


# Adam's defaults in tests/_settings.py, and the step the continued run's second update is.
ADAM_BETA2, ADAM_EPS, SECOND_STEP = 0.999, 1e-8, 2
# Relative float noise of a gradient summed in another order (TP2xPP2 against DP4): float32
# round-off of a few hundred terms is ~1e-6 of the largest; 1e-5 leaves a margin of ten.
GRAD_NOISE = 1e-5


def test_resume_restores_exactly_what_was_saved(job):
    for out in job["out"]:
        for name, weight in out["saved_weights"].items():
            assert torch.equal(out["resumed_loaded_weights"][name], weight), name
            assert torch.equal(out["weights_only_loaded_weights"][name], weight), name
        for key, saved in out["saved_moments"].items():
            for name, moment in saved.items():
                assert torch.equal(out["loaded_moments"][key][name], moment), (key, name)


def test_resumed_step_equals_the_continued_run(job):
    """The same step at another layout, from the same weights and moments: equal up to float noise.

    The gradients agree to GRAD_NOISE of each tensor's largest one. Adam divides the gradient by
    sqrt(v): an element whose gradient is ~0 (a key bias, an embedding row of a rare token) turns
    that noise into a large step difference. So each weight may differ by lr * dg / (sqrt(v_hat) + eps),
    dg = the gradient noise after clipping (an upper bound: the first moment carries only a share of dg).
    """
    for out in job["out"]:
        continued, resumed = out["continued_weights"], out["resumed_weights"]
        saved = out["saved_weights"]
        assert set(resumed) == set(continued)
        lr = out["metrics_2"]["actor/lr"]
        clip = min(1.0, 1.0 / out["metrics_2"]["actor/grad_norm"])  # clip_grad = 1.0
        steps, bounds = [], []
        for name, weight in continued.items():
            grad = out["continued_grads"][name]
            scale = grad.abs().max()
            assert torch.allclose(out["resumed_grads"][name], grad, atol=GRAD_NOISE * scale, rtol=0), name
            v_hat = out["continued_exp_avg_sq"][name] / (1 - ADAM_BETA2**SECOND_STEP)
            bound = lr * clip * GRAD_NOISE * scale / (v_hat.sqrt() + ADAM_EPS)
            bound += 4 * torch.finfo(torch.float32).eps * weight.abs()  # the update itself rounds
            diff = (resumed[name] - weight).abs()
            worst = (diff - bound).argmax()
            assert (diff <= bound).all(), (name, diff.flatten()[worst].item(), bound.flatten()[worst].item())
            steps.append((weight - saved[name]).abs().flatten())
            bounds.append(bound.flatten())
        # The bound is far below a real step: a resume that got the moments or the LR wrong fails.
        assert torch.cat(steps).median() > 100 * torch.cat(bounds).median()
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


def test_reference_and_critic_start_from_the_policy_checkpoint_at_another_layout(job):
    """`load_policy_checkpoint` (the warmed-up actor -> reference and critic, no full state dict anywhere):
    saved at TP2xPP2, loaded at TP1PP1 into engines built with other seeds. The critic takes the backbone
    and keeps its own value head."""
    for out in job["out"]:
        saved = out["saved_weights"]
        assert out["reference_loaded_weights"].keys() == saved.keys()
        for name, weight in saved.items():
            assert torch.equal(out["reference_loaded_weights"][name], weight), name
            assert torch.equal(out["critic_loaded_weights"][name], weight), name  # tied: no LM head in HF names
        (weight_before, bias_before), (weight_after, bias_after) = out["critic_head"]
        assert torch.equal(weight_after, weight_before) and torch.equal(bias_after, bias_before)
        assert weight_before.abs().sum() > 0  # head_init_std 0.1: a head the load would have overwritten


def test_checkpoints_store_layer_norms_under_transformer_engine_keys(job):
    """Megatron's local spec stores its norms under TE's fused-norm keys; megarl leaves out `_extra_state`
    (None in local layers, FP8 metadata in TE ones), so a checkpoint loads into either layer spec."""
    keys = set(job["out"][0]["checkpoint_keys"])
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight"} <= keys
    assert not any("input_layernorm" in key or "pre_mlp_layernorm" in key or "_extra_state" in key for key in keys)


def test_a_fused_reference_keeps_its_weights_beside_a_training_actor_and_takes_the_actors_on_copy(job):
    # A frozen reference built in the actor's processes and process group (the fused actor-reference worker),
    # at TP2xPP2 beside the actor loaded at the saved layout.
    for out in job["out"]:
        before = out["fused_ref_before"]
        # The actor's update beside it is the continued run's second update: the same computation in the same
        # order, so equal up to nothing (1e-6 relative only guards against a reordered reduction).
        assert out["fused_actor_metrics"] == pytest.approx(out["metrics_2"], rel=1e-6)
        # It moves nothing of the reference, nor does the reference's own offload round trip.
        assert torch.equal(out["fused_ref_after_update"], before)
        assert torch.equal(out["fused_ref_after_onload"], before)
        # The reference is the untrained policy (two updates at lr 1e-2 move log-probs by far more than 1e-3) ...
        assert (before - out["fused_actor_log_probs"]).abs().max() > 1e-3
        # ... until it takes the actor's weights: then the same model in the same process, bit for bit.
        assert torch.equal(out["fused_ref_copied"], out["fused_actor_log_probs"])
