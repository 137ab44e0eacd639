"""The shipped recipes: every one validates, the production ones resolve to their named layout,
and `model.path` with an inline `model.config` (validate off-cluster, check on-cluster)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megarl.config import load_recipe
from megarl.config.layout import resolve_layout
from megarl.errors import InputError

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
PRODUCTION = {
    "ppo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml": ("actor", "critic"),
    "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml": ("actor", "reference"),
}
# Qwen3-8B's public HF config.
QWEN3_8B = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


def _recipes() -> list[Path]:
    return sorted(path for path in RECIPES.glob("*.yaml") if not path.name.startswith("_"))


@pytest.mark.parametrize("path", _recipes(), ids=lambda p: p.name)
def test_every_recipe_validates(path: Path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem


def test_the_production_recipes_are_present():
    assert set(PRODUCTION) <= {path.name for path in _recipes()}
    assert (RECIPES / "quickstart-ppo-cpu.yaml").exists()


@pytest.mark.parametrize("name", sorted(PRODUCTION))
def test_production_recipes_resolve_to_tp4_pp2_dp2_on_16_gpus(name: str):
    recipe = load_recipe(RECIPES / name)
    layout = resolve_layout(recipe)
    assert set(layout) == {*PRODUCTION[name], "rollout"}
    for role in PRODUCTION[name]:
        resolved = layout[role]
        assert (resolved.tp, resolved.pp, resolved.dp, resolved.world_size) == (4, 2, 2, 16), role
    assert layout["rollout"].world_size == 16
    assert recipe.model.hf_config() == QWEN3_8B  # the checkpoint is not here: the inline config is used
    assert recipe.data.train_batch_size == 1024
    # 256 prompts per mini-batch, each with its rollout.n responses.
    assert recipe.actor.ppo_mini_batch_size == 256 * recipe.rollout.n


def test_ppo_and_grpo_production_recipes_differ_where_the_algorithms_do():
    ppo = load_recipe(RECIPES / "ppo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml")
    grpo = load_recipe(RECIPES / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml")
    assert (ppo.algorithm.adv_estimator, ppo.rollout.n, ppo.critic is not None) == ("gae", 1, True)
    assert (grpo.algorithm.adv_estimator, grpo.rollout.n, grpo.critic) == ("grpo", 8, None)
    assert grpo.actor.use_kl_loss and not ppo.actor.use_kl_loss
    assert {Path(f).parent.name for f in ppo.data.train_files} == {"gsm8k", "math"}


def _checkpoint(tmp_path: Path, **changes) -> Path:
    path = tmp_path / "Qwen3-8B"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**QWEN3_8B, "architectures": ["Qwen3ForCausalLM"], **changes}))
    return path


def test_path_with_an_inline_config_that_agrees_with_the_checkpoint(tmp_path: Path):
    path = _checkpoint(tmp_path)
    recipe = load_recipe(RECIPES / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml", [f"model.path={path}"])
    # The checkpoint's config.json wins (it has more keys); the inline keys all agree with it.
    assert recipe.model.hf_config()["architectures"] == ["Qwen3ForCausalLM"]


def test_path_with_an_inline_config_that_disagrees_names_each_key(tmp_path: Path):
    path = _checkpoint(tmp_path, hidden_size=2048, num_hidden_layers=28)
    with pytest.raises(InputError) as error:
        load_recipe(RECIPES / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml", [f"model.path={path}"])
    text = "\n".join(error.value.problems)
    assert f"model.config.hidden_size: {path / 'config.json'} has 2048 (got 4096)" in text
    assert f"model.config.num_hidden_layers: {path / 'config.json'} has 28 (got 36)" in text
    assert "vocab_size" not in text


def test_a_model_needs_a_path_or_a_config():
    with pytest.raises(InputError) as error:
        load_recipe(RECIPES / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml", ["model.path=null", "model.config=null"])
    assert any("model.path: give model.path, model.config, or both" in line for line in error.value.problems)


def test_the_single_gpu_starter_is_one_colocated_device_with_a_half_billion_parameter_qwen(capsys):
    from megarl.cli import main
    from megarl.models import arch_from_hf, hf_param_shapes

    path = RECIPES / "grpo-qwen2.5-0.5b-gsm8k-1gpu.yaml"
    recipe = load_recipe(path)
    layout = resolve_layout(recipe)
    assert set(layout) == {"actor", "reference", "rollout"}
    for role in ("actor", "reference", "rollout"):
        assert (layout[role].tp, layout[role].world_size) == (1, 1), role
    assert recipe.placement.device == "cuda" and recipe.placement.colocate and recipe.placement.offload
    assert recipe.rollout.backend == "sglang" and recipe.algorithm.adv_estimator == "grpo"
    # Qwen2.5-0.5B: 494M parameters with the embedding tied to the output layer.
    shapes = hf_param_shapes(arch_from_hf(recipe.model.hf_config()))
    parameters = sum(math.prod(shape) for shape in shapes.values())
    assert 0.45e9 < parameters < 0.55e9, parameters
    # The model and data are not on this machine: --offline checks the recipe and its layout alone.
    assert main(["validate", "--offline", str(path)]) == 0
    assert "rollout    pool colocated (1x1)  world 1  servers 1 x tp 1" in capsys.readouterr().out
