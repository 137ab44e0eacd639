"""The reward loop: rows scored while generation runs, reward-model batches as they fill, the combine and its
placement, metrics and timings, a remote failure failing the step by uid or dropping the row from its group,
and a remote that the combine does not use never being called.

Generation is played by a thread that hands finished groups to `ScoringRun.add` with
pauses in between (what the fleet's callback does). The reward model is a stand-in
role with the real role's contract (reward-model input rows -> one score per row),
slow on purpose, so overlap is measurable; it records every call. The real reward
model is checked against HF in test_engine_reward_model.py and end to end in
test_e2e_reward_model.py.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import torch

from megarl.algorithms.advantages import grpo
from megarl.algorithms.metrics import compute_data_metrics
from megarl.config import load_recipe
from megarl.controller.reward_loop import ModelSide, RewardLoop
from megarl.controller.reward_setup import start_reward_loop
from megarl.data.padding import left_pad, position_ids_from_mask
from megarl.data.rm_inputs import RewardModelInputs
from megarl.protocol import Batch
from megarl.rewards.manager import RewardManager
from megarl.rewards.registry import build_scorers
from megarl.rewards.remote import RemoteRewardClient, RemoteRewardError
from megarl.rollout.results import GenerationResult

N, PROMPTS, WIDTH = 3, 4, 10
ANSWERS = ["#### 5", "#### 7", "12", "#### 9"]  # ground truth of each prompt
RESPONSES = [["#### 5", "#### 6", "#### 5"], ["#### 7", "", "no idea"], ["#### 12", "#### 12", "#### 21"],
             ["#### 9", "#### 9", "nine"]]
RM_CALL_S = 0.3
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"


class SlowRewardModel:
    """Scores a row by its tokens (sum of ids % 97 / 10), after RM_CALL_S; records the size of every call."""

    def __init__(self):
        self.calls: list[int] = []

    @staticmethod
    def expected(ids: list[int]) -> float:
        return (sum(ids) % 97) / 10

    def score(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(RM_CALL_S)
        self.calls.append(len(rows["input_ids"]))
        return torch.tensor([self.expected(ids[mask.bool()].tolist())
                             for ids, mask in zip(rows["input_ids"], rows["attention_mask"])])


def _step_rows(tokenizer):
    """The step's batch (non-tensor fields, repeated N times) and generation batch, as the trainer builds them."""
    messages = [[{"role": "user", "content": f"What is {i}?"}] for i in range(PROMPTS)]
    prompt_ids = tokenizer([tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                            for m in messages], add_special_tokens=False)["input_ids"]
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    gen = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)})
    batch = Batch.from_dict({"raw_prompt": messages, "data_source": ["openai/gsm8k"] * PROMPTS,
                             "reward_model": [{"ground_truth": a.split()[-1]} for a in ANSWERS],
                             "extra_info": [{} for _ in range(PROMPTS)], "uid": [f"u{i}" for i in range(PROMPTS)]})
    return batch.repeat(N, interleave=True), gen.repeat(N, interleave=True), prompt_ids


def _generate(run, tokenizer, *, pause_s: float) -> torch.Tensor:
    """Hand the groups to the run from another thread, `pause_s` apart; returns the responses tensor [B, WIDTH]."""
    responses = torch.full((PROMPTS * N, WIDTH), tokenizer.pad_token_id)
    groups = []
    for prompt in range(PROMPTS):
        rows, results = [], []
        for sample, text in enumerate(RESPONSES[prompt]):
            ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if text else [])
            row = prompt * N + sample
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            rows.append(row)
            results.append(GenerationResult(ids, [0.0] * len(ids), "stop", "0"))
        groups.append((rows, results))

    def feed():
        for rows, results in reversed(groups):  # finishing order need not be row order
            run.add(rows, results)
            time.sleep(pause_s)

    feeder = threading.Thread(target=feed)
    feeder.start()
    feeder.join()
    return responses


def _finish(run, responses, tokenizer, order):
    mask = (responses != tokenizer.pad_token_id).float()
    batch = Batch.from_dict({"responses": responses[order], "response_mask": mask[order]})
    started = time.perf_counter()
    batch, metrics = run.finish(batch, rows=order)
    return batch, metrics, time.perf_counter() - started


def _loop(tokenizer, side, combine="sum"):
    return RewardLoop(manager=RewardManager(tokenizer, build_scorers()), tokenizer=tokenizer, combine=combine,
                      combine_options={"rule_weight": 2.0, "rm_weight": 0.5, "pass_threshold": 1.0,
                                       "fail_score": -1.0}, model_side=side)


