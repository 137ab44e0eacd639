"""The controller's data-shaping phases: generation batch, response assembly, masks, advantage fork."""

import numpy as np
import pytest
import torch

from megarl.algorithms import advantages as adv
from megarl.controller import phases
from megarl.protocol import Batch


def _prompts() -> Batch:
    # Two left-padded prompts: [pad, 5, 6] and [7, 8, 9].
    return Batch.from_dict(
        {
            "input_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "position_ids": torch.tensor([[0, 0, 1], [0, 1, 2]]),
            "data_source": ["a", "b"],
        }
    )


def test_generation_batch_takes_the_prompt_tensors_copies_the_row_fields_and_repeats_interleaved():
    batch = phases.add_uids(_prompts())
    gen = phases.split_generation_batch(batch).repeat(2, interleave=True)
    # The tensors move; the rows' fields are copied (multi-turn episodes read them).
    assert sorted(gen.keys()) == ["attention_mask", "data_source", "input_ids", "position_ids", "uid"]
    assert sorted(batch.keys()) == ["data_source", "uid"]
    assert list(gen["data_source"]) == ["a", "a", "b", "b"] and gen["uid"][1] == batch["uid"][0]
    assert phases.prompt_token_lists(gen) == [[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]]
    repeated = batch.repeat(2, interleave=True)
    assert list(repeated["uid"][:2]) == [batch["uid"][0]] * 2 and repeated["uid"][0] != repeated["uid"][2]


def test_a_response_mask_from_generation_is_kept():
    batch = Batch.from_dict({"responses": torch.tensor([[4, 5, 6]]), "attention_mask": torch.tensor([[1, 1, 1, 1]])})
    assert phases.add_response_mask(batch)["response_mask"].tolist() == [[1.0, 1.0, 1.0]]
    batch["response_mask"] = torch.tensor([[1.0, 0.0, 1.0]])  # an episode: the middle token is a tool's
    assert phases.add_response_mask(batch)["response_mask"].tolist() == [[1.0, 0.0, 1.0]]


def test_assemble_rollout_continues_positions_and_masks_padding():
    gen = phases.split_generation_batch(_prompts())
    out = phases.assemble_rollout(
        gen,
        responses=torch.tensor([[11, 2, 3], [12, 13, 14]]),
        response_lengths=torch.tensor([2, 3]),
        rollout_log_probs=torch.tensor([[-0.5, -0.25, -9.0], [-1.0, -2.0, -3.0]]),
    )
    assert out["input_ids"].tolist() == [[0, 5, 6, 11, 2, 3], [7, 8, 9, 12, 13, 14]]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    # Log-probs past the response end are zeroed, not left as engine garbage.
    assert out["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]
    masked = phases.add_response_mask(out)
    assert masked["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


def test_compute_advantage_forks_on_the_estimator():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    mask = torch.ones(4, 2)
    uid = np.array(["p", "p", "q", "q"], dtype=object)
    batch = Batch.from_dict({"token_level_rewards": rewards, "response_mask": mask, "uid": uid,
                             "values": torch.zeros(4, 2)})
    phases.compute_advantage(batch, estimator="grpo", gamma=1.0, lam=1.0, norm_by_std=True)
    expected, _ = adv.grpo(rewards, mask, uid)
    assert torch.equal(batch["advantages"], expected)
    # Each group's two responses get opposite advantages.
    assert batch["advantages"][0, 0] == pytest.approx(-batch["advantages"][1, 0])
    phases.compute_advantage(batch, estimator="gae", gamma=1.0, lam=1.0, norm_by_std=True)
    expected_gae, returns = adv.gae(rewards, torch.zeros(4, 2), mask, gamma=1.0, lam=1.0)
    assert torch.equal(batch["advantages"], expected_gae) and torch.equal(batch["returns"], returns)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo2'"):
        phases.compute_advantage(batch, estimator="ppo2", gamma=1.0, lam=1.0, norm_by_std=True)


@pytest.fixture
def toy_estimator():
    """A leave-the-group-mean-out estimator, registered for one test through the registry alone."""
    from megarl.algorithms.advantages import estimator
    from megarl.registry import ADVANTAGE_ESTIMATORS

    @estimator("toy_group_mean")
    def toy(token_level_rewards, response_mask, index):
        scores = token_level_rewards.sum(-1)
        keys = list(index)
        means = torch.tensor([scores[[k == key for k in keys]].mean() for key in keys])
        advantages = (scores - means).unsqueeze(-1) * response_mask
        return advantages, advantages

    yield "toy_group_mean"
    ADVANTAGE_ESTIMATORS.remove("toy_group_mean")


def test_an_estimator_registered_in_a_test_module_is_usable_from_a_recipe(toy_estimator, tmp_path):
    from megarl.config import load_recipe
    from megarl.errors import InputError

    recipe = load_recipe("recipes/quickstart-grpo-cpu.yaml", [f"algorithm.adv_estimator={toy_estimator}"])
    assert recipe.algorithm.adv_estimator == toy_estimator
    # Its metadata came from its signature: it reads `index`, so a group of one is refused.
    with pytest.raises(InputError, match=f"rollout.n: {toy_estimator} compares responses within a group"):
        load_recipe("recipes/quickstart-grpo-cpu.yaml", [f"algorithm.adv_estimator={toy_estimator}", "rollout.n=1"])
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    batch = Batch.from_dict({"token_level_rewards": rewards, "response_mask": torch.ones(4, 2),
                             "uid": np.array(["p", "p", "q", "q"], dtype=object)})
    phases.compute_advantage(batch, estimator=recipe.algorithm.adv_estimator, gamma=1.0, lam=1.0, norm_by_std=True)
    assert batch["advantages"][:, 0].tolist() == [0.5, -0.5, 1.0, -1.0]
