"""PolicyEngine training paths (gloo, spawned ranks), checked against HF autograd and a single rank.

One spawned rank builds a frozen reference, a zero-LR engine (to read gradients at
fixed weights) and a real actor from the same HF checkpoint, and returns everything
the first tests assert on. The independent reference is the HF model in this process:
the PPO loss written out by hand, differentiated by torch autograd. The same update at
the other parallel layouts (TP, PP, VPP, DP) is compared with TP1PP1 in test_engine_forward.
"""

from __future__ import annotations

import re

import pytest
import torch

from _engine_spawn import run_spawned
from _settings import FULL_PPO_LOSS
from _tiny import padded_sequences, tiny_model
from _engine_workers import actor_outputs

pytestmark = pytest.mark.dist

PROMPT, RESPONSE, ROWS = 5, 6, 6
PPO = {**FULL_PPO_LOSS, "temperature": 1.0}
METRICS = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/pg_clipfrac_lower",
    "actor/grad_norm",
    "actor/lr",
}


# The other registered policy losses through the engine, each with another aggregation and KL kind.
OTHER_LOSSES = {
    "gspo": dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean", kl_loss_type="k3+"),
    "cispo": dict(policy_loss="cispo", loss_agg_mode="seq-mean-token-sum-norm", kl_loss_type="kl"),
}


def _hf_model():
    return tiny_model("qwen2", seed=5, vocab_size=200, attn_implementation="eager")


def _batch(model) -> dict:
    gen = torch.Generator().manual_seed(3)
    sequences = padded_sequences(gen, rows=ROWS, prompt=PROMPT, response=RESPONSE, vocab=200)
    input_ids, mask, position_ids = sequences["input_ids"], sequences["attention_mask"], sequences["position_ids"]
    response_mask = sequences["response_mask"]
    with torch.no_grad():
        log_probs = _response_log_probs(model, input_ids, mask, position_ids)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        # Off-policy enough that some ratios leave the clip range.
        "old_log_probs": log_probs + 0.3 * torch.randn(log_probs.shape, generator=gen),
        "advantages": torch.randn(ROWS, RESPONSE, generator=gen),
        "ref_log_prob": log_probs + 0.2 * torch.randn(log_probs.shape, generator=gen),
    }


def _response_log_probs(model, input_ids, mask, position_ids, with_entropy=False):
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits[:, PROMPT - 1 : -1]
    log_softmax = torch.log_softmax(logits.float(), -1)
    log_probs = log_softmax.gather(-1, input_ids[:, PROMPT:].unsqueeze(-1)).squeeze(-1)
    if with_entropy:
        return log_probs, -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs


def _surrogate(log_probs, old, advantages, mask, low=0.2, high=0.28, dual=3.0):
    """The clipped PPO objective written out per token, token-mean over the response mask."""
    ratio = torch.exp(log_probs - old)
    per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - low, 1 + high))
    per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual), per_token)
    return (per_token * mask).sum() / mask.sum()


def _other_loss(name: str, log_probs, entropy, batch, mask) -> torch.Tensor:
    """GSPO or CISPO written out per token as verl 0.9.1 defines them, with the entropy bonus and the KL loss of
    OTHER_LOSSES[name], aggregated as its loss_agg_mode; sg = detach."""
    old, advantages, ref = batch["old_log_probs"], batch["advantages"], batch["ref_log_prob"]
    lengths = mask.sum(-1)
    if name == "gspo":  # sequence ratio s_i = exp(mean_t log-ratio), its gradient through each token's log-prob
        seq = ((log_probs - old) * mask).sum(-1) / lengths
        ratio = torch.exp(seq.detach().unsqueeze(-1) + log_probs - log_probs.detach())
        per_token = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.28))
        k2 = 0.5 * (log_probs - ref) ** 2  # k3+: k3's value, k2's gradient
        log_ratio = ref - log_probs
        kl = k2 - k2.detach() + (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10).detach()
        agg = lambda x: ((x * mask).sum(-1) / lengths).mean()  # noqa: E731  seq-mean-token-mean
    else:  # cispo: -sg(clip(ratio)) * A * logp
        weight = torch.exp(log_probs - old).clamp(0.8, 1.28).detach()
        per_token = -weight * advantages * log_probs
        kl = log_probs - ref
        agg = lambda x: (x * mask).sum() / (mask.shape[0] * mask.shape[1])  # noqa: E731  seq-mean-token-sum-norm
    return agg(per_token) - 0.01 * agg(entropy) + 0.1 * agg(kl)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = _hf_model()
    path = tmp_path_factory.mktemp("hf") / "qwen2"
    model.save_pretrained(path)
    batch = _batch(model)
    sft_mask = batch["attention_mask"].clone()
    sft_mask[:, :PROMPT] = 0
    sft_batch = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")} | {"loss_mask": sft_mask}
    other = {name: torch.randn_like(t) for name, t in model.state_dict().items() if name != "lm_head.weight"}
    (out,) = run_spawned(
        actor_outputs, checkpoint=str(path), batch=batch, ppo=PPO, sft_batch=sft_batch, other_weights=other,
        other_losses=OTHER_LOSSES,
    )
    return model, batch, sft_batch, other, out


