"""A reward model leaves its engine as `megarl train-rm` now writes it: each rank saves its own shards, then
`megarl export` makes the HF `*ForSequenceClassification` checkpoint.

Two spawned ranks (PP2: the score head on the second stage only) build a reward model
from a tiny HF Llama reward model (random weights, randomised norms and head), take one
Bradley-Terry step at lr 1e-2 (so the weights are the engine's own, not the file's) and
save a weights-only checkpoint. `megarl export` runs in a fresh process, as the CLI
does. Reference: the engine's own weights gathered at save time (`hf_state_dict`, a
test-only full copy), bit for bit in float32; and transformers must load the result as
a one-label sequence classifier without an LM head. A critic's checkpoint has no HF
form: its export is refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _engine_spawn import run_spawned
from _settings import batching, optimizer

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_labels=1, pad_token_id=3, tie_word_embeddings=False)


def save_job(*, rank: int, source: str, ckpt_dir: str, pairs: dict) -> dict | None:
    from megarl.config.settings import PreferenceUpdateSettings
    from megarl.engines.reward_model import RewardModelEngine

    config = json.loads((Path(source) / "config.json").read_text())
    engine = RewardModelEngine(hf_config=config, weights=source, seed=0, params_dtype="float32",
                               transformer_impl="local", optimizer=optimizer(lr=1e-2))
    engine.update(pairs, PreferenceUpdateSettings(epochs=1, mini_batch_size=4, batching=batching(2), shuffle=False,
                                                  seed=0))
    engine.save_checkpoint(ckpt_dir, weights_only=True)
    state = engine.hf_state_dict()
    return state if rank == 0 else None


def _pairs() -> dict:
    gen = torch.Generator().manual_seed(5)
    rows = {}
    for side in ("chosen", "rejected"):
        ids = torch.randint(4, 256, (4, 10), generator=gen)
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        rows.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask,
                     f"{side}_position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
    return rows


@pytest.mark.dist
def test_a_reward_models_sharded_checkpoint_exports_as_a_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification, LlamaConfig

    torch.manual_seed(0)
    source = AutoModelForSequenceClassification.from_config(LlamaConfig(**TINY))
    with torch.no_grad():
        for name, param in source.named_parameters():
            if "norm" in name or name == "score.weight":
                param.uniform_(0.5, 1.5)
    source.save_pretrained(tmp_path / "source")
    state = run_spawned(save_job, world_size=2, layout={"tp": 1, "pp": 2}, source=str(tmp_path / "source"),
                        ckpt_dir=str(tmp_path / "ckpt"), pairs=_pairs())[0]
    info = json.loads((tmp_path / "ckpt" / "megarl_checkpoint.json").read_text())
    assert info["head"] == "score"

    result = subprocess.run([sys.executable, "-m", "megarl", "export", str(tmp_path / "ckpt"), "--hf",
                             str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    exported = model.state_dict()
    assert set(exported) == set(state) and "lm_head.weight" not in exported
    assert not torch.equal(exported["score.weight"], source.state_dict()["score.weight"])  # the step moved it
    for name, tensor in state.items():
        assert torch.equal(exported[name], tensor), name


def test_a_critics_checkpoint_is_refused_by_export(tmp_path):
    (tmp_path / "megarl_checkpoint.json").write_text(json.dumps({
        "format_version": 1, "hf_config": {"model_type": "llama"}, "tokenizer_path": None,
        "params_dtype": "float32", "has_optimizer": False, "saved_layout": {}, "head": "value"}))
    result = subprocess.run([sys.executable, "-m", "megarl", "export", str(tmp_path), "--hf", str(tmp_path / "hf")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "a value model (a critic) has no HF checkpoint form" in result.stderr
    assert "Traceback" not in result.stderr
