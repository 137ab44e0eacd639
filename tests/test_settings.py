"""config/settings.py, the one road from recipe to runtime settings: what each settings object carries, and that
nothing past megarl/config reads the recipe's rollout section.

`rollout.temperature` reaches its three uses (the sampler, the log-prob pass, the loss) through one
`SamplingSettings`; the `/generate` body is built from that object by one builder.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.config.settings import (
    SamplingSettings,
    engine_settings,
    judge_fleet_settings,
    judge_sampling,
    policy_update_settings,
    rollout_fleet_settings,
    rollout_sampling,
    step_settings,
    validation_sampling,
    warmup_engine_settings,
    weight_sync_settings,
)
from megarl.config.reward import JudgeConfig
from megarl.rollout.sampling import SEED_MODULUS, generate_body, sample_seed, sampling_params

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
EOS = 7


def _recipe(*overrides: str, name: str = "quickstart-ppo-cpu.yaml"):
    return load_recipe(RECIPES / name, list(overrides))


def test_rollout_temperature_reaches_the_sampler_the_log_prob_pass_and_the_loss_through_one_object():
    recipe = _recipe("rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=20", "rollout.ignore_eos=true")
    sampling = rollout_sampling(recipe, eos_token_id=EOS)
    assert sampling == SamplingSettings(max_new_tokens=recipe.data.max_response_length, temperature=0.7, top_p=0.9,
                                        top_k=20, stop_token_ids=(EOS,), ignore_eos=True)
    step = step_settings(recipe, sampling=sampling, num_devices=2)
    assert step.sampling is sampling  # the sampler and the log-prob pass (Trainer.step reads step.sampling)
    assert policy_update_settings(recipe, sampling=sampling).temperature == 0.7  # the loss
    assert sampling_params(sampling) == {"max_new_tokens": recipe.data.max_response_length, "temperature": 0.7,
                                         "top_p": 0.9, "top_k": 20, "ignore_eos": True, "stop_token_ids": [EOS]}


def test_validation_samples_like_training_at_the_validation_temperature_and_the_judge_its_own_way():
    recipe = _recipe("rollout.temperature=0.7", "rollout.val_temperature=0.2")
    training = rollout_sampling(recipe, eos_token_id=EOS)
    assert validation_sampling(recipe, eos_token_id=EOS) == replace(training, temperature=0.2)
    judge = JudgeConfig(model_path="judge", prompt_template="{prompt} {response}", max_new_tokens=9, temperature=0.3)
    recipe = recipe.model_copy(update={"reward": recipe.reward.model_copy(update={"judge": judge})})
    assert judge_sampling(recipe, eos_token_id=3) == SamplingSettings(max_new_tokens=9, temperature=0.3, top_p=1.0,
                                                                      top_k=-1, stop_token_ids=(3,), ignore_eos=False)
    fleet = judge_fleet_settings(recipe)
    assert (fleet.model_path, fleet.tokenizer_path, fleet.routing, fleet.enable_memory_saver) == (
        "judge", "judge", "client", False)


def test_the_policy_fleet_takes_the_rollout_section_and_sleeps_only_colocated_with_offload():
    recipe = _recipe("rollout.engine_threads=2", "rollout.max_concurrency=3", "seed=5")
    fleet = rollout_fleet_settings(recipe)
    assert (fleet.threads, fleet.max_concurrency, fleet.seed, fleet.model_path) == (2, 3, 5, None)
    assert fleet.enable_memory_saver == (recipe.placement.colocate and recipe.placement.offload)


def test_engine_settings_per_role():
    recipe = _recipe()
    actor, critic = engine_settings(recipe, "actor"), engine_settings(recipe, "critic")
    assert (actor.kind, critic.kind) == ("policy", "value")
    assert actor.optimizer.lr == recipe.actor.optim.lr and critic.optimizer.lr == recipe.critic.optim.lr
    assert actor.parallel == recipe.actor.parallel.model_dump() and actor.params_dtype == recipe.model.dtype
    assert warmup_engine_settings(recipe, layout_of="critic") == replace(actor, parallel=critic.parallel)


def test_bucket_size_is_whole_bytes():
    sync = weight_sync_settings(_recipe("weight_sync.bucket_mb=3"), Path("run"))
    assert sync.bucket_bytes == 3 * 2**20 and isinstance(sync.bucket_bytes, int)


def test_one_generate_body_a_copy_per_row_each_with_its_rows_seed():
    sampling = SamplingSettings(max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=-1, stop_token_ids=(),
                                ignore_eos=False)
    body = generate_body([5, 6], [6, 7, 8], sampling=sampling, seed=11, return_logprob=True)
    assert body["input_ids"] == [[5, 6]] * 3 and body["return_logprob"] is True
    assert [params["sampling_seed"] for params in body["sampling_params"]] == [sample_seed(11, row) for row in (6, 7, 8)]
    assert sample_seed(11, 7) == (11 * 1_000_003 + 7) % SEED_MODULUS
    assert "stop_token_ids" not in body["sampling_params"][0]
    single = generate_body([5, 6], [2], sampling=sampling, seed=None, return_logprob=False)
    assert single == {"input_ids": [5, 6], "sampling_params": sampling_params(sampling), "return_logprob": False}


OUTSIDE_CONFIG = [path for path in sorted((ROOT / "megarl").rglob("*.py"))
                  if "config" not in path.relative_to(ROOT / "megarl").parts[:1]]


@pytest.mark.parametrize("section", ["rollout", "weight_sync"])
def test_nothing_past_config_reads_the_recipes_section(section):
    """`<anything>.rollout.<field>`: the step, the fleet and the engines get their settings from config/settings.py."""
    reads = []
    for path in OUTSIDE_CONFIG:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == section and isinstance(node.value.value, ast.Name)
                    and node.value.value.id == "recipe"):
                reads.append(f"{path.relative_to(ROOT)}:{node.lineno}: recipe.{section}.{node.attr}")
    # The benchmark report prints the recipe; `megarl plan` sizes the recipe as written, before any engine exists.
    allowed = {"megarl/bench/step_report.py", "megarl/bench/run.py"}
    assert [read for read in reads if read.split(":")[0] not in allowed and not read.startswith("megarl/plan/")] == []