def test_reward_model_batches_fill_while_generating_and_the_combine_lands_in_place(tokenizer):
    model = SlowRewardModel()
    side = ModelSide(reward_model=model, rm_inputs=RewardModelInputs(tokenizer, tokenizer, max_length=64),
                     batch_rows=4)
    loop = _loop(tokenizer, side)
    batch, gen, prompt_ids = _step_rows(tokenizer)
    run = loop.begin(batch, gen)
    responses = _generate(run, tokenizer, pause_s=RM_CALL_S)
    order = np.random.default_rng(0).permutation(PROMPTS * N)  # as if balanced
    out, metrics, finish_s = _finish(run, responses, tokenizer, order)
    loop.close()

    # 12 rows in groups of 3: batches start at 6 and 12 rows (the 4-row threshold is crossed by each second group).
    assert sorted(model.calls) == [6, 6] and sum(model.calls) == PROMPTS * N
    rule = np.array([float(text == f"#### {ANSWERS[p].split()[-1]}") for p in range(PROMPTS) for text in RESPONSES[p]])
    rm = np.array([model.expected(prompt_ids[p] + tokenizer.encode(text, add_special_tokens=False)
                                  + ([tokenizer.eos_token_id] if text else []))
                   for p in range(PROMPTS) for text in RESPONSES[p]])
    lengths = (responses != tokenizer.pad_token_id).sum(-1)[order]
    for i, row in enumerate(order):
        expected = 2.0 * rule[row] + 0.5 * rm[row]  # an empty response too: the row's sum returns its score
        assert out["token_level_scores"][i].sum().item() == pytest.approx(expected, abs=1e-6)
        at = max(int(lengths[i]) - 1, 0)
        assert out["token_level_scores"][i, at].item() == pytest.approx(expected, abs=1e-6)
        assert out["rm_scores"][i, at].item() == pytest.approx(rm[row], abs=1e-6)
    has = np.array([bool(text) for p in range(PROMPTS) for text in RESPONSES[p]])
    assert metrics["reward/rm_score/mean"] == pytest.approx(rm[has].mean())
    assert metrics["reward/rm_score/max"] == pytest.approx(rm[has].max())
    assert metrics["reward/rm_rule_corr"] == pytest.approx(np.corrcoef(rm[has], rule[has])[0, 1])
    # The second batch ran during the (simulated) generation: finishing waits for less than the scoring took.
    assert run.busy_seconds >= 2 * RM_CALL_S
    assert finish_s < run.busy_seconds - 0.5 * RM_CALL_S


def test_without_overlap_the_reward_model_scores_once_in_finish(tokenizer):
    model = SlowRewardModel()
    side = ModelSide(reward_model=model, rm_inputs=RewardModelInputs(tokenizer, tokenizer, max_length=64),
                     batch_rows=None)
    loop = _loop(tokenizer, side, combine="rule_gated")
    batch, gen, _ = _step_rows(tokenizer)
    run = loop.begin(batch, gen)
    responses = _generate(run, tokenizer, pause_s=0.0)
    order = np.arange(PROMPTS * N)
    out, metrics, finish_s = _finish(run, responses, tokenizer, order)
    loop.close()
    assert model.calls == [PROMPTS * N] and finish_s >= RM_CALL_S
    gated = out["token_level_scores"].sum(-1)
    rm = out["rm_scores"].sum(-1)
    # Row 0 is right (keeps its RM score), row 1 is wrong (the fail score).
    assert gated[0].item() == pytest.approx(rm[0].item()) and gated[1].item() == -1.0


def test_a_remote_row_that_keeps_failing_fails_the_step_naming_its_uid(tokenizer):
    # Nothing listens on port 9: every row fails after its retry.
    remote = RemoteRewardClient("http://127.0.0.1:9/score", max_concurrency=4, timeout_s=1.0, retries=1,
                                backoff_s=0.01)
    loop = _loop(tokenizer, ModelSide(remote=remote), combine="rm")
    batch, gen, _ = _step_rows(tokenizer)
    run = loop.begin(batch, gen)
    responses = _generate(run, tokenizer, pause_s=0.0)
    with pytest.raises(RemoteRewardError) as error:
        _finish(run, responses, tokenizer, np.arange(PROMPTS * N))
    loop.close()
    named = {(uid, sample) for uid, sample, _ in error.value.failures}
    assert named == {(f"u{p}", s) for p in range(PROMPTS) for s in range(N)}


