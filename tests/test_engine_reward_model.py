"""RewardModelEngine (spawned gloo ranks) against HF transformers' AutoModelForSequenceClassification.

Tiny Llama and Qwen2 reward models (random weights, randomised norms and biases) are
saved as HF checkpoints, and a Llama whose pad id is its EOS (Llama-3-style reward
models, and what `train-rm` writes for a tokenizer without a pad token: HF then pools
at the last token before a trailing EOS); two ranks score the same rows at TP1 (DP2),
TP2 and PP2, with padded and packed micro-batches, and run one Bradley-Terry update at
lr 0 on pairs with margins. References, computed here: HF's pooled logits of the same
sequences (EOS-terminated rows among them), and the BT loss -log sigmoid(s_c - s_r - m)
and accuracy from those logits. The rows are the policy's own tokens
(shared tokenizer) and the conversation re-templated for a reward model whose chat
template differs. Tolerance: float32 forwards through two layers differ by
reduction order only (~1e-6); 1e-4 leaves room and is far below the scores' spread.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen2Config

from _engine_spawn import run_spawned
from _settings import batching, optimizer
from megarl.data.rm_inputs import RewardModelInputs
from megarl.data.tokenizer import builtin_tokenizer_dir, load_tokenizer

pytestmark = pytest.mark.dist

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, initializer_range=0.1, num_labels=1, pad_token_id=3,
            attn_implementation="eager")
EOS = 2  # the builtin tokenizer's EOS (its pad is 3)
MODELS = {"llama": (LlamaConfig, dict(rope_theta=5000.0)), "qwen2": (Qwen2Config, {}),
          "llama_pad_eos": (LlamaConfig, dict(rope_theta=5000.0, pad_token_id=EOS))}
LAYOUTS = {"tp1dp2": dict(tp=1, pp=1), "tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2)}
# (layout, model) runs: the pooling rule does not depend on the layout, so the pad = EOS model runs at one.
RUNS = [(layout, name) for layout in LAYOUTS for name in MODELS if name != "llama_pad_eos" or layout == "tp1dp2"]
# A reward model whose chat template differs from the policy's: its conversations are re-templated.
OTHER_TEMPLATE = ("{%- for message in messages -%}{{ '[' + message['role'] + '] ' + message['content'] + ' [end]\n' }}"
                  "{%- endfor -%}")
MESSAGES = [[{"role": "user", "content": f'Answer after "####". {a:02d}+{b:02d}=?'}] for a, b in
            [(7, 45), (13, 2), (99, 99), (0, 5), (61, 38), (28, 70)]]
MARGINS = torch.tensor([0.0, 0.5, -0.25, 1.0, 0.0, 2.0])  # per pair; -log sigmoid(s_c - s_r - m)
RESPONSES = ["#### 52", "#### 15", "I think #### 198", "#### 5", "99", "#### 98 and more words here"]


def _save_models(root: Path) -> dict[str, str]:
    dirs = {}
    for name, (config_cls, extra) in MODELS.items():
        torch.manual_seed(len(name))
        model = AutoModelForSequenceClassification.from_config(config_cls(**{**TINY, **extra}))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name or param_name.endswith("bias"):
                    param.uniform_(0.5, 1.5)
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _other_tokenizer(root: Path):
    target = root / "other-tokenizer"
    shutil.copytree(builtin_tokenizer_dir(), target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = OTHER_TEMPLATE
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(target))


def _rows(root: Path) -> dict[str, dict]:
    """RM rows for the same generated responses: shared tokenization and re-templated."""
    policy = load_tokenizer()
    prompts = [policy.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in MESSAGES]
    prompt_ids = policy(prompts, add_special_tokens=False)["input_ids"]
    response_ids = [policy.encode(text, add_special_tokens=False) + [policy.eos_token_id] for text in RESPONSES]
    shared = RewardModelInputs(policy, policy, max_length=64)
    other = RewardModelInputs(_other_tokenizer(root), policy, max_length=64)
    assert not shared.retemplate and other.retemplate
    generation = dict(prompt_ids=prompt_ids, response_ids=response_ids, messages=MESSAGES)
    return {"shared": shared.from_generation(**generation), "retemplated": other.from_generation(**generation),
            "shared_text": shared.from_text(messages=MESSAGES, responses=RESPONSES)}


def reward_model_job(*, rank: int, checkpoints: dict, rows: dict, pairs: dict) -> dict:
    from megarl.config.settings import PreferenceUpdateSettings
    from megarl.engines.distributed import parallel_layout, set_model_parallel
    from megarl.engines.reward_model import RewardModelEngine

    out = {}
    for layout_name, layout in LAYOUTS.items():
        set_model_parallel(**layout)
        shard = parallel_layout()["dp_rank"]
        for name, checkpoint in checkpoints.items():
            if (layout_name, name) not in RUNS:
                continue
            config = json.loads((Path(checkpoint) / "config.json").read_text())
            engine = RewardModelEngine(hf_config=config, weights=checkpoint, seed=0, params_dtype="float32",
                                       transformer_impl="local", optimizer=optimizer(lr=0.0))
            result = {kind: engine.compute_scores(r, batching=batching(4)) for kind, r in rows.items()}
            result["packed"] = engine.compute_scores(rows["retemplated"], batching=batching(4, 40))
            result["packed_shared"] = engine.compute_scores(rows["shared"], batching=batching(4, 40))
            dp = parallel_layout()["dp_size"]
            local = {key: value.chunk(dp)[shard] for key, value in pairs.items()}
            settings = PreferenceUpdateSettings(epochs=1, mini_batch_size=64, batching=batching(1), shuffle=False,
                                                seed=0)
            result["update"] = engine.update(local, settings)
            result["state"] = engine.hf_state_dict()
            out[(layout_name, name)] = result
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    checkpoints = _save_models(root)
    rows = _rows(root)
    chosen, rejected = rows["shared"], rows["retemplated"]  # any two row sets make pairs
    pairs = {f"{side}_{key}": value[side_rows] for side, side_rows in (("chosen", slice(0, 6)),
                                                                       ("rejected", slice(0, 6)))
             for key, value in (chosen if side == "chosen" else rejected).items()}
    pairs["margin"] = MARGINS
    out = run_spawned(reward_model_job, world_size=2, checkpoints=checkpoints, rows=rows, pairs=pairs)
    return checkpoints, rows, out


def _hf_scores(checkpoint: str, rows: dict) -> torch.Tensor:
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=rows["input_ids"], attention_mask=rows["attention_mask"],
                     position_ids=rows["position_ids"]).logits.squeeze(-1)


@pytest.mark.parametrize("layout,name", RUNS)
def test_scores_equal_hf_sequence_classification(job, name, layout):
    checkpoints, rows, out = job
    for rank in range(2):
        result = out[rank][(layout, name)]
        for kind in ("shared", "retemplated", "shared_text"):
            expected = _hf_scores(checkpoints[name], rows[kind])
            assert expected.std() > 1e-2  # the rows are told apart: a constant would not pass by accident
            torch.testing.assert_close(result[kind], expected, atol=1e-4, rtol=0)
        torch.testing.assert_close(result["packed"], _hf_scores(checkpoints[name], rows["retemplated"]),
                                   atol=1e-4, rtol=0)
        torch.testing.assert_close(result["packed_shared"], _hf_scores(checkpoints[name], rows["shared"]),
                                   atol=1e-4, rtol=0)


def test_with_pad_equal_to_eos_the_score_is_read_before_the_trailing_eos(job):
    checkpoints, rows, _ = job
    shared = rows["shared"]
    assert (shared["input_ids"][:, -1] == EOS).all()  # EOS-terminated rows: the pad = EOS case differs here
    # HF's rule for this checkpoint is not "the last attended token": a model pooling there scores otherwise.
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints["llama_pad_eos"],
                                                               attn_implementation="eager")
    with torch.no_grad():
        per_token = model.score(model.model(input_ids=shared["input_ids"], attention_mask=shared["attention_mask"],
                                            position_ids=shared["position_ids"]).last_hidden_state).squeeze(-1)
    hf = _hf_scores(checkpoints["llama_pad_eos"], shared)
    torch.testing.assert_close(hf, per_token[:, -2], atol=1e-5, rtol=0)
    assert (hf - per_token[:, -1]).abs().min() > 1e-3


def test_retemplating_renders_the_reward_models_chat_template(job, tokenizer):
    _, rows, _ = job
    shared = tokenizer.decode(rows["shared"]["input_ids"][0][rows["shared"]["attention_mask"][0].bool()])
    other = tokenizer.decode(rows["retemplated"]["input_ids"][0][rows["retemplated"]["attention_mask"][0].bool()])
    assert shared == ('<|im_start|>user\nAnswer after "####". 07+45=?<|im_end|>\n<|im_start|>assistant\n'
                      "#### 52<|im_end|>")
    assert other == '[user] Answer after "####". 07+45=? [end]\n[assistant] #### 52 [end]\n'
    # From text, shared tokenization gives exactly what generation produced.
    assert torch.equal(rows["shared_text"]["input_ids"], rows["shared"]["input_ids"])


@pytest.mark.parametrize("name", list(MODELS))
def test_bradley_terry_loss_and_weights_round_trip(job, name):
    checkpoints, rows, out = job
    chosen = _hf_scores(checkpoints[name], rows["shared"])
    rejected = _hf_scores(checkpoints[name], rows["retemplated"])
    margin = chosen - rejected
    loss = -torch.nn.functional.logsigmoid(margin - MARGINS).mean()
    reference = AutoModelForSequenceClassification.from_pretrained(checkpoints[name]).state_dict()
    for layout in [layout for layout, model in RUNS if model == name]:
        result = out[0][(layout, name)]
        assert result["update"]["rm/loss"] == pytest.approx(float(loss), abs=1e-5)
        assert result["update"]["rm/accuracy"] == pytest.approx(float((margin > 0).float().mean()))
        assert result["update"]["rm/margin"] == pytest.approx(float(margin.mean()), abs=1e-5)
        # lr 0: the weights are the checkpoint's, score head included.
        assert set(result["state"]) == set(reference)
        for key, tensor in reference.items():
            torch.testing.assert_close(result["state"][key], tensor, atol=0, rtol=0)
