"""`megarl train-rm` on a small pair set written here: validation accuracy above 0.9, and the HF checkpoint it
writes loads in transformers' AutoModelForSequenceClassification and ranks the validation pairs as reported.

The pairs state a preference a tiny model learns in a few dozen steps: the answer in
the task's format ("#### <sum>") over the same problem answered without it (the bare
number, words, a refusal). Inputs that would be refused are checked too.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from megarl.cli import main
from megarl.commands.rm_training import train_reward_model
from megarl.config import load_recipe
from megarl.data.preference import write_pairs
from megarl.data.rm_inputs import RewardModelInputs
from megarl.data.tokenizer import load_tokenizer

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-rm-cpu.yaml"
BAD_ANSWERS = ("{total}", "I think it is {total}.", "no idea", "#### ", "the sum is {total}")


def _pairs(num: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": [{"role": "user", "content": f'Answer after "####". {a:02d}+{b:02d}=?'}],
                     "chosen": f"#### {a + b}", "rejected": rng.choice(BAD_ANSWERS).format(total=a + b)})
    return rows


def _overrides(tmp_path: Path) -> list[str]:
    train, val = write_pairs(_pairs(640, 1), tmp_path / "pairs" / "train.parquet"), write_pairs(
        _pairs(128, 2), tmp_path / "pairs" / "val.parquet")
    return [f"trainer.output_dir={tmp_path}", f"reward_model.path={tmp_path / 'rm'}", "trainer.logging.console=false",
            "reward_model.train.synthetic=null", f"reward_model.train.train_files=[{train}]",
            f"reward_model.train.val_files=[{val}]", "reward_model.train.sft_steps=0",
            "reward_model.train.optim.lr=1e-3", "reward_model.train.mini_batch_size=32",
            "reward_model.train.micro_batch_size=16", "reward_model.train.val_every=10"]


@pytest.mark.dist
def test_train_rm_learns_the_pairs_and_writes_an_hf_reward_model(ray_session, tmp_path):
    overrides = _overrides(tmp_path)
    result = train_reward_model(load_recipe(RECIPE, overrides))
    assert result.steps == 20 and result.path == tmp_path / "rm"
    assert result.val_accuracy > 0.9
    records = [json.loads(line) for line in (tmp_path / "quickstart-rm-cpu" / "train-rm" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert [r["step"] for r in records if "val/rm_accuracy" in r] == [10, 20]
    assert records[0]["rm/loss"] == pytest.approx(0.6931, abs=1e-3)  # the zero head scores every row 0

    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(result.path).eval()
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.num_labels == 1
    tokenizer = load_tokenizer(str(result.path))
    inputs = RewardModelInputs(tokenizer, load_tokenizer(), max_length=256)
    val = _pairs(128, 2)
    scores = []
    for side in ("chosen", "rejected"):
        rows = inputs.from_text(messages=[r["prompt"] for r in val], responses=[r[side] for r in val])
        with torch.no_grad():
            scores.append(model(**rows).logits.squeeze(-1))
    assert float((scores[0] > scores[1]).float().mean()) == pytest.approx(result.val_accuracy)


def test_train_rm_refuses_to_overwrite_a_reward_model(tmp_path, capsys):
    (tmp_path / "rm").mkdir()
    code = main(["train-rm", str(RECIPE), "--set", f"reward_model.path={tmp_path / 'rm'}",
                 "--set", f"trainer.output_dir={tmp_path}"])
    assert code == 2
    assert f"reward_model.path: {tmp_path / 'rm'} already exists" in capsys.readouterr().err