def test_gradient_matches_hf_autograd_and_ignores_micro_batch_split(setup):
    model, batch, _, _, out = setup
    mask = batch["response_mask"].float()
    log_probs, entropy = _response_log_probs(
        model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], with_entropy=True
    )
    pg = _surrogate(log_probs, batch["old_log_probs"], batch["advantages"], mask)
    log_ratio = batch["ref_log_prob"] - log_probs
    k3 = (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    token_mean = lambda x: (x * mask).sum() / mask.sum()  # noqa: E731
    loss = pg - 0.01 * token_mean(entropy) + 0.1 * token_mean(k3)
    model.zero_grad()
    loss.backward()
    expected = {name: p.grad for name, p in model.named_parameters()}

    grads = out["grads_1mb"]
    assert set(grads) == set(expected)
    scale = max(g.abs().max() for g in expected.values())
    for name, grad in grads.items():
        assert torch.allclose(grad, expected[name], atol=1e-5 * scale, rtol=1e-4), name
    # Same mini-batch in 2 micro-batches, and in 4 + 2 (padded to 4 + 4): same gradient.
    for label in ("grads_2mb", "grads_uneven"):
        for name, grad in out[label].items():
            assert torch.allclose(grad, grads[name], atol=1e-6 * scale, rtol=1e-5), (label, name)
    norms = [out[label + "_metrics"]["actor/grad_norm"] for label in ("grads_1mb", "grads_2mb", "grads_uneven")]
    reference_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in expected.values())).item()
    assert norms == pytest.approx([reference_norm] * 3, rel=1e-4)
    metrics = out["grads_1mb_metrics"]
    assert metrics["actor/pg_loss"] == pytest.approx(pg.item(), abs=1e-5)
    assert metrics["actor/kl_loss"] == pytest.approx(token_mean(k3).item(), abs=1e-5)
    assert metrics["actor/lr"] == 0.0


@pytest.mark.parametrize("name", list(OTHER_LOSSES))
def test_other_policy_losses_reach_the_engine_and_match_hf_autograd(setup, name):
    model, batch, _, _, out = setup
    mask = batch["response_mask"].float()
    assert (mask.sum(-1) > 0).all()  # every row is a sequence of S (the aggregation above assumes it)
    log_probs, entropy = _response_log_probs(
        model, batch["input_ids"], batch["attention_mask"], batch["position_ids"], with_entropy=True
    )
    model.zero_grad()
    _other_loss(name, log_probs, entropy, batch, mask).backward()
    expected = {param_name: p.grad for param_name, p in model.named_parameters()}
    scale = max(g.abs().max() for g in expected.values())
    for param_name, grad in out[name].items():
        assert torch.allclose(grad, expected[param_name], atol=1e-5 * scale, rtol=1e-4), (name, param_name)
    # Not the PPO gradient: the loss name reached the engine.
    ppo_grad = out["grads_1mb"]["model.embed_tokens.weight"]
    assert not torch.allclose(out[name]["model.embed_tokens.weight"], ppo_grad, atol=1e-3 * scale)


def test_update_changes_weights_and_reduces_the_surrogate(setup):
    _, batch, _, _, out = setup
    metrics = out["update_metrics"]
    assert set(metrics) == METRICS
    mask = batch["response_mask"].float()
    # Fresh old log-probs: ratio 1, nothing clipped, the loss is -mean(A).
    assert metrics["actor/pg_loss"] == pytest.approx(
        -(batch["advantages"] * mask).sum().item() / mask.sum().item(), abs=1e-5
    )
    assert metrics["actor/pg_clipfrac"] == 0.0 and abs(metrics["actor/ppo_kl"]) < 1e-6
    assert metrics["actor/lr"] == pytest.approx(1e-3) and metrics["actor/grad_norm"] > 0
    changed = [name for name, w in out["weights_before"].items() if not torch.equal(w, out["weights_after"][name])]
    assert len(changed) == len(out["weights_before"])
    before = _surrogate(out["lp_before"], out["lp_before"], batch["advantages"], mask)
    after = _surrogate(out["lp_after"], out["lp_before"], batch["advantages"], mask)
    assert after < before - 1e-3


def test_sft_step_reduces_the_loss_and_starts_from_the_hf_nll(setup):
    model, _, sft_batch, _, out = setup
    logits = model(
        input_ids=sft_batch["input_ids"],
        attention_mask=sft_batch["attention_mask"],
        position_ids=sft_batch["position_ids"],
    ).logits[:, :-1]
    targets_mask = sft_batch["loss_mask"][:, 1:].float()
    nll = -torch.log_softmax(logits, -1).gather(-1, sft_batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    expected = ((nll * targets_mask).sum() / targets_mask.sum()).item()
    assert out["sft_loss_at_checkpoint"] == pytest.approx(expected, abs=1e-5)
    losses = [m["sft/loss"] for m in out["sft_metrics"]]
    assert out["sft_metrics"][0]["sft/tokens"] == targets_mask.sum().item()
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    assert losses[-1] < losses[0] - 0.1
    assert out["sft_metrics"][0]["sft/lr"] == 1e-2
    assert out["lr_after_sft"] == pytest.approx(1e-3)  # the RL schedule is untouched


def test_a_non_finite_loss_stops_the_step_naming_it(setup):
    """Divergence is caught in the trainer, where it happens, not by scanning every weight on the servers."""
    message = setup[4]["diverged"]
    assert message is not None and re.match(r"training diverged at update call \d+, epoch 1, mini-batch 1: ", message)
    assert "actor/pg_loss is nan" in message and "actor/grad_norm is nan" in message
    assert "before these weights reach the rollout servers" in message


def test_hf_state_dict_round_trip_after_load(setup):
    _, _, _, other, out = setup
    assert set(out["reloaded"]) == set(other)
    for name, tensor in other.items():
        assert torch.equal(out["reloaded"][name], tensor), name
        assert torch.equal(out["reloaded_after_cycle"][name], tensor), name  # offload + onload kept them


def test_reference_never_changes(setup):
    model, _, _, _, out = setup
    assert out["ref_requires_grad"] is False
    assert torch.equal(out["ref_lp_before"], out["ref_lp_after"])
    for name, tensor in out["ref_weights_after"].items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert "PolicyEngine (frozen) has no optimizer" in out["ref_update_error"]
