"""The SFT warm-up's held-out stop (`sft_warmup.stop_accuracy`, megarl/controller/sft.py): the share it compares,
its problems, when it is checked and what the warm-up then reports. The policy is a stand-in here (its maths is
test_engine_actor's); the data, the supervised batches and the tracker are the run's own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from megarl.config import load_recipe
from megarl.controller.bootstrap import prepare_data
from megarl.controller.sft import CHECK_EVERY, HELD_OUT_PROBLEMS, reproduced_share, run_sft_warmup
from megarl.tracking.tracker import Tracker

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


def test_the_share_counts_rows_whose_every_supervised_token_is_above_one_half():
    generator = torch.Generator().manual_seed(0)
    rows, prompt, response = 64, 5, 7
    # Probabilities around 1/2, so that rows of every kind occur; a row with no supervised token counts as written.
    log_probs = torch.log(torch.rand(rows, response, generator=generator) * 0.6 + 0.45)
    loss_mask = (torch.rand(rows, prompt + response, generator=generator) < 0.5).float()
    loss_mask[0] = 0
    expected = 0
    for row in range(rows):
        expected += all(math.exp(log_probs[row, t]) > 0.5 for t in range(response) if loss_mask[row, prompt + t] > 0)
    share = reproduced_share(log_probs, loss_mask)
    assert share == expected / rows
    assert 0 < share < 1  # both kinds of row occur, so a wrong comparison would show
    # Exactly 1/2 is not above it: the argmax could be another token of probability 1/2.
    assert reproduced_share(torch.full((1, 2), math.log(0.5)), torch.ones(1, 2)) == 0.0


class _Policy:
    """Stands in for the actor's PolicyRole: a loss that falls, and held-out log-probs under which the first
    `0.1 * check` of the rows are written at the check-th call."""

    def __init__(self):
        self.steps, self.checks, self.held_out, self.optimizer_resets = 0, 0, None, 0

    def sft(self, batch, *, batching, lr):
        self.steps += 1
        return {"sft/loss": 1.0 / self.steps, "sft/grad_norm": 0.5}

    def response_log_probs(self, batch):
        self.checks += 1
        self.held_out = batch
        rows, width = batch["responses"].shape
        written = round(0.1 * self.checks * rows)
        log_probs = torch.full((rows, width), math.log(0.3))
        log_probs[:written] = math.log(0.9)
        return log_probs

    def reset_optimizer_state(self):
        self.optimizer_resets += 1


@pytest.mark.parametrize("num_val", [40, HELD_OUT_PROBLEMS + 100])
def test_the_warm_up_stops_at_the_first_check_that_reaches_the_target(tmp_path, capsys, num_val):
    recipe = load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path}", "sft_warmup.stop_accuracy=0.35",
                                      f"data.synthetic.num_val={num_val}", "trainer.logging.tensorboard=false"])
    data = prepare_data(recipe, tmp_path / "run")
    policy, tracker = _Policy(), Tracker(tmp_path / "run", total_steps=recipe.trainer.total_steps)
    steps = run_sft_warmup(policy, data, recipe, tracker)
    tracker.close()
    # Checked every CHECK_EVERY steps until the share is at half the target (0.2 >= 0.175), then every step:
    # 0.1, 0.2, 0.3, then 0.4 >= 0.35 at the fourth check.
    check_steps = [CHECK_EVERY, 2 * CHECK_EVERY, 2 * CHECK_EVERY + 1, 2 * CHECK_EVERY + 2]
    assert steps == policy.steps == check_steps[-1] and policy.checks == 4 and policy.optimizer_resets == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "sft_metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps
    checked = [(record["sft/step"], record["sft/reproduced"]) for record in records if "sft/reproduced" in record]
    rows = min(num_val, HELD_OUT_PROBLEMS)
    assert checked == [(step, round(0.1 * k * rows) / rows) for k, step in enumerate(check_steps, start=1)]
    # The held-out problems are the validation set's first ones, each with its reference solution supervised.
    held_out = policy.held_out
    assert len(held_out) == rows
    tokenizer = data.tokenizer
    for index in (0, rows - 1):
        row = data.val_dataset[index]
        width = held_out["responses"].shape[1]
        solution = held_out["responses"][index][held_out["loss_mask"][index, -width:] > 0].tolist()
        assert solution == tokenizer.encode(row["extra_info"]["answer"], add_special_tokens=False) + [
            tokenizer.eos_token_id]
        assert held_out["loss_mask"][index, :-width].sum() == 0
    captured = capsys.readouterr()
    loss = sum(1 / s for s in range(steps - 9, steps + 1)) / 10  # the stand-in's loss, mean of the last 10 steps
    assert (f"sft warm-up done at step {steps}, loss {loss:.4f} (mean of the last 10 steps, held-out problems "
            f"reproduced {checked[-1][1]:.3f}; held-out accuracy reached)") in captured.err
