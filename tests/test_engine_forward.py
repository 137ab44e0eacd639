"""The layout matrix: Megatron GPT at TP1PP1, TP2PP1, TP1PP2, TP2PP2 and PP2xVPP2 against HF
transformers on the same weights (Llama untied, Qwen2 with QKV bias and tied embeddings,
Qwen3 with q/k norms), one spawned gloo job.

The HF models (random weights, randomised norms and biases, vocab 300 so Megatron pads
it to 384 at TP1, 512 at TP2) and the job live in `_engine_jobs`. One 4-process job switches
through the layouts (DP fills the remaining ranks) and returns, per layout and model,
the full logits, log-probs / entropy (computed from the vocab-parallel logits without
gathering the vocab) and one SFT step at lr = 0 on the DP shares: its loss, grad norm
and gradients; plus one PPO update of the Qwen2 model. The reference is HF (logits,
log-softmax, autograd here) and, for PPO, the TP1PP1 layout.
"""

from __future__ import annotations

import pytest
import torch

from _engine_jobs import LAYOUTS, MATRIX_MODELS, MATRIX_ROWS, PROMPT, RESPONSE, WORLD_SIZE, matrix_job
from _tiny import hf_sft_backward

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # one shared multi-process job, 20-50 s
MODELS, ROWS = MATRIX_MODELS, MATRIX_ROWS


@pytest.fixture(scope="module")
def job():
    return matrix_job()


@pytest.fixture(scope="module")
def models(job):
    return job["models"], job["checkpoints"], job["batch"]


@pytest.fixture(scope="module")
def results(job) -> list[dict]:
    """Every rank's {layout: outputs} from the one job."""
    return job["out"]


@pytest.fixture(scope="module")
def hf_reference(models):
    """Per model: HF logits and the SFT loss / gradients by autograd (token-mean NLL over loss_mask)."""
    hf_models, _, batch = models
    reference = {}
    for name, model in hf_models.items():
        logits, loss = hf_sft_backward(model, batch)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).item()
        reference[name] = {"logits": logits.double(), "loss": loss, "grads": grads, "norm": norm}
    return reference


def _check_same_on_every_rank(ranks: list[dict], name: str) -> None:
    for out in ranks[1:]:
        for key in ("logits", "log_probs", "entropy"):
            assert torch.equal(out[name][key], ranks[0][name][key]), key
        assert out[name]["sft"] == ranks[0][name]["sft"]


def test_layouts_place_ranks_as_asked(results):
    for layout, parallel in LAYOUTS.items():
        where = [r[layout]["where"] for r in results]
        assert {(w["tp_size"], w["pp_size"], w["dp_size"]) for w in where} == {
            (parallel["tp"], parallel["pp"], WORLD_SIZE // (parallel["tp"] * parallel["pp"]))
        }
        assert sum(w["is_output"] for w in where) == where[0]["dp_size"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_logits_and_log_probs_match_hf(models, results, hf_reference, layout):
    _, _, batch = models
    ranks = [r[layout] for r in results]
    tp = LAYOUTS[layout]["tp"]
    valid = batch["attention_mask"].bool()
    response_valid = batch["attention_mask"][:, PROMPT:].bool()
    targets = batch["input_ids"][:, PROMPT:]
    for name in MODELS:
        _check_same_on_every_rank(ranks, name)
        ours = ranks[0][name]
        assert ours["padded_vocab"] == {1: 384, 2: 512}[tp]  # next multiple of 128 * TP
        reference = hf_reference[name]["logits"]
        assert reference[valid].abs().max() > 0.5  # the comparison is not between near-zero logits
        assert torch.allclose(ours["logits"].double()[valid], reference[valid], atol=1e-5, rtol=0), name
        shifted = reference[:, PROMPT - 1 : -1]  # position t predicts token t + 1
        for temperature, key in ((1.0, "log_probs"), (0.7, "log_probs_t07")):
            expected = torch.log_softmax(shifted / temperature, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            got = ours[key]
            assert got.shape == (ROWS, RESPONSE) and got.dtype == torch.float32
            assert torch.allclose(got.double()[response_valid], expected[response_valid], atol=1e-5, rtol=0), key
        # Plain entropy: -sum_v p_v log p_v over the real vocab only (padding columns masked).
        probs = torch.softmax(shifted, -1)
        entropy = -(probs * probs.log()).sum(-1)
        assert torch.allclose(ours["entropy"].double()[response_valid], entropy[response_valid], atol=1e-5, rtol=0)
        assert ours["entropy_t07"] is None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_step_matches_hf_autograd_and_tp1pp1(results, hf_reference, layout):
    for ranks in results:
        out, base = ranks[layout], ranks["tp1pp1"]
        for name in MODELS:
            reference = hf_reference[name]
            scale = max(g.abs().max() for g in reference["grads"].values())
            sft, grads = out[name]["sft"], out[name]["grads"]
            assert sft["sft/loss"] == pytest.approx(reference["loss"], abs=1e-5), name
            assert sft["sft/grad_norm"] == pytest.approx(reference["norm"], rel=1e-4), name
            assert sft["sft/loss"] == pytest.approx(base[name]["sft"]["sft/loss"], abs=1e-6), name
            assert sft["sft/grad_norm"] == pytest.approx(base[name]["sft"]["sft/grad_norm"], rel=1e-5), name
            assert set(grads) == {n for n in reference["grads"] if n != "lm_head.weight" or name != "qwen2"}
            for param, grad in grads.items():
                assert torch.allclose(grad, reference["grads"][param], atol=1e-5 * scale, rtol=1e-4), (name, param)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "tp1pp1"])
def test_ppo_update_matches_tp1pp1(results, layout):
    for ranks in results:
        out, base = ranks[layout]["ppo"], ranks["tp1pp1"]["ppo"]
        assert base["metrics"]["actor/pg_clipfrac"] > 0  # the clipped branch is exercised
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/pg_clipfrac", "actor/grad_norm"):
            assert out["metrics"][key] == pytest.approx(base["metrics"][key], rel=1e-4, abs=1e-6), key
        scale = max(g.abs().max() for g in base["grads"].values())
        for name, grad in base["grads"].items():
            assert torch.allclose(out["grads"][name], grad, atol=1e-5 * scale, rtol=1e-4), (layout, name)
