"""Tool tokens never reach the loss, the KL or the entropy: the Megatron actor on interleaved responses.

Each response is model tokens, a tool segment, model tokens, and a trailing environment segment
(`response_mask` 0 on both segments), right-padded. At the masked positions the old, reference
log-probs and advantages hold wild values. Two checks, one spawned rank:
- replacing the ids of the trailing segment (which no model token reads) and the values at every
  masked position leaves the PPO loss, the KL loss and the entropy exactly as they were;
- with the ids of the middle segment replaced too (the model tokens after it then see another
  context), the engine's figures equal the HF model's, computed by hand over the model tokens only,
  and differ from the same formula over every response token (the mask is what keeps them out).
"""

from __future__ import annotations

import pytest
import torch

from _engine_spawn import run_spawned
from _settings import FULL_PPO_LOSS, batching, optimizer, policy_update
from _tiny import tiny_model

pytestmark = pytest.mark.dist

PROMPT, RESPONSE, VOCAB = 4, 14, 200
# Per row: model [0:3], tool [3:7], model [7:10], environment [10:end]; rows end at different lengths.
ENDS = [14, 13, 12, 14]
MODEL_SPANS = [(0, 3), (7, 10)]


def _masks():
    attention = torch.zeros(len(ENDS), RESPONSE, dtype=torch.long)
    response_mask = torch.zeros(len(ENDS), RESPONSE, dtype=torch.long)
    for row, end in enumerate(ENDS):
        attention[row, :end] = 1
        for start, stop in MODEL_SPANS:
            response_mask[row, start:stop] = 1
    return attention, response_mask


def _batch(seed: int, *, base: dict | None = None, replace: tuple[int, int] | None = None) -> dict:
    """Random rows; with `base`, a copy whose ids in response columns `replace` and whose masked values differ."""
    gen = torch.Generator().manual_seed(seed)
    attention, response_mask = _masks()
    if base is None:
        input_ids = torch.randint(0, VOCAB, (len(ENDS), PROMPT + RESPONSE), generator=gen)
        values = {"lp": torch.randn(len(ENDS), RESPONSE, generator=gen) * 0.3 - 5.0,
                  "adv": torch.randn(len(ENDS), RESPONSE, generator=gen),
                  "ref": torch.randn(len(ENDS), RESPONSE, generator=gen) * 0.3 - 5.0}
    else:
        input_ids = base["input_ids"].clone()
        start, stop = replace
        columns = slice(PROMPT + start, PROMPT + stop)
        input_ids[:, columns] = (input_ids[:, columns] + 1 + torch.randint(0, VOCAB - 1, (1,), generator=gen)) % VOCAB
        values = {"lp": base["old_log_probs"], "adv": base["advantages"], "ref": base["ref_log_prob"]}
    masked = response_mask == 0
    wild = lambda scale: scale * torch.randn(len(ENDS), RESPONSE, generator=gen)  # noqa: E731
    mask = torch.cat([torch.ones(len(ENDS), PROMPT, dtype=torch.long), attention], 1)
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, PROMPT:],
        "response_mask": response_mask,
        "old_log_probs": torch.where(masked, wild(50.0), values["lp"]),
        "advantages": torch.where(masked, wild(1e3), values["adv"]),
        "ref_log_prob": torch.where(masked, wild(50.0), values["ref"]),
    }


def masking_job(*, rank: int, checkpoint: str, batches: list[dict]) -> list[dict]:
    import json
    from pathlib import Path

    from megarl.algorithms.metrics import entropy_metric
    from megarl.engines.actor import PolicyEngine

    engine = PolicyEngine(hf_config=json.loads((Path(checkpoint) / "config.json").read_text()), weights=checkpoint,
                          seed=0, params_dtype=torch.float32, transformer_impl="local", optimizer=optimizer(lr=0.0))
    out = []
    for batch in batches:
        log_probs, entropy = engine.compute_log_prob(batch, temperature=1.0, with_entropy=True, batching=batching(2))
        metrics = engine.update(batch, policy_update(micro_batch_size=2, **FULL_PPO_LOSS))
        metrics["actor/entropy"] = float(entropy_metric(entropy, batch["response_mask"].float(), "token-mean"))
        out.append({"metrics": metrics, "log_probs": log_probs})
    return out


def _hf_reference(model, batch: dict, mask: torch.Tensor) -> dict[str, float]:
    """The PPO loss, the low-variance KL and the entropy of the HF model, token-mean over `mask`."""
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, PROMPT - 1: -1].float()
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, batch["input_ids"][:, PROMPT:].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    mean = lambda x: float((x * mask).sum() / mask.sum())  # noqa: E731
    ratio = torch.exp(log_probs - batch["old_log_probs"])
    adv = batch["advantages"]
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28))
    per_token = torch.where(adv < 0, torch.minimum(per_token, -adv * 3.0), per_token)
    log_ratio = batch["ref_log_prob"] - log_probs
    kl = (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    return {"actor/pg_loss": mean(per_token), "actor/kl_loss": mean(kl), "actor/entropy": mean(entropy)}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    # Wide initial weights: peaked, varied next-token distributions, so every figure depends on the positions.
    model = tiny_model("llama", seed=2, vocab_size=VOCAB, attn_implementation="eager", initializer_range=0.5)
    path = tmp_path_factory.mktemp("masking") / "llama"
    model.save_pretrained(path)
    original = _batch(0)
    tail_replaced = _batch(1, base=original, replace=(10, RESPONSE))
    middle_replaced = _batch(2, base=tail_replaced, replace=(3, 7))
    (results,) = run_spawned(masking_job, checkpoint=str(path), batches=[original, tail_replaced, middle_replaced])
    return model, [original, tail_replaced, middle_replaced], results


KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl")


def test_trailing_tool_tokens_change_nothing(outcome):
    _, _, (original, tail_replaced, _) = outcome
    for key in KEYS:
        # Same model tokens, same contexts: the computation is the same up to float reordering only.
        assert tail_replaced["metrics"][key] == pytest.approx(original["metrics"][key], rel=1e-6, abs=1e-7), key
    _, response_mask = _masks()
    model_positions = response_mask.bool()
    assert torch.allclose(original["log_probs"][model_positions], tail_replaced["log_probs"][model_positions],
                          atol=1e-6)


def test_the_engine_counts_model_tokens_only(outcome):
    model, batches, results = outcome
    _, response_mask = _masks()
    attention = batches[0]["attention_mask"][:, PROMPT:]
    for batch, result in zip(batches, results):
        reference = _hf_reference(model, batch, response_mask.float())
        everywhere = _hf_reference(model, batch, attention.float())
        for key, value in reference.items():
            # float32 through Megatron vs HF: 1e-5 relative is the float noise of these sums.
            assert result["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
            assert abs(everywhere[key] - value) > 1e-2, key  # counting the tool tokens would change every figure
    # The middle segment's new ids do reach the model tokens after it (they are their context).
    later = torch.zeros_like(response_mask, dtype=torch.bool)
    later[:, 7:10] = True
    assert not torch.allclose(results[1]["log_probs"][later], results[2]["log_probs"][later], atol=1e-4)
