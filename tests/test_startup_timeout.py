"""`rollout.startup_timeout_s`: how long a starting server may take, from the recipe to every fleet it starts.

The default fits an 8B model started with CUDA-graph capture (the production recipes
take it); the CPU base recipe, whose tiny model starts in seconds, fails a hung start
fast. The recipe's value reaches the policy's fleet and the judge's fleet alike.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from megarl.cli import main
from megarl.cluster import fleet as cluster_fleet
from megarl.config import load_recipe
from megarl.config.reward import JudgeConfig
from megarl.config.settings import judge_fleet_settings, rollout_fleet_settings

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def test_the_production_recipes_give_servers_900_s_and_the_cpu_ones_120_s():
    assert load_recipe(RECIPES / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml").rollout.startup_timeout_s == 900
    assert load_recipe(RECIPES / "quickstart-grpo-cpu.yaml").rollout.startup_timeout_s == 120


def test_a_timeout_that_is_not_positive_is_refused(capsys):
    code = main(["validate", str(RECIPES / "quickstart-grpo-cpu.yaml"), "--set", "rollout.startup_timeout_s=0"])
    assert code == 2
    assert "rollout.startup_timeout_s" in capsys.readouterr().err


class _Pool:
    device = "cpu"

    def reserve(self) -> None:
        pass

    def actor_options(self, slot: int) -> dict:
        return {"slot": slot}


@pytest.mark.parametrize("start", ["rollout", "judge"])
def test_the_recipes_timeout_reaches_the_fleet(monkeypatch, start):
    built = []
    monkeypatch.setattr(cluster_fleet, "RolloutFleet", lambda spec, **options: built.append(options))
    recipe = load_recipe(RECIPES / "quickstart-grpo-cpu.yaml", ["rollout.startup_timeout_s=321"])
    if start == "rollout":
        cluster_fleet.start_fleet(rollout_fleet_settings(recipe), pool=_Pool(), weights=Path("w"),
                                     pad_token_id=0, api_key="k", log_dir=Path("logs"))
    else:
        judge = JudgeConfig(model_path="judge", prompt_template="{prompt} {response}")
        recipe = recipe.model_copy(update={"reward": recipe.reward.model_copy(update={"judge": judge})})
        cluster_fleet.start_fleet(judge_fleet_settings(recipe), pool=_Pool(), weights=None, pad_token_id=0,
                                     api_key="k", log_dir=Path("logs"))
    assert [options["startup_timeout_s"] for options in built] == [321]
