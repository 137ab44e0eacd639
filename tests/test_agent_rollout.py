"""Multi-turn generation through the real path: a CPU-engine fleet, `start_agent`, `Roles.generate` and the
episode reward phase, on a tiny random model playing the guessing game (it answers anything, so every
episode runs several turns).

Every `/generate` body the fleet sends is recorded: each turn's `input_ids` must be the previous turn's
plus that turn's output and the environment's reply, and the batch the trainer gets must hold exactly
those ids, with the engine's log-probs on the model's tokens only.
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest
import torch

from megarl.config import load_recipe
from megarl.config.settings import multi_turn_settings, rollout_sampling
from megarl.controller.multi_turn import EpisodeRewards, start_agent
from megarl.controller.phases import add_response_mask, add_uids, split_generation_batch
from megarl.controller.roles import Roles
from megarl.data.dataset import RLDataset, collate_prompts
from megarl.data.guessing import guessing_rows
from megarl.data.tokenizer import load_tokenizer
from megarl.protocol import Batch
from megarl.rollout.fleet import RolloutFleet
from megarl.rollout.server_host import ServerSpec

pytestmark = pytest.mark.dist

BUDGET, PER_TURN, N = 120, 6, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from _tiny import tiny_model

    root = tmp_path_factory.mktemp("agent_rollout")
    tokenizer = load_tokenizer()
    model = tiny_model("llama", seed=4, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(root / "model")
    recipe = load_recipe(_recipe(root))
    rows = guessing_rows(4, seed=0, split="train")
    prompts = collate_prompts(list(RLDataset(rows, tokenizer, max_prompt_length=96)), tokenizer.pad_token_id)
    spec = ServerSpec(backend="cpu", model_path=str(root / "model"), log_dir=str(root / "logs"), api_key="k")
    with ExitStack() as cleanup:
        fleet = cleanup.enter_context(RolloutFleet(spec, num_servers=1,
                                                   pad_token_id=tokenizer.pad_token_id, seed=1, use_ray=False))
        sent: list[list[int]] = []
        request = fleet._client.request

        async def recording(url, method, endpoint, body=None):
            reply = await request(url, method, endpoint, body)
            if endpoint == "/generate":
                sent.append((list(body["input_ids"]), reply["output_ids"], reply["meta_info"]))
            return reply

        fleet._client.request = recording
        episodes = start_agent(multi_turn_settings(recipe), fleet=fleet, tokenizer=tokenizer, run_dir=root / "run", cleanup=cleanup)
        roles = Roles(actor=None, rollout=fleet, reward=EpisodeRewards(), memory=None, episodes=episodes)
        batch = add_uids(Batch.from_dict(prompts))
        gen_batch = split_generation_batch(batch).repeat(N, interleave=True)
        batch = batch.repeat(N, interleave=True)
        scoring = roles.reward.begin(batch, gen_batch)
        rollout = roles.generate(gen_batch, rollout_sampling(recipe, eos_token_id=tokenizer.eos_token_id), seed=0, on_rows=scoring.add)
        batch = add_response_mask(batch.union(rollout))
        batch, metrics = scoring.finish(batch, rows=np.arange(len(batch)))
        yield tokenizer, batch, metrics, sent


def _recipe(root) -> dict:
    import yaml

    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "base": str(__import__("pathlib").Path(__file__).resolve().parents[1] / "recipes" / "_base-cpu.yaml"),
        "name": "agent-rollout", "algorithm": {"adv_estimator": "grpo"},
        "actor": {"optim": {"lr": 1e-4}, "ppo_mini_batch_size": 8, "ppo_micro_batch_size": 8},
        "data": {"train_batch_size": 4, "max_response_length": BUDGET},
        "rollout": {"n": N, "multi_turn": {"environment": "guessing", "max_turns": 5,
                                           "max_tokens_per_turn": PER_TURN, "max_tool_response_tokens": 16}},
        "trainer": {"total_steps": 1, "output_dir": str(root / "runs")},
    }))
    return path


def test_each_turn_continues_the_exact_ids_of_the_last(setup):
    tokenizer, batch, _, sent = setup
    width = batch["prompts"].shape[1]
    rows_checked = 0
    for row in range(len(batch)):
        prompt = batch["prompts"][row][batch["attention_mask"][row, :width].bool()].tolist()
        length = int(batch["attention_mask"][row, width:].sum())
        trained = prompt + batch["responses"][row, :length].tolist()
        # This row's requests: those whose input and output both lie along its trained ids (rows share prompts,
        # not sampled tokens), in order of length.
        turns = sorted((body for body in sent if trained[: len(body[0]) + len(body[1])] == body[0] + body[1]),
                       key=lambda body: len(body[0]))
        assert turns and turns[0][0] == prompt
        assert len(turns) == batch["num_turns"][row]
        for (ids, out, _), (next_ids, _, _) in zip(turns, turns[1:]):
            assert next_ids[: len(ids) + len(out)] == ids + out  # a prefix extension: nothing re-tokenized
        mask = batch["response_mask"][row, :length].bool()
        generated = [token for ids, out, _ in turns for token in out]
        assert batch["responses"][row, :length][mask].tolist() == generated  # trained ids == generated ids
        logprobs = [entry[0] for _, _, meta in turns for entry in meta["output_token_logprobs"]]
        assert torch.allclose(batch["rollout_log_probs"][row, :length][mask], torch.tensor(logprobs))
        assert (batch["rollout_log_probs"][row, :length][~mask] == 0).all()
        rows_checked += 1
    assert rows_checked == len(batch) == 4 * N


def test_rewards_turns_and_metrics(setup):
    _, batch, metrics, _ = setup
    turns = np.array(list(batch["num_turns"]))
    assert (turns >= 2).all() and metrics["multi_turn/turns/max"] == turns.max()
    assert metrics["multi_turn/turns/mean"] == pytest.approx(turns.mean())
    # Each wrong guess costs 0.05 on its turn's last token (a turn the budget cut off is never stepped on, and
    # truncation itself is rewarded 0): the scores are the environment's, nothing else.
    assert torch.equal(batch["token_level_scores"], batch["env_scores"])
    rewarded = (batch["env_scores"] != 0).sum(-1)
    assert ((rewarded == torch.as_tensor(turns)) | (rewarded == torch.as_tensor(turns) - 1)).all()
    # A right guess scores 1 on its turn: the untrained model's guesses are sampled, so one may hit the secret.
    scores = batch["env_scores"][batch["env_scores"] != 0]
    assert (torch.isclose(scores, torch.tensor(-0.05)) | (scores == 1.0)).all(), scores
    assert torch.isclose(scores, torch.tensor(-0.05)).any()
    span = batch["attention_mask"][:, batch["prompts"].shape[1]:].float()
    share = 1 - (batch["response_mask"] * span).sum() / span.sum()
    assert metrics["multi_turn/tool_token_share"] == pytest.approx(float(share)) and 0 < share < 1
    assert metrics["multi_turn/truncated"] == pytest.approx(np.mean(list(batch["truncated"])))
    assert [segment["who"] for segment in batch["turns"][0]][:3] == ["assistant", "user", "assistant"]

