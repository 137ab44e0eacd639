"""Recipe loading: schema errors, `base:` inheritance, `--set` overrides, every cross-field rule, dump and schema."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from megarl.config import (
    active_roles,
    dump_recipe,
    load_recipe,
    resolve_layout,
)
from megarl.config.layout import reference_fused
from megarl.errors import InputError

REPO = Path(__file__).resolve().parents[1]


def cluster_recipe() -> dict[str, Any]:
    """A consistent PPO recipe for 2 nodes x 8 GPUs: world 16, actor tp2 pp2 (dp 4), critic tp4 (dp 4)."""
    return {
        "name": "ppo-test-2n8g",
        "model": {
            "config": {
                "model_type": "llama",
                "vocab_size": 1000,
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "max_position_embeddings": 2048,
            }
        },
        "data": {
            "train_files": ["train.parquet"],
            "val_files": ["test.parquet"],
            "max_prompt_length": 512,
            "max_response_length": 1024,
            "train_batch_size": 64,
        },
        "algorithm": {"adv_estimator": "gae"},
        "actor": {
            "parallel": {"tp": 2, "pp": 2},
            "optim": {"lr": 1e-6},
            "ppo_mini_batch_size": 32,
            "ppo_micro_batch_size": 4,
        },
        "critic": {
            "parallel": {"tp": 4},
            "optim": {"lr": 1e-5},
            "ppo_mini_batch_size": 32,
            "ppo_micro_batch_size": 8,
        },
        "rollout": {"num_servers": 8, "tp": 2},
        "placement": {"nodes": 2, "gpus_per_node": 8},
        "trainer": {"total_steps": 100, "val_every": 10},
    }


def write(tmp_path: Path, data: dict[str, Any] | str, name: str = "recipe.yaml") -> Path:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def problems_of(path: Path, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(InputError) as caught:
        load_recipe(path, overrides)
    return caught.value.problems


@pytest.fixture
def cluster(tmp_path: Path) -> Path:
    return write(tmp_path, cluster_recipe())


# ---------------------------------------------------------------- valid recipes


def test_valid_recipe_fills_defaults_and_derived_dp(cluster: Path) -> None:
    recipe = load_recipe(cluster)
    assert recipe.actor.parallel.dp == 16 // (2 * 2)
    assert recipe.critic is not None and recipe.critic.parallel.dp == 16 // 4
    assert recipe.reference.parallel.dp is None  # no KL: the reference is not started, so not resolved
    assert recipe.rollout.temperature == 1.0 and recipe.rollout.backend == "sglang"
    assert recipe.weight_sync.transport == "tensor" and recipe.trainer.checkpoint.keep_last == 2
    assert recipe.actor.optim.betas == (0.9, 0.999)


def test_the_critics_loss_agg_mode_defaults_to_the_actors(cluster: Path) -> None:
    # As verl's critic config: critic.loss_agg_mode = ${actor.loss_agg_mode} unless the recipe sets it.
    assert load_recipe(cluster).critic.loss_agg_mode == "token-mean"
    inherited = load_recipe(cluster, ["actor.loss_agg_mode=seq-mean-token-sum-norm"])
    assert inherited.critic.loss_agg_mode == "seq-mean-token-sum-norm"
    own = load_recipe(cluster, ["actor.loss_agg_mode=seq-mean-token-sum-norm", "critic.loss_agg_mode=token-mean"])
    assert own.critic.loss_agg_mode == "token-mean"
    (line,) = problems_of(cluster, ["critic.loss_agg_mode=mean"])
    assert "critic.loss_agg_mode: unknown loss_agg_mode 'mean'; known: seq-mean-token-mean" in line


def test_layout_resolution(cluster: Path) -> None:
    recipe = load_recipe(cluster)
    assert active_roles(recipe) == ("actor", "critic", "rollout")
    layout = resolve_layout(recipe)
    actor, critic, rollout = layout["actor"], layout["critic"], layout["rollout"]
    assert (actor.world_size, actor.tp, actor.pp, actor.dp) == (16, 2, 2, 4)
    assert (critic.world_size, critic.tp, critic.pp, critic.dp) == (16, 4, 1, 4)
    assert (rollout.pool.size, rollout.num_servers, rollout.tp) == (16, 8, 2)
    with_kl = load_recipe(cluster, ["actor.use_kl_loss=true"])
    assert active_roles(with_kl) == ("actor", "critic", "reference", "rollout")
    assert resolve_layout(with_kl)["reference"].dp == 16


def test_the_reference_runs_in_the_actors_ranks_when_it_shares_their_pool_and_layout(cluster: Path) -> None:
    from megarl.cluster.placement import plan_pools

    same = load_recipe(cluster, ["actor.use_kl_loss=true", "reference.parallel.tp=2", "reference.parallel.pp=2"])
    assert reference_fused(same)
    pools = plan_pools(same)
    # Fused: no workers of its own, so the actor's, the critic's and the servers' shares of a slot stay thirds.
    assert pools["reference"] is pools["actor"] and pools["actor"].roles == ["actor", "critic", "rollout"]
    assert "#   reference  pool colocated (2x8)  world 16  tp 2  pp 2  vpp -  ep 1  dp 4  sp off  (in the actor's ranks)" \
        in dump_recipe(same).splitlines()
    other_layout = load_recipe(cluster, ["actor.use_kl_loss=true"])  # the reference at TP1 (DP16)
    assert not reference_fused(other_layout)
    assert plan_pools(other_layout)["actor"].roles == ["actor", "critic", "reference", "rollout"]
    other_pool = load_recipe(cluster, [
        "actor.use_kl_loss=true", "reference.parallel.tp=2", "reference.parallel.pp=2", *DISAGGREGATED[:2],
        "placement.roles={actor: train, critic: train, reference: gen, rollout: gen}", DISAGGREGATED[3],
        "rollout.num_servers=2"])
    assert not reference_fused(other_pool)
    assert not reference_fused(load_recipe(cluster))  # no KL: no reference at all


def test_exponent_floats_in_yaml_are_floats(tmp_path: Path) -> None:
    text = yaml.safe_dump(cluster_recipe(), sort_keys=False).replace("lr: 1.0e-06", "lr: 2e-6")
    assert "lr: 2e-6" in text  # PyYAML alone would read this as the string '2e-6'
    recipe = load_recipe(write(tmp_path, text))
    assert isinstance(recipe.actor.optim.lr, float) and recipe.actor.optim.lr == 2e-6


# ---------------------------------------------------------------- file and field errors


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    assert problems_of(missing) == [f"{missing}: recipe file not found"]


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\ndata:\n  train_batch_size: 4\n    max_prompt_length: 8\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:4: YAML syntax error: mapping values are not allowed here")
    assert "max_prompt_length: 8" in line


def test_unclosed_bracket_names_where_it_opened(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\ndata:\n  train_files: [a, b\nalgorithm: {adv_estimator: gae}\n")
    (line,) = problems_of(path)
    assert line.startswith(f"{path}:4: YAML syntax error:") and "started on line 3" in line


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "name: x\ndata:\n  train_batch_size: 4\n  train_batch_size: 8\n")
    (line,) = problems_of(path)
    assert line == f"{path}:4: YAML syntax error: duplicate key 'train_batch_size' (got 'train_batch_size: 8')"


@pytest.mark.parametrize("text, got", [("", "an empty file"), ("- a\n- b\n", "a list")])
def test_top_level_must_be_mapping(tmp_path: Path, text: str, got: str) -> None:
    path = write(tmp_path, text)
    assert problems_of(path) == [f"{path}: a recipe must be a YAML mapping of sections (got {got})"]


def test_unknown_keys_wrong_types_missing_keys_all_reported(tmp_path: Path) -> None:
    data = cluster_recipe()
    data["actor"]["ppo_micro_batchsize"] = data["actor"].pop("ppo_micro_batch_size")
    data["rollout"]["n"] = "abc"
    data["trainer"].pop("total_steps")
    data["placement"]["roles"] = {"learner": "x"}
    data["wandb"] = {"project": "x"}
    path = write(tmp_path, data)
    problems = problems_of(path)
    assert f"{path}: actor.ppo_micro_batch_size: missing required key" in problems
    assert (
        f"{path}: actor.ppo_micro_batchsize: unknown key; did you mean 'actor.ppo_micro_batch_size'? (got 4)"
        in problems
    )
    assert (
        f"{path}: rollout.n: Input should be a valid integer, unable to parse string as an integer (got 'abc')"
        in problems
    )
    assert f"{path}: trainer.total_steps: missing required key" in problems
    assert any(line.startswith(f"{path}: placement.roles.learner: invalid key:") for line in problems)
    (wandb,) = [line for line in problems if "wandb" in line]
    assert wandb.startswith(f"{path}: wandb: unknown key; the recipe has: name, seed, model,")
    assert len(problems) == 6


@pytest.mark.parametrize(
    "override, line",
    [
        ("actor.optim.lr=-1", "--set: actor.optim.lr: Input should be greater than 0 (got -1)"),
        ("rollout.top_p=0", "--set: rollout.top_p: Input should be greater than 0 (got 0)"),
        ("rollout.top_k=0", "--set: rollout.top_k: must be -1 (off) or >= 1 (got 0)"),
        ("actor.optim.betas=[0.9]", "--set: actor.optim.betas[1]: missing list item"),
        ("data.train_batch_size=0", "--set: data.train_batch_size: Input should be greater than 0 (got 0)"),
        ("placement.device=tpu", "--set: placement.device: Input should be 'cuda' or 'cpu' (got 'tpu')"),
    ],
)
def test_field_bounds(cluster: Path, override: str, line: str) -> None:
    assert problems_of(cluster, [override]) == [line]


def test_scorer_spec_format(cluster: Path) -> None:
    (line,) = problems_of(cluster, ["reward.scorers={my/source: not-a-spec}"])
    assert line.startswith("--set: reward.scorers: scorers must look like 'package.module:function'")
    recipe = load_recipe(cluster, ["reward.scorers={my/source: my_pkg.scoring:score}"])
    assert recipe.reward.scorers == {"my/source": "my_pkg.scoring:score"}


# ---------------------------------------------------------------- --set overrides


def test_override_coercion(cluster: Path) -> None:
    recipe = load_recipe(
        cluster,
        [
            "actor.optim.lr=1e-5",
            "rollout.n=2",
            "data.val_files=[a.parquet, b.parquet]",
            "model.config.max_position_embeddings=4096",
            "trainer.logging.tensorboard=false",
            "name=run-7",
        ],
    )
    assert type(recipe.actor.optim.lr) is float and recipe.actor.optim.lr == 1e-5
    assert recipe.rollout.n == 2 and recipe.data.val_files == ["a.parquet", "b.parquet"]
    assert recipe.model.config is not None and recipe.model.config["max_position_embeddings"] == 4096
    assert recipe.model.config["num_hidden_layers"] == 8  # the rest of the inline config is kept
    assert recipe.trainer.logging.tensorboard is False and recipe.name == "run-7"


def test_override_wrong_type_names_key_and_source(cluster: Path) -> None:
    assert problems_of(cluster, ["rollout.n=abc"]) == [
        "--set: rollout.n: Input should be a valid integer, unable to parse string as an integer (got 'abc')"
    ]


@pytest.mark.parametrize(
    "override, line",
    [
        ("foo", "--set: foo: expected KEY=VALUE with a dotted key (got 'foo')"),
        ("=3", "--set: (empty): expected KEY=VALUE with a dotted key (got '=3')"),
        ("actor..lr=3", "--set: actor..lr: expected KEY=VALUE with a dotted key (got 'actor..lr=3')"),
        (
            "actor.optim.lrr=1",
            "--set: actor.optim.lrr: unknown key; did you mean 'actor.optim.lr'? (got 'actor.optim.lrr=1')",
        ),
        (
            "rollout.n.x=3",
            "--set: rollout.n.x: rollout.n is a value, not a section, so it has no key 'x' (got 'rollout.n.x=3')",
        ),
        (
            "actor.optim.lr=[1",
            "--set: actor.optim.lr: not a valid YAML value: expected ',' or ']', but got '<stream end>' (got '[1')",
        ),
    ],
)
def test_bad_override_syntax(cluster: Path, override: str, line: str) -> None:
    assert problems_of(cluster, [override]) == [line]


def test_override_creates_and_removes_sections(cluster: Path) -> None:
    grpo = load_recipe(cluster, ["critic=null", "algorithm.adv_estimator=grpo", "rollout.n=4"])
    assert grpo.critic is None and active_roles(grpo) == ("actor", "rollout")
    # A section the recipe omits can be set key by key; the missing required keys are then named.
    path = write(cluster.parent, {k: v for k, v in cluster_recipe().items() if k != "critic"}, "no-critic.yaml")
    problems = problems_of(path, ["critic.optim.lr=1e-5"])
    assert "--set: critic.ppo_mini_batch_size: missing required key" in problems


def test_override_into_scalar_in_free_form_dict(cluster: Path) -> None:
    (line,) = problems_of(cluster, ["model.config.num_hidden_layers.x=1"])
    assert (
        line == "--set: model.config.num_hidden_layers.x: "
        "model.config.num_hidden_layers is 8 in the recipe, not a section (got 1)"
    )


def test_overrides_must_be_a_sequence(cluster: Path) -> None:
    with pytest.raises(TypeError, match="sequence of 'KEY=VALUE'"):
        load_recipe(cluster, "rollout.n=2")  # type: ignore[arg-type]


# ---------------------------------------------------------------- base: inheritance


def test_base_inheritance_deep_merges(tmp_path: Path) -> None:
    base = cluster_recipe()
    write(tmp_path, base, "bases/_base.yaml")
    child = {
        "base": "bases/_base.yaml",
        "name": "child",
        "actor": {"optim": {"lr": 5e-6}},
        "data": {"train_files": ["other.parquet"]},
        "model": {"config": {"max_position_embeddings": 4096}},
    }
    recipe = load_recipe(write(tmp_path, child, "child.yaml"))
    assert recipe.name == "child" and recipe.actor.optim.lr == 5e-6
    assert recipe.actor.ppo_mini_batch_size == 32 and recipe.actor.parallel.tp == 2  # kept from the base
    assert recipe.data.train_files == ["other.parquet"] and recipe.data.val_files == ["test.parquet"]
    assert recipe.model.config == {**base["model"]["config"], "max_position_embeddings": 4096}


def test_base_path_is_relative_to_the_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(tmp_path, cluster_recipe(), "recipes/_base.yaml")
    child = write(tmp_path, {"base": "_base.yaml", "name": "c"}, "recipes/c.yaml")
    monkeypatch.chdir(tmp_path.parent)
    assert load_recipe(child).name == "c"


def test_child_null_removes_a_base_section(tmp_path: Path) -> None:
    write(tmp_path, cluster_recipe(), "_base.yaml")
    child = {"base": "_base.yaml", "critic": None, "algorithm": {"adv_estimator": "grpo"}, "rollout": {"n": 4}}
    assert load_recipe(write(tmp_path, child, "c.yaml")).critic is None


def test_base_errors(tmp_path: Path) -> None:
    missing = write(tmp_path, {"base": "gone.yaml", "name": "c"}, "c.yaml")
    assert problems_of(missing) == [
        f"{missing}: base: base recipe {tmp_path / 'gone.yaml'} not found (got 'gone.yaml')"
    ]
    write(tmp_path, {"name": "root"}, "root.yaml")
    middle = write(tmp_path, {"base": "root.yaml", "name": "m"}, "middle.yaml")
    leaf = write(tmp_path, {"base": "middle.yaml", "name": "leaf"}, "leaf.yaml")
    assert problems_of(leaf) == [
        f"{middle}: base: a base recipe cannot have its own base (only one level) (got 'root.yaml')"
    ]
    not_a_path = write(tmp_path, {"base": 3}, "n.yaml")
    assert problems_of(not_a_path) == [f"{not_a_path}: base: expected a recipe file path relative to this file (got 3)"]


def test_errors_name_the_file_that_set_the_value(tmp_path: Path) -> None:
    base = cluster_recipe()
    base["rollout"]["n"] = "two"
    base_path = write(tmp_path, base, "_base.yaml")
    child = write(tmp_path, {"base": "_base.yaml", "data": {"train_batch_size": 48}}, "c.yaml")
    (field_problem,) = problems_of(child)
    assert field_problem.startswith(f"{base_path}: rollout.n: Input should be a valid integer")
    problems = problems_of(child, ["rollout.n=1"])
    assert problems == [  # the key named is the one the base set
        f"{base_path}: actor.ppo_mini_batch_size: must divide data.train_batch_size * rollout.n = 48*1 = 48 (got 32)",
        f"{base_path}: critic.ppo_mini_batch_size: must divide data.train_batch_size * rollout.n = 48*1 = 48 (got 32)",
    ]
    (from_child,) = problems_of(child, ["rollout.n=1", "actor.ppo_mini_batch_size=16", "critic=null"])
    assert from_child == "--set: critic: adv_estimator 'gae' needs a critic section (got None)"


# ---------------------------------------------------------------- cross-field rules

BAD_RULES = [
    # world size vs tp*pp, and dp when given
    (
        ["actor.parallel.tp=3", "model.config.num_attention_heads=12", "model.config.num_key_value_heads=3"],
        "actor.parallel.tp: world size 16 (pool 'colocated') is not divisible by tp*pp = 3*2 (got 3)",
    ),
    (
        ["actor.parallel.dp=2"],
        "actor.parallel.dp: tp*pp*dp = 2*2*2 must equal world size 16 (pool 'colocated') (got 2)",
    ),
    # pipeline and virtual pipeline vs layers
    (["model.config.num_hidden_layers=7"], "actor.parallel.pp: num_hidden_layers = 7 is not divisible by pp (got 2)"),
    (["critic.parallel.vpp=2"], "critic.parallel.vpp: virtual pipeline stages need pp > 1 (got 2)"),
    (["actor.parallel.vpp=3"], "actor.parallel.vpp: num_hidden_layers = 8 is not divisible by pp*vpp = 2*3 (got 3)"),
    # heads vs tp (training roles and rollout servers)
    (
        ["model.config.num_attention_heads=6", "model.config.num_key_value_heads=2", "model.config.hidden_size=384"],
        "critic.parallel.tp: num_attention_heads = 6 is not divisible by tp (got 4)",
    ),
    (
        ["model.config.num_key_value_heads=2"],
        "critic.parallel.tp: num_key_value_heads = 2 is not divisible by tp (got 4)",
    ),
    (["rollout.tp=16", "rollout.num_servers=1"], "rollout.tp: num_attention_heads = 8 is not divisible by tp (got 16)"),
    (
        ["critic.parallel.sequence_parallel=true", "critic.parallel.tp=1"],
        "critic.parallel.sequence_parallel: needs tp > 1 (got True)",
    ),
    (
        ["actor.parallel.ep=2"],
        "actor.parallel.ep: needs an MoE model whose expert count divides by ep (experts: None) (got 2)",
    ),
    # rollout fleet vs its pool
    (
        ["rollout.num_servers=4"],
        "rollout.num_servers: num_servers*tp = 4*2 must equal the colocated pool 'colocated' of size 16 (got 4)",
    ),
    # batch divisibility
    (
        ["data.train_batch_size=48"],
        "actor.ppo_mini_batch_size: must divide data.train_batch_size * rollout.n = 48*1 = 48 (got 32)",
    ),
    (
        ["actor.ppo_micro_batch_size=16"],
        "actor.ppo_mini_batch_size: must be divisible by ppo_micro_batch_size * dp = 16*4 (got 32)",
    ),
    (
        ["critic.ppo_micro_batch_size=16"],
        "critic.ppo_mini_batch_size: must be divisible by ppo_micro_batch_size * dp = 16*4 (got 32)",
    ),
    # critic iff gae, group estimators need n >= 2
    (["critic=null"], "critic: adv_estimator 'gae' needs a critic section (got None)"),
    (
        ["algorithm.adv_estimator=grpo", "rollout.n=2"],
        "critic: adv_estimator 'grpo' uses no critic; remove the section or use one that does ('gae') (got a critic section)",
    ),
    (
        ["algorithm.adv_estimator=grpo", "critic=null"],
        "rollout.n: grpo compares responses within a group, needs n >= 2 (got 1)",
    ),
    (
        ["algorithm.adv_estimator=rloo", "critic=null"],
        "rollout.n: rloo compares responses within a group, needs n >= 2 (got 1)",
    ),
    (
        ["algorithm.adv_estimator=reinforce_plus_plus_baseline", "critic=null"],
        "rollout.n: reinforce_plus_plus_baseline compares responses within a group, needs n >= 2 (got 1)",
    ),
    (
        ["critic.warmup_steps=100"],
        "critic.warmup_steps: the actor would never train in trainer.total_steps = 100 (got 100)",
    ),
    # lengths vs the model's positions
    (
        ["data.max_response_length=1537"],
        "data.max_response_length: max_prompt_length + max_response_length = 2049"
        " exceeds max_position_embeddings = 2048 (got 1537)",
    ),
    # model source, data source, validation data, backend vs device
    (["model.config=null"], "model.path: give model.path, model.config, or both (got {'path': None, 'config': None})"),
    (["data.train_files=[]"], "data.train_files: give data.train_files or data.synthetic (got [])"),
    (
        ["data.synthetic={task: addition, num_train: 10, num_val: 0}"],
        "data.synthetic: give data.train_files or data.synthetic, not both (got 'addition')",
    ),
    (
        ["data.val_files=[]"],
        "trainer.val_every: validation needs data.val_files or data.synthetic.num_val > 0 (got 10)",
    ),
    (
        ["trainer.val_every=0", "data.val_files=[]", "sft_warmup.steps=100", "sft_warmup.stop_accuracy=0.3"],
        "sft_warmup.stop_accuracy: is measured on held-out problems: give data.val_files or "
        "data.synthetic.num_val > 0 (got 0.3)",
    ),
    (
        ["sft_warmup.stop_loss=0.35", "sft_warmup.stop_accuracy=0.3"],
        "sft_warmup.stop_accuracy: give one stopping rule, not both: sft_warmup.stop_loss is 0.35 (got 0.3)",
    ),
    (
        ["placement.device=cpu"],
        "rollout.backend: SGLang needs placement.device: cuda; use backend 'cpu' (got 'sglang')",
    ),
    (["placement.pools={x: {nodes: 1}}"], "placement.pools: only used with placement.colocate: false (got ['x'])"),
]


@pytest.mark.parametrize(
    "overrides, expected",
    BAD_RULES,
    ids=[expected.split(":")[0] + f"-{i}" for i, (_, expected) in enumerate(BAD_RULES)],
)
def test_cross_field_rule_violations(cluster: Path, overrides: list[str], expected: str) -> None:
    problems = problems_of(cluster, overrides)
    assert any(line.endswith(expected) for line in problems), problems
    assert all(line.startswith(("--set: ", f"{cluster}: ")) for line in problems), problems


GOOD_RULES = [
    ["actor.parallel.dp=4"],  # explicit dp equal to the derived one
    ["actor.parallel.tp=1", "actor.parallel.pp=4", "actor.parallel.vpp=2"],  # 8 layers = 4 stages x 2 chunks
    ["actor.parallel.tp=1", "actor.parallel.pp=1", "actor.ppo_micro_batch_size=2"],  # dp 16: 32 = 2*16
    ["critic.parallel.sequence_parallel=true"],
    ["actor.parallel.ep=2", "model.config.num_experts=8"],  # 16 divisible by tp*pp*ep = 8
    ["rollout.num_servers=16", "rollout.tp=1"],
    ["data.max_response_length=1536"],  # exactly max_position_embeddings
    ["algorithm.adv_estimator=grpo", "critic=null", "rollout.n=2"],
    ["algorithm.adv_estimator=reinforce_plus_plus", "critic=null"],  # no group: n = 1 is fine
    ["data.train_files=[]", "data.val_files=[]", "data.synthetic={task: addition, num_train: 100, num_val: 5}"],
    ["trainer.val_every=0", "data.val_files=[]"],
    ["trainer.val_every=0", "data.val_files=[]", "sft_warmup.stop_accuracy=0.3"],  # no warm-up to stop
    ["placement.device=cpu", "rollout.backend=cpu"],
    ["reference.parallel.tp=3"],  # the reference is not started without KL, so not checked
]


@pytest.mark.parametrize("overrides", GOOD_RULES, ids=lambda overrides: overrides[0])
def test_cross_field_rules_accept_consistent_recipes(cluster: Path, overrides: list[str]) -> None:
    load_recipe(cluster, overrides)


def test_reference_layout_checked_when_kl_is_used(cluster: Path) -> None:
    problems = problems_of(cluster, ["reference.parallel.tp=3", "algorithm.use_kl_in_reward=true"])
    assert (
        "--set: reference.parallel.tp: world size 16 (pool 'colocated') is not divisible by tp*pp = 3*1 (got 3)"
        in problems
    )


DISAGGREGATED = [
    "placement.colocate=false",
    "placement.pools={train: {nodes: 1, gpus_per_node: 8}, gen: {nodes: 1, gpus_per_node: 8}}",
    "placement.roles={actor: train, critic: train, rollout: gen}",
    "weight_sync.transport=distributed",
]


def test_disaggregated_placement(cluster: Path) -> None:
    recipe = load_recipe(cluster, [*DISAGGREGATED, "rollout.num_servers=2"])  # 2*2 <= 8 is fine when not colocated
    layout = resolve_layout(recipe)
    assert (layout["actor"].pool.name, layout["actor"].world_size, layout["actor"].dp) == ("train", 8, 2)
    assert (layout["critic"].dp, layout["rollout"].pool.name, layout["rollout"].world_size) == (2, "gen", 4)


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["rollout.num_servers=8"], "rollout.num_servers: num_servers*tp = 8*2 exceeds pool 'gen' of size 8 (got 8)"),
        (
            ["placement.roles.rollout=inference"],
            "placement.roles.rollout: no such pool in placement.pools (train, gen) (got 'inference')",
        ),
        (
            ["placement.roles={actor: train, rollout: gen}"],
            "placement.roles.critic: placement.colocate is false, so every active role needs a pool (got None)",
        ),
        (
            ["placement.pools.gen.nodes=2"],
            "placement.pools: pools in use need 24 devices, more than placement.nodes*gpus_per_node = 16"
            " (got ['gen', 'train'])",
        ),
        (
            ["weight_sync.transport=tensor"],
            "weight_sync.transport: tensor handles only reach colocated engines;"
            " use 'disk' or 'distributed' with colocate: false (got 'tensor')",
        ),
        (
            ["actor.ppo_micro_batch_size=32"],
            "actor.ppo_mini_batch_size: must be divisible by ppo_micro_batch_size * dp = 32*2 (got 32)",
        ),
    ],
)
def test_disaggregated_placement_violations(cluster: Path, extra: list[str], expected: str) -> None:
    problems = problems_of(cluster, [*DISAGGREGATED, "rollout.num_servers=4", *extra])
    assert any(line.endswith(expected) for line in problems), problems


# ---------------------------------------------------------------- model config from a checkpoint dir


def test_model_path_reads_config_json(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    config = {**cluster_recipe()["model"]["config"], "num_hidden_layers": 6}
    (checkpoint / "config.json").write_text(json.dumps(config))
    data = cluster_recipe()
    data["model"] = {"path": str(checkpoint)}
    path = write(tmp_path, data)
    assert load_recipe(path).model.hf_config() == config
    assert problems_of(path, ["actor.parallel.pp=4", "actor.parallel.tp=1"]) == [
        "--set: actor.parallel.pp: num_hidden_layers = 6 is not divisible by pp (got 4)"
    ]
    assert problems_of(path, ["model.path=" + str(tmp_path / "gone")]) == [
        f"--set: model.path: {tmp_path / 'gone' / 'config.json'} not found (got '{tmp_path / 'gone'}')"
    ]


HEADS = ("num_attention_heads", "num_key_value_heads")


def test_critic_model_path_is_checked_with_its_own_config(tmp_path: Path) -> None:
    value_model = tmp_path / "value"
    value_model.mkdir()
    (value_model / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 4,
                                                         "num_attention_heads": 2, "hidden_size": 64,
                                                         "intermediate_size": 128, "vocab_size": 1000}))
    path = write(tmp_path, cluster_recipe())
    problems = problems_of(path, [f"critic.model_path={value_model}"])
    assert problems == [f"{path}: critic.parallel.tp: {heads} = 2 is not divisible by tp (got 4)" for heads in HEADS]
    (missing,) = problems_of(path, [f"critic.model_path={tmp_path}"])
    assert missing == f"--set: critic.model_path: {tmp_path / 'config.json'} not found (got '{tmp_path}')"


def test_model_config_needs_every_size_the_engines_build_from(cluster: Path) -> None:
    lines = problems_of(
        cluster, ["model.config={model_type: llama, num_attention_heads: 8, max_position_embeddings: 4096}"]
    )
    assert lines == [f"--set: model.config.{key}: required key missing (got None)"
                     for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")]


def test_importing_config_pulls_no_heavy_dependencies() -> None:
    heavy = ("torch", "ray", "megatron", "sglang", "transformers")
    code = f"import sys, megarl.config; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert result.stdout.strip() == "[]"


def test_throughput_counts_every_device_of_the_placement(cluster: Path) -> None:
    """perf/throughput divides by all devices the run holds, not the actor's pool (no Ray needed to plan)."""
    from megarl.cluster.placement import plan_pools, total_devices

    disaggregated = plan_pools(load_recipe(cluster, [*DISAGGREGATED, "rollout.num_servers=2"]))
    assert disaggregated["actor"].world_size == 8 and total_devices(disaggregated) == 16
    colocated = plan_pools(load_recipe(cluster))
    assert total_devices(colocated) == 16 and len(set(colocated.values())) == 1
