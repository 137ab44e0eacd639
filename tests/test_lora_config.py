"""`actor.lora` in recipes: off by default, the settings the engine gets, and `validate`'s LoRA rules (one line per
problem naming the key, exit status 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megarl.cli import main
from megarl.config import load_recipe
from megarl.config.layout import active_roles
from megarl.config.settings import lora_settings, weight_sync_settings
from megarl.config.training import LORA_TARGETS
from megarl.models.lora import TARGETS

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
LORA = ["actor.lora={rank: 8, alpha: 16}", "sft_warmup.steps=0"]


def test_lora_is_off_by_default_and_the_targets_agree_with_the_engine():
    assert load_recipe(QUICKSTART).actor.lora is None
    assert lora_settings(load_recipe(QUICKSTART)) is None
    assert set(LORA_TARGETS) == set(TARGETS)


def test_lora_settings_and_no_reference_role():
    recipe = load_recipe(QUICKSTART, [*LORA, "actor.use_kl_loss=true", "seed=7"])
    settings = lora_settings(recipe)
    assert (settings.rank, settings.alpha, settings.dropout, settings.init, settings.seed) == (8, 16.0, 0.0,
                                                                                              "kaiming", 7)
    assert settings.targets == LORA_TARGETS  # every target by default
    assert "reference" not in active_roles(recipe)  # the actor with adapters off is the reference
    assert "reference" in active_roles(load_recipe(QUICKSTART, ["actor.use_kl_loss=true"]))
    assert weight_sync_settings(recipe, Path("run")).lora == "merged"


def _validate(capsys, overrides: list[str]) -> list[str]:
    args = ["validate", str(QUICKSTART)]
    for override in overrides:
        args += ["--set", override]
    code = main(args)
    err = capsys.readouterr().err
    return [code, *err.splitlines()]


def test_validate_accepts_a_lora_recipe(capsys):
    args = ["validate", str(QUICKSTART)]
    for override in [*LORA, "weight_sync.lora=adapter", "actor.lora.target_modules=[linear_qkv, linear_fc2]"]:
        args += ["--set", override]
    assert main(args) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor"]["lora"] == {"rank": 8, "alpha": 16.0, "dropout": 0.0, "init": "kaiming",
                                        "target_modules": ["linear_qkv", "linear_fc2"]}


@pytest.mark.robust
@pytest.mark.parametrize("overrides, line", [
    (["actor.lora={rank: 8}"],
     "sft_warmup.steps: with actor.lora the base is frozen and the warm-up would train it: run `megarl warmup` "
     "without actor.lora and set model.path to its output (got 800)"),
    ([*LORA, "actor.use_kl_loss=true", "reference.parallel.tp=1"],
     "reference.parallel: with actor.lora the reference policy is the actor with its adapters switched off and no "
     "reference engine runs; remove the reference section (got a reference layout)"),
    ([*LORA, "actor.lora.rank=300"],
     "actor.lora.rank: larger than the smallest dimension of an adapted linear (128) (got 300)"),
    (["weight_sync.lora=adapter"], "weight_sync.lora: the adapter-only sync needs actor.lora (got 'adapter')"),
    ([*LORA, "weight_sync.lora=adapter", "weight_sync.transport=distributed", "placement.colocate=false",
      "placement.pools={a: {}}", "placement.roles={actor: a, rollout: a}"],
     "weight_sync.transport: an adapter-only sync (weight_sync.lora: adapter) goes through tensors on colocated "
     "servers or a shared directory: use 'tensor' or 'disk' (got 'distributed')"),
    ([*LORA, "weight_sync.lora=adapter", "weight_sync.transport=disk", "placement.colocate=false",
      "placement.pools={a: {}}", "placement.roles={actor: a, rollout: a}", "rollout.async={max_staleness: 1}"],
     "weight_sync.lora: the adapter-only sync unloads the previous version's adapter, which requests generating "
     "across a sync under rollout.async still name: use 'merged' with rollout.async (got 'adapter')"),
])
def test_validate_refuses_what_lora_cannot_do(capsys, overrides, line):
    code, *errors = _validate(capsys, overrides)
    assert code == 2
    assert any(error.startswith("error: ") and error.endswith(line) for error in errors), errors  # after the file


@pytest.mark.robust
@pytest.mark.parametrize("override, line", [
    ("actor.lora.target_modules=[linear_qkv, q_proj]", "actor.lora.target_modules[1]: Input should be 'linear_qkv', "
     "'linear_proj', 'linear_fc1' or 'linear_fc2' (got 'q_proj')"),
    ("actor.lora.target_modules=[linear_qkv, linear_qkv]",
     "actor.lora.target_modules: each module at most once (repeated: ['linear_qkv']) (got ['linear_qkv', "
     "'linear_qkv'])"),
    ("actor.lora.dropout=1.0", "actor.lora.dropout: Input should be less than 1 (got 1.0)"),
    ("actor.lora.rank=0", "actor.lora.rank: Input should be greater than 0 (got 0)"),
])
def test_bad_lora_values_name_the_key(capsys, override, line):
    code, *errors = _validate(capsys, [*LORA, override])
    assert code == 2
    assert any(error.startswith("error: ") and error.endswith(line) for error in errors), errors


def test_the_lora_quickstart_validates_and_explains_its_reference(capsys):
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-lora-cpu.yaml"
    assert main(["validate", str(recipe), "--offline"]) == 0
    out = capsys.readouterr().out
    assert "#   reference  no engine of its own (the actor with its LoRA adapters switched off)" in out
    loaded = load_recipe(recipe)
    grpo = load_recipe(QUICKSTART)
    # The GRPO quickstart's settings, but for LoRA, its learning rate, the KL loss, the sync and the warm-up.
    differ = {"name", "model", "actor", "weight_sync", "sft_warmup"}
    assert {k: v for k, v in loaded.model_dump().items() if k not in differ} == \
        {k: v for k, v in grpo.model_dump().items() if k not in differ}
    same_actor = {k: v for k, v in loaded.actor.model_dump().items()
                  if k not in ("lora", "optim", "use_kl_loss", "kl_loss_coef")}
    assert same_actor == {k: v for k, v in grpo.actor.model_dump().items() if k in same_actor}
    assert loaded.actor.optim.lr == 4 * grpo.actor.optim.lr