class FlakyRemote:
    """The remote client's contract (`submit(request) -> Future of the score`): a row scores len(response) +
    10 * sample; the rows in FAILING fail as a row does after its retries."""

    FAILING = {("u1", 2), ("u3", 0)}  # generation rows 5 and 9

    def __init__(self):
        self.requests: list[dict] = []

    def submit(self, row: dict) -> concurrent.futures.Future:
        self.requests.append(row)
        future = concurrent.futures.Future()
        if (row["uid"], row["sample"]) in self.FAILING:
            future.set_exception(RemoteRewardError([(row["uid"], row["sample"], "HTTP 500 after 4 attempts")]))
        else:
            future.set_result(float(len(row["response"]) + 10 * row["sample"]))
        return future

    def close(self) -> None:
        pass


def test_a_dropped_remote_row_leaves_its_group(tokenizer):
    remote = FlakyRemote()
    loop = _loop(tokenizer, ModelSide(remote=remote, remote_on_failure="drop"), combine="sum")
    batch, gen, _ = _step_rows(tokenizer)
    run = loop.begin(batch, gen)
    responses = _generate(run, tokenizer, pause_s=0.0)
    order = np.random.default_rng(1).permutation(PROMPTS * N)  # as if balanced
    mask = (responses != tokenizer.pad_token_id).float()[order]
    uids = batch["uid"][order]
    out, metrics = run.finish(Batch.from_dict({"responses": responses[order], "response_mask": mask.clone(),
                                               "uid": uids}), rows=order)
    loop.close()

    gone = np.isin(order, [5, 9])
    assert metrics["reward/remote_failed"] == 2 and out["dropped"].tolist() == gone.tolist()
    # A dropped row keeps its place (every shard keeps its size) but has no response token, no score and a uid
    # of its own; the others are scored as usual: 2 * rule + 0.5 * remote.
    assert (out["response_mask"][gone] == 0).all() and (out["token_level_scores"][gone] == 0).all()
    assert len(set(out["uid"][gone]) | set(uids)) == len(set(uids)) + 2
    for i, row in enumerate(order[~gone]):
        prompt, sample = divmod(int(row), N)
        text = RESPONSES[prompt][sample]
        rule = float(text == f"#### {ANSWERS[prompt].split()[-1]}")
        expected = 2.0 * rule + 0.5 * (len(text) + 10 * sample)
        assert out["token_level_scores"][~gone][i].sum().item() == pytest.approx(expected)
    # GRPO with the dropped rows in place equals GRPO on the batch without them: they left their groups.
    kept = torch.as_tensor(~gone)
    advantages, _ = grpo(out["token_level_scores"], out["response_mask"], out["uid"])
    without, _ = grpo(out["token_level_scores"][kept], mask[kept], uids[~gone])
    torch.testing.assert_close(advantages[kept], without)
    assert (advantages[~kept] == 0).all()
    # And the step's metrics count them in no statistic.
    data = dict(token_level_scores=out["token_level_scores"], token_level_rewards=out["token_level_scores"],
                advantages=advantages, returns=advantages, max_response_length=WIDTH, max_prompt_length=8)
    with_placeholders = compute_data_metrics(**data, response_mask=out["response_mask"],
                                             prompt_mask=torch.ones(len(order), 8), kept=kept)
    reference = compute_data_metrics(**{key: value[kept] if isinstance(value, torch.Tensor) else value
                                        for key, value in data.items()},
                                     response_mask=mask[kept], prompt_mask=torch.ones(int(kept.sum()), 8))
    assert with_placeholders == pytest.approx(reference, nan_ok=True)


def test_the_remote_is_called_only_when_combine_uses_it(tokenizer, tmp_path):
    remote = "reward.remote={url: 'http://127.0.0.1:9/score', on_failure: drop}"
    for combine, called in (("rule", False), ("rm", True), ("sum", True)):
        recipe = load_recipe(RECIPE, [remote, f"reward.combine={combine}"])
        with ExitStack() as cleanup:
            loop = start_reward_loop(recipe, pools={}, tokenizer=tokenizer, manager=None, api_key="",
                                     run_dir=tmp_path, cleanup=cleanup)
            assert (loop.model_side.remote is not None) is called, combine
            assert loop.model_side.remote_on_failure == ("drop" if called else "fail")
