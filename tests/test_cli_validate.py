"""`megarl validate` / `megarl schema`: the dry run prints a loadable recipe; bad input exits 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from megarl.cli import main
from megarl.config import Recipe, dump_recipe, load_recipe, recipe_json_schema

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"


def test_validate_quickstart_prints_resolved_recipe(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["validate", str(QUICKSTART)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    printed = yaml.safe_load(out)
    # The quickstart's contract: one CPU process, everything colocated, GRPO with groups, the CPU engine.
    assert printed["name"] == "quickstart-grpo-cpu"
    assert printed["placement"] | {"pools": {}, "roles": {}} == {
        "device": "cpu",
        "nodes": 1,
        "gpus_per_node": 1,
        "colocate": True,
        "pools": {},
        "roles": {},
        "offload": True,
    }
    assert printed["algorithm"]["adv_estimator"] == "grpo" and printed["rollout"]["n"] >= 2
    assert printed["rollout"]["backend"] == "cpu" and printed["critic"] is None
    assert printed["model"]["config"]["model_type"] == "llama" and printed["data"]["synthetic"]["task"] == "addition"
    assert printed["actor"]["parallel"]["dp"] == 1  # derived and written back
    assert "# resolved layout:" in out and "#   rollout    pool colocated (1x1)  world 1  servers 1 x tp 1" in out
    # What validate prints is itself a complete recipe that loads back to the same values.
    dumped = tmp_path / "resolved.yaml"
    dumped.write_text(out)
    assert load_recipe(dumped).model_dump() == load_recipe(QUICKSTART).model_dump()


def test_validate_applies_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(QUICKSTART), "--set", "actor.optim.lr=1e-5", "--set", "rollout.n=4"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["actor"]["optim"]["lr"] == 1e-5 and printed["rollout"]["n"] == 4


def test_validate_bad_override_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(QUICKSTART), "--set", "rollout.n=abc", "--set", "actor.optim.lrr=1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "error: --set: actor.optim.lrr: unknown key; did you mean 'actor.optim.lr'? (got 'actor.optim.lrr=1')"
    ]
    assert main(["validate", str(QUICKSTART), "--set", "rollout.n=abc"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --set: rollout.n: Input should be a valid integer, unable to parse string as an integer (got 'abc')"
    ]


# The quickstart turned into a 2-node x 8-GPU PPO layout: what `megarl validate` shows on a laptop.
CLUSTER_OVERRIDES = [
    "placement.device=cuda",
    "placement.nodes=2",
    "placement.gpus_per_node=8",
    "rollout.backend=sglang",
    "rollout.num_servers=8",
    "rollout.tp=2",
    "actor.parallel.tp=2",
    "actor.parallel.pp=2",
    "actor.ppo_micro_batch_size=8",
    "actor.use_kl_loss=true",
    "algorithm.adv_estimator=gae",
    "critic={optim: {lr: 1e-5}, parallel: {tp: 2}, ppo_mini_batch_size: 64, ppo_micro_batch_size: 4}",
]


def test_validate_dry_run_of_a_cluster_layout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["validate", str(QUICKSTART), *[arg for item in CLUSTER_OVERRIDES for arg in ("--set", item)]]) == 0
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert comments == [
        "# resolved layout:",
        "#   device cuda, colocated, allocation 2 node(s) x 8 = 16",
        "#   actor      pool colocated (2x8)  world 16  tp 2  pp 2  vpp -  ep 1  dp 4  sp off",
        "#   critic     pool colocated (2x8)  world 16  tp 2  pp 1  vpp -  ep 1  dp 8  sp off",
        "#   reference  pool colocated (2x8)  world 16  tp 1  pp 1  vpp -  ep 1  dp 16  sp off",
        "#   rollout    pool colocated (2x8)  world 16  servers 8 x tp 2",
    ]
    assert "    betas: [0.9, 0.999]" in out.splitlines()
    dumped = tmp_path / "cluster.yaml"
    dumped.write_text(out)
    assert load_recipe(dumped).model_dump() == load_recipe(QUICKSTART, CLUSTER_OVERRIDES).model_dump()


def test_dump_quotes_strings_that_look_like_floats(tmp_path: Path) -> None:
    recipe = load_recipe(QUICKSTART, ["name='1e5'"])
    assert recipe.name == "1e5"  # quoted on the command line: a string, not 100000.0
    dumped = tmp_path / "d.yaml"
    dumped.write_text(dump_recipe(recipe))
    assert load_recipe(dumped).name == "1e5"


def test_schema_prints_json_with_closed_objects(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema == recipe_json_schema()
    objects = {"Recipe": schema, **schema["$defs"]}
    assert {"ActorConfig", "CriticConfig", "Parallel", "Optim", "PlacementConfig", "PoolSpec"} <= set(objects)
    for name, definition in objects.items():
        assert definition["additionalProperties"] is False, name
    assert {"name", "model", "actor", "critic", "rollout", "placement", "trainer"} <= set(schema["properties"])
    assert schema["properties"]["base"]["type"] == "string"  # the file-only inheritance key
    assert schema["$defs"]["Parallel"]["properties"]["tp"]["description"] == "tensor-parallel size"


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    seen.add(model)
    for field in model.model_fields.values():
        for candidate in _types_in(field.annotation):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel) and candidate not in seen:
                _models(candidate, seen)
    return seen


def _types_in(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", ())
    return [annotation, *[nested for arg in args for nested in _types_in(arg)]]


def test_every_field_is_described_and_every_model_forbids_extras() -> None:
    models = _models(Recipe, set())
    assert len(models) >= 18
    for model in models:
        assert model.model_config.get("extra") == "forbid", model.__name__
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 8, f"{model.__name__}.{name}"


def test_validate_subprocess_bad_recipe_exits_2_without_traceback(tmp_path: Path) -> None:
    recipe = yaml.safe_load(QUICKSTART.read_text())
    recipe["base"] = str(QUICKSTART.parent / recipe["base"])
    recipe["actor"]["ppo_mini_batch_size"] = 100  # 64 prompts x 8 responses = 512 does not split into 100s
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(recipe))
    result = subprocess.run(
        [sys.executable, "-m", "megarl", "validate", str(bad), "--set", "actor.parallel.tp=2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr and result.stdout == ""
    assert result.stderr.splitlines() == [
        "error: --set: actor.parallel.tp: world size 1 (pool 'colocated') is not divisible by tp*pp = 2*1 (got 2)",
        f"error: {bad}: actor.ppo_mini_batch_size: must divide data.train_batch_size * rollout.n = 64*8 = 512"
        " (got 100)",
    ]
