"""Cross-field rules of a recipe: placement, parallel layout vs model shape, batch divisibility, algorithm needs.

`check_recipe` runs on a recipe that already passed field validation and
returns every problem at once (never stops at the first), each naming the key
a user would change and the values that clash.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from megarl.config.layout import TRAINING_ROLES, active_roles, role_parallel, role_pool, rollout_layout, training_layout
from megarl.config.schema import Recipe, read_hf_config
from megarl.config.sglang_args import sglang_block_problems
from megarl.errors import InputError
from megarl.registry import ADVANTAGE_ESTIMATORS, ENVIRONMENTS, MODEL_SPECS, REWARD_COMBINE_MODES, WEIGHT_SYNC_TRANSPORTS

MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class Problem:
    """One problem line `<key>: <message> (got <value>)`; `key` also locates the file the value came from."""

    key: str
    line: str


def _problem(key: str, message: str, got: Any, *, verbatim: bool = False) -> Problem:
    """`verbatim` shows `got` as written (a description) instead of its repr (a value)."""
    return Problem(key, f"{key}: {message} (got {got if verbatim else repr(got)})")


def _model_shape(config: dict[str, Any], key: str) -> tuple[dict[str, int], list[Problem]]:
    """The integer sizes the layout rules need from an HF config, and a problem per reason the engines could not
    build the model (the check of its family's spec in `megarl.registry.MODEL_SPECS`).

    `key` is the recipe key of the config: an inline dict (`model.config`, each line names the config key) or a
    checkpoint dir (each line names the dir's key and the config.json key).
    """
    inline = key == "model.config"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_SPECS:
        known = ", ".join(MODEL_SPECS.names())
        where, what = (f"{key}.model_type", "") if inline else (key, "config.json model_type: ")
        return {}, [_problem(where, f"{what}not a supported model_type; known: {known}", model_type)]
    problems = [
        _problem(f"{key}.{name}", message, value) if inline else _problem(key, f"config.json {name}: {message}", value)
        for name, message, value in MODEL_SPECS.get(model_type).target.config_problems(config)
    ]
    if problems:
        return {}, problems
    shape = {name: config[name] for name in ("num_hidden_layers", "num_attention_heads")}
    shape["num_key_value_heads"] = config.get("num_key_value_heads") or shape["num_attention_heads"]
    for name in ("max_position_embeddings", "hidden_size", "intermediate_size", "moe_intermediate_size",
                 *MOE_EXPERT_KEYS):
        if isinstance(config.get(name), int):
            shape[name] = config[name]
    return shape, problems


def _load_shape(read_config: Callable[[], dict[str, Any]], key: str) -> tuple[dict[str, int] | None, list[Problem]]:
    try:
        config = read_config()
    except InputError as error:
        return None, [Problem(key, line) for line in error.problems]
    shape, problems = _model_shape(config, key)
    return (None if problems else shape), problems


def _check_model_source(recipe: Recipe) -> list[Problem]:
    model = recipe.model
    if model.path is None and model.config is None:
        return [_problem("model.path", "give model.path, model.config, or both", {"path": None, "config": None})]
    return []


def _check_placement(recipe: Recipe) -> list[Problem]:
    placement, problems = recipe.placement, []
    if placement.colocate:
        for key in ("pools", "roles"):
            if getattr(placement, key):
                problems.append(
                    _problem(
                        f"placement.{key}", "only used with placement.colocate: false", sorted(getattr(placement, key))
                    )
                )
        return problems + _check_gpu_placement(recipe)
    for role, pool_name in placement.roles.items():
        if pool_name not in placement.pools:
            known = ", ".join(placement.pools) or "none"
            problems.append(
                _problem(f"placement.roles.{role}", f"no such pool in placement.pools ({known})", pool_name)
            )
    for role in active_roles(recipe):
        if role not in placement.roles:
            problems.append(
                _problem(
                    f"placement.roles.{role}", "placement.colocate is false, so every active role needs a pool", None
                )
            )
    used = {placement.roles[role] for role in active_roles(recipe) if placement.roles.get(role) in placement.pools}
    total = sum(placement.pools[name].nodes * placement.pools[name].gpus_per_node for name in used)
    allocation = placement.nodes * placement.gpus_per_node
    if total > allocation:
        problems.append(
            _problem(
                "placement.pools",
                f"pools in use need {total} devices, more than placement.nodes*gpus_per_node = {allocation}",
                sorted(used),
            )
        )
    return problems + _check_gpu_placement(recipe)


def _check_gpu_placement(recipe: Recipe) -> list[Problem]:
    """Placements that cannot work on GPUs, whatever the device of this run (a CPU test must fail where a
    cluster would): the transport's rule from its registry metadata (`needs_colocation` /
    `refuses_colocation`: the reason), and a rollout server whose TP ranks would straddle two nodes."""
    problems, placement = [], recipe.placement
    name, colocate = recipe.weight_sync.transport, placement.colocate
    rule = "refuses_colocation" if colocate else "needs_colocation"
    reason = WEIGHT_SYNC_TRANSPORTS.get(name).meta.get(rule)
    if reason is not None:
        usable = [other for other in WEIGHT_SYNC_TRANSPORTS if WEIGHT_SYNC_TRANSPORTS.get(other).meta.get(rule) is None]
        instead = " or ".join(repr(other) for other in usable)
        problems.append(
            _problem("weight_sync.transport", f"{reason}; use {instead} with colocate: {str(colocate).lower()}", name)
        )
    pool = role_pool(placement, "rollout")
    tp = recipe.rollout.tp
    if pool is not None and pool.gpus_per_node % tp:
        # Servers take consecutive slots: one would span two nodes, and megarl starts each server on one node.
        problems.append(
            _problem("rollout.tp", f"a server's TP ranks must share a node: the rollout pool {pool.name!r} has "
                     f"{pool.gpus_per_node} GPUs per node, not divisible by tp", tp)
        )
    return problems


def _check_async(recipe: Recipe) -> list[Problem]:
    """`rollout.async` overlaps generation with training, so it needs devices of its own for each."""
    settings, problems = recipe.rollout.async_, []
    if settings is None:
        return problems
    if recipe.placement.colocate:
        problems.append(_problem("rollout.async", "needs disaggregated placement: set placement.colocate: false "
                                 "(colocated roles take turns on the same devices, there is nothing to overlap)",
                                 "placement.colocate: true", verbatim=True))
    if recipe.rollout.multi_turn is not None:
        problems.append(_problem("rollout.async", "is not supported with rollout.multi_turn yet", "both set",
                                 verbatim=True))
    if settings.in_flight_updates and settings.partial_rollouts:
        problems.append(_problem("rollout.async.partial_rollouts", "only used without in_flight_updates (paused "
                                 "requests continue in place, nothing is re-sent)", True))
    return problems


def _check_training_role(recipe: Recipe, role: str, shape: dict[str, int] | None) -> list[Problem]:
    if role_pool(recipe.placement, role) is None:
        return []  # already reported by _check_placement
    layout, parallel, problems = training_layout(recipe, role), role_parallel(recipe, role), []
    key = f"{role}.parallel"
    world, model_parallel = layout.world_size, layout.tp * layout.pp
    where = f"world size {world} (pool {layout.pool.name!r})"
    if parallel.dp is not None and model_parallel * parallel.dp != world:
        problems.append(
            _problem(f"{key}.dp", f"tp*pp*dp = {layout.tp}*{layout.pp}*{parallel.dp} must equal {where}", parallel.dp)
        )
    elif world % model_parallel:
        problems.append(
            _problem(f"{key}.tp", f"{where} is not divisible by tp*pp = {layout.tp}*{layout.pp}", layout.tp)
        )
    if layout.ep > 1 and world % (model_parallel * layout.ep):
        problems.append(_problem(f"{key}.ep", f"{where} is not divisible by tp*pp*ep", layout.ep))
    if layout.sequence_parallel and layout.tp == 1:
        problems.append(_problem(f"{key}.sequence_parallel", "needs tp > 1", True))
    if layout.vpp is not None and layout.pp == 1:
        problems.append(_problem(f"{key}.vpp", "virtual pipeline stages need pp > 1", layout.vpp))
    if shape is not None:
        problems += _check_shape_fits(shape, key, layout.tp, layout.pp, layout.vpp, layout.ep)
    return problems


def _check_shape_fits(shape: dict[str, int], key: str, tp: int, pp: int, vpp: int | None, ep: int) -> list[Problem]:
    problems, layers = [], shape["num_hidden_layers"]
    if layers % pp:
        problems.append(_problem(f"{key}.pp", f"num_hidden_layers = {layers} is not divisible by pp", pp))
    if vpp is not None and pp > 1 and layers % (pp * vpp):
        problems.append(
            _problem(f"{key}.vpp", f"num_hidden_layers = {layers} is not divisible by pp*vpp = {pp}*{vpp}", vpp)
        )
    for heads in ("num_attention_heads", "num_key_value_heads"):
        if shape[heads] % tp:
            problems.append(_problem(f"{key}.tp", f"{heads} = {shape[heads]} is not divisible by tp", tp))
    if ep > 1:
        experts = next((shape[name] for name in MOE_EXPERT_KEYS if name in shape), None)
        if experts is None or experts % ep:
            problems.append(
                _problem(f"{key}.ep", f"needs an MoE model whose expert count divides by ep (experts: {experts})", ep)
            )
    return problems


def _check_batches(recipe: Recipe, role: str) -> list[Problem]:
    section = recipe.actor if role == "actor" else recipe.critic
    if section is None:
        return []
    problems, mini, micro = [], section.ppo_mini_batch_size, section.ppo_micro_batch_size
    samples = recipe.data.train_batch_size * recipe.rollout.n
    if samples % mini:
        batch, n = recipe.data.train_batch_size, recipe.rollout.n
        message = f"must divide data.train_batch_size * rollout.n = {batch}*{n} = {samples}"
        problems.append(_problem(f"{role}.ppo_mini_batch_size", message, mini))
    layout = training_layout(recipe, role)
    if layout.dp is not None and mini % (micro * layout.dp):
        message = f"must be divisible by ppo_micro_batch_size * dp = {micro}*{layout.dp}"
        problems.append(_problem(f"{role}.ppo_mini_batch_size", message, mini))
    return problems


def _check_optimizer(optim, key: str, *, optimizer_steps: int | None) -> list[Problem]:
    """Megatron's LR schedule asserts min_lr <= lr and a warm-up shorter than the run's optimizer steps."""
    problems = []
    if optim.min_lr > optim.lr:
        problems.append(_problem(f"{key}.min_lr", f"must be at most {key}.lr = {optim.lr:g}", optim.min_lr))
    if optimizer_steps is not None and optim.warmup_steps >= optimizer_steps:
        problems.append(_problem(f"{key}.warmup_steps", f"must be fewer than the run's {optimizer_steps} optimizer "
                                 "steps", optim.warmup_steps))
    return problems


def _check_optimizers(recipe: Recipe) -> list[Problem]:
    """Each optimizer against the number of steps it will take (what `megarl.config.settings` hands the engines)."""
    problems = []
    for role, section in (("actor", recipe.actor), ("critic", recipe.critic)):
        if section is None:
            continue
        samples = recipe.data.train_batch_size * recipe.rollout.n
        steps = recipe.trainer.total_steps * section.ppo_epochs * (samples // section.ppo_mini_batch_size)
        problems += _check_optimizer(section.optim, f"{role}.optim", optimizer_steps=steps or None)
    train = recipe.reward_model.train if recipe.reward_model is not None else None
    if train is not None:
        pairs = train.synthetic.num_train if train.synthetic is not None else None
        steps = train.epochs * (pairs // train.mini_batch_size) if pairs is not None else None
        problems += _check_optimizer(train.optim, "reward_model.train.optim", optimizer_steps=steps or None)
        if pairs is not None and train.mini_batch_size > pairs:
            problems.append(_problem("reward_model.train.mini_batch_size", f"more than the "
                                     f"reward_model.train.synthetic.num_train = {pairs} pairs", train.mini_batch_size))
    return problems


def _check_synthetic_sizes(recipe: Recipe) -> list[Problem]:
    """Batches against a generated data set's size (a file's rows are counted by `megarl validate`)."""
    synthetic, problems = recipe.data.synthetic, []
    if synthetic is None:
        return []
    for key, batch in (("data.train_batch_size", recipe.data.train_batch_size),
                       ("sft_warmup.batch_size", recipe.sft_warmup.batch_size if recipe.sft_warmup.steps else 0)):
        if batch > synthetic.num_train:
            problems.append(_problem(key, f"more than the data.synthetic.num_train = {synthetic.num_train} prompts",
                                     batch))
    if synthetic.task != "addition" and synthetic.solution != "answer":
        problems.append(_problem("data.synthetic.solution", f"only the addition task has worked solutions, not "
                                 f"data.synthetic.task = {synthetic.task}", synthetic.solution))
    pairs = (synthetic.max_operand + 1) ** 2
    if synthetic.task == "addition" and synthetic.num_val >= pairs:
        problems.append(_problem("data.synthetic.num_val", f"leaves no (a, b) pair for training: max_operand = "
                                 f"{synthetic.max_operand} makes {pairs} pairs", synthetic.num_val))
    return problems


def _check_rollout(recipe: Recipe, shape: dict[str, int] | None) -> list[Problem]:
    rollout, placement, problems = recipe.rollout, recipe.placement, []
    problems += [Problem("rollout.sglang", line) for line in sglang_block_problems(rollout.sglang, where="rollout.sglang")]
    if placement.device == "cpu" and rollout.backend == "sglang":
        problems.append(_problem("rollout.backend", "SGLang needs placement.device: cuda; use backend 'cpu'", "sglang"))
    if ADVANTAGE_ESTIMATORS.get(recipe.algorithm.adv_estimator).needs_groups and rollout.n < 2:
        problems.append(
            _problem(
                "rollout.n",
                f"{recipe.algorithm.adv_estimator} compares responses within a group, needs n >= 2",
                rollout.n,
            )
        )
    if shape is not None and shape["num_attention_heads"] % rollout.tp:
        problems.append(
            _problem(
                "rollout.tp", f"num_attention_heads = {shape['num_attention_heads']} is not divisible by tp", rollout.tp
            )
        )
    if role_pool(placement, "rollout") is not None:
        fleet = rollout_layout(recipe)
        where = f"pool {fleet.pool.name!r} of size {fleet.pool.size}"
        if placement.colocate and fleet.world_size != fleet.pool.size:
            problems.append(
                _problem(
                    "rollout.num_servers",
                    f"num_servers*tp = {fleet.num_servers}*{fleet.tp} must equal the colocated {where}",
                    fleet.num_servers,
                )
            )
        elif fleet.world_size > fleet.pool.size:
            problems.append(
                _problem(
                    "rollout.num_servers",
                    f"num_servers*tp = {fleet.num_servers}*{fleet.tp} exceeds {where}",
                    fleet.num_servers,
                )
            )
    return problems


def _check_algorithm_and_data(recipe: Recipe, shape: dict[str, int] | None) -> list[Problem]:
    problems, data, estimator = [], recipe.data, recipe.algorithm.adv_estimator
    needs_critic = ADVANTAGE_ESTIMATORS.get(estimator).needs_critic
    if needs_critic and recipe.critic is None:
        problems.append(_problem("critic", f"adv_estimator {estimator!r} needs a critic section", None))
    if not needs_critic and recipe.critic is not None:
        users = ", ".join(repr(name) for name in ADVANTAGE_ESTIMATORS if ADVANTAGE_ESTIMATORS.get(name).needs_critic)
        problems.append(
            _problem(
                "critic",
                f"adv_estimator {estimator!r} uses no critic; remove the section or use one that does ({users})",
                "a critic section",
                verbatim=True,
            )
        )
    if recipe.critic is not None and recipe.critic.warmup_steps >= recipe.trainer.total_steps:
        problems.append(
            _problem(
                "critic.warmup_steps",
                f"the actor would never train in trainer.total_steps = {recipe.trainer.total_steps}",
                recipe.critic.warmup_steps,
            )
        )
    if not data.train_files and data.synthetic is None:
        problems.append(_problem("data.train_files", "give data.train_files or data.synthetic", []))
    if data.train_files and data.synthetic is not None:
        problems.append(
            _problem("data.synthetic", "give data.train_files or data.synthetic, not both", data.synthetic.task)
        )
    synthetic_length = data.synthetic.prompt_length if data.synthetic is not None else None
    if synthetic_length is not None and synthetic_length > data.max_prompt_length:
        problems.append(_problem("data.synthetic.prompt_length",
                                 f"longer than data.max_prompt_length = {data.max_prompt_length}", synthetic_length))
    has_val = bool(data.val_files) or (data.synthetic is not None and data.synthetic.num_val > 0)
    if recipe.trainer.val_every > 0 and not has_val:
        problems.append(
            _problem(
                "trainer.val_every",
                "validation needs data.val_files or data.synthetic.num_val > 0",
                recipe.trainer.val_every,
            )
        )
    warmup = recipe.sft_warmup
    if warmup.steps and warmup.stop_accuracy is not None and not has_val:
        problems.append(_problem("sft_warmup.stop_accuracy", "is measured on held-out problems: give "
                                 "data.val_files or data.synthetic.num_val > 0", warmup.stop_accuracy))
    if warmup.stop_accuracy is not None and warmup.stop_loss is not None:
        problems.append(_problem("sft_warmup.stop_accuracy", "give one stopping rule, not both: "
                                 f"sft_warmup.stop_loss is {warmup.stop_loss}", warmup.stop_accuracy))
    positions = shape.get("max_position_embeddings") if shape is not None else None
    if positions is not None and data.max_prompt_length + data.max_response_length > positions:
        total = data.max_prompt_length + data.max_response_length
        message = f"max_prompt_length + max_response_length = {total} exceeds max_position_embeddings = {positions}"
        problems.append(_problem("data.max_response_length", message, data.max_response_length))
    return problems


def _reward_model_config(recipe: Recipe) -> dict[str, Any]:
    """The reward model's HF config: its checkpoint's, or before `megarl train-rm` has written it, the config of
    the checkpoint training starts from (the policy's when `train.init_path` is null)."""
    rm = recipe.reward_model
    if (Path(rm.path).expanduser() / "config.json").exists() or rm.train is None:
        config = read_hf_config(rm.path, key="reward_model.path")
        architectures = config.get("architectures") or []
        labels = config.get("num_labels", len(config.get("id2label") or {}) or None)
        if not any(name.endswith("ForSequenceClassification") for name in architectures) or labels != 1:
            raise InputError(f"reward_model.path: {rm.path}/config.json is not a *ForSequenceClassification model "
                             f"with one label (architectures {architectures}, num_labels {labels})")
        return config
    if rm.train.init_path is not None:
        return read_hf_config(rm.train.init_path, key="reward_model.train.init_path")
    return recipe.model.hf_config()


def _check_reward(recipe: Recipe) -> list[Problem]:
    reward, problems = recipe.reward, []
    model_side = [key for key, section in (("reward_model", recipe.reward_model), ("reward.judge", reward.judge),
                                           ("reward.remote", reward.remote)) if section is not None]
    if len(model_side) > 1:
        problems.append(_problem(model_side[1], "at most one model-side scorer; the recipe also sets "
                                 + " and ".join(key for key in model_side if key != model_side[1]), "a section",
                                 verbatim=True))
    mode = REWARD_COMBINE_MODES.get(reward.combine)
    if mode.uses_rm and not model_side:
        problems.append(_problem("reward.combine", "needs a model-side score: configure reward_model, reward.judge "
                                 "or reward.remote", reward.combine))
    if reward.combine == "rule_gated" and reward.gate.fail_score is None:
        problems.append(_problem("reward.gate.fail_score", "required with reward.combine: rule_gated", None))
    if reward.judge is not None:
        problems += [Problem("reward.judge.sglang", line)
                     for line in sglang_block_problems(reward.judge.sglang, where="reward.judge.sglang")]
    if reward.judge is not None and role_pool(recipe.placement, "judge") is not None:
        fleet = rollout_layout(recipe, "judge")
        if fleet.world_size > fleet.pool.size:
            problems.append(_problem("reward.judge.num_servers", f"num_servers*tp = {fleet.num_servers}*{fleet.tp} "
                                     f"exceeds pool {fleet.pool.name!r} of size {fleet.pool.size}",
                                     fleet.num_servers))
    if recipe.reward_model is not None and recipe.reward_model.parallel.sequence_parallel:
        # Megatron gathers a sequence-parallel sequence inside its LM output layer; the score head replacing it
        # reads whole sequences.
        problems.append(_problem("reward_model.parallel.sequence_parallel", "not supported by the score head", True))
    return problems


def _check_reward_model_training(recipe: Recipe) -> list[Problem]:
    train = recipe.reward_model.train
    if train is None:
        return []
    problems = []
    if not train.train_files and train.synthetic is None:
        problems.append(_problem("reward_model.train.train_files", "give train_files or synthetic", []))
    if train.train_files and train.synthetic is not None:
        problems.append(_problem("reward_model.train.synthetic", "give train_files or synthetic, not both",
                                 train.synthetic.task))
    if train.synthetic is None and not train.val_files:
        problems.append(_problem("reward_model.train.val_files", "validation accuracy needs val_files", []))
    layout = training_layout(recipe, "reward_model")
    if layout.dp is not None and train.mini_batch_size % (train.micro_batch_size * layout.dp):
        message = f"must be divisible by micro_batch_size * dp = {train.micro_batch_size}*{layout.dp}"
        problems.append(_problem("reward_model.train.mini_batch_size", message, train.mini_batch_size))
    return problems


def _check_multi_turn(recipe: Recipe) -> list[Problem]:
    """Episodes: the environment takes its options, has tools when it calls them, turns end, and the
    environment alone gives the reward."""
    multi_turn, key = recipe.rollout.multi_turn, "rollout.multi_turn"
    if multi_turn is None:
        return []
    problems = []
    entry = ENVIRONMENTS.resolve(multi_turn.environment)
    try:
        inspect.signature(entry.target).bind(tools=None, **multi_turn.environment_options)
    except TypeError as error:
        problems.append(_problem(f"{key}.environment_options", f"{multi_turn.environment} does not take them: "
                                 f"{error}", multi_turn.environment_options))
    if entry.meta.get("uses_tools") and not multi_turn.tools:
        problems.append(_problem(f"{key}.tools", f"environment {multi_turn.environment!r} calls tools; name at "
                                 "least one (e.g. [calculator])", multi_turn.tools))
    if recipe.rollout.ignore_eos:
        problems.append(_problem("rollout.ignore_eos", "a turn that never ends leaves no room for the next; "
                                 "turn it off with rollout.multi_turn", True))
    model_side = [name for name, section in (("reward_model", recipe.reward_model), ("reward.judge",
                  recipe.reward.judge), ("reward.remote", recipe.reward.remote)) if section is not None]
    if model_side or recipe.reward.combine != "rule":
        problems.append(_problem(f"{key}.environment", "with multi-turn episodes the environment gives the reward; "
                                 f"remove {', '.join(model_side) or 'the model side'} and keep reward.combine: rule",
                                 multi_turn.environment))
    return problems


def _check_lora(recipe: Recipe, shape: dict[str, int] | None) -> list[Problem]:
    """LoRA adapters on the actor, and the adapter-only weight sync that needs them."""
    lora, problems = recipe.actor.lora, []
    if lora is None:
        if recipe.weight_sync.lora == "adapter":
            problems.append(_problem("weight_sync.lora", "the adapter-only sync needs actor.lora", "adapter"))
        return problems
    if recipe.actor.parallel.sequence_parallel:
        problems.append(_problem("actor.parallel.sequence_parallel", "not supported with actor.lora", True))
    if recipe.sft_warmup.steps > 0:
        problems.append(_problem("sft_warmup.steps", "with actor.lora the base is frozen and the warm-up would "
                                 "train it: run `megarl warmup` without actor.lora and set model.path to its "
                                 "output", recipe.sft_warmup.steps))
    if "parallel" in recipe.reference.model_fields_set:
        # No reference engine runs: KL terms take the base model's log-probs from the actor itself.
        problems.append(_problem("reference.parallel", "with actor.lora the reference policy is the actor with its "
                                 "adapters switched off and no reference engine runs; remove the reference "
                                 "section", "a reference layout", verbatim=True))
    if shape is not None:
        ffn = "moe_intermediate_size" if any(name in shape for name in MOE_EXPERT_KEYS) else "intermediate_size"
        sizes = [shape[name] for name in ("hidden_size", ffn) if name in shape]
        if sizes and lora.rank > min(sizes):
            problems.append(_problem("actor.lora.rank", f"larger than the smallest dimension of an adapted linear "
                                     f"({min(sizes)})", lora.rank))
    if recipe.weight_sync.lora == "adapter" and recipe.weight_sync.transport == "distributed":
        problems.append(_problem("weight_sync.transport", "an adapter-only sync (weight_sync.lora: adapter) goes "
                                 "through tensors on colocated servers or a shared directory: use 'tensor' or "
                                 "'disk'", "distributed"))
    ahead = recipe.rollout.async_
    if recipe.weight_sync.lora == "adapter" and ahead is not None and ahead.max_staleness > 0:
        # Each request names the adapter of the version it started under, and a sync unloads the previous one:
        # requests still generating (or re-sent, or paused in place) across a sync would name an unloaded adapter.
        problems.append(_problem("weight_sync.lora", "the adapter-only sync unloads the previous version's adapter, "
                                 "which requests generating across a sync under rollout.async still name: use "
                                 "'merged' with rollout.async", "adapter"))
    return problems


def check_recipe(recipe: Recipe) -> list[Problem]:
    """Every cross-field problem of a field-valid recipe (empty when it is consistent)."""
    problems = _check_model_source(recipe)
    shape = None
    if not problems:
        shape, shape_problems = _load_shape(
            recipe.model.hf_config, "model.config" if recipe.model.config is not None else "model.path"
        )
        problems += shape_problems
    critic_shape = shape
    if recipe.critic is not None and recipe.critic.model_path is not None:
        critic_shape, critic_problems = _load_shape(
            partial(read_hf_config, recipe.critic.model_path, key="critic.model_path"), "critic.model_path"
        )
        problems += critic_problems
    shapes = {"critic": critic_shape}
    if recipe.reward_model is not None:
        shapes["reward_model"], rm_problems = _load_shape(partial(_reward_model_config, recipe), "reward_model.path")
        problems += rm_problems
    problems += _check_placement(recipe)
    problems += _check_async(recipe)
    for role in active_roles(recipe):
        if role in TRAINING_ROLES:
            problems += _check_training_role(recipe, role, shapes.get(role, shape))
    for role in ("actor", "critic"):
        if role in active_roles(recipe) and role_pool(recipe.placement, role) is not None:
            problems += _check_batches(recipe, role)
    problems += _check_rollout(recipe, shape)
    problems += _check_optimizers(recipe)
    problems += _check_algorithm_and_data(recipe, shape)
    problems += _check_synthetic_sizes(recipe)
    problems += _check_reward(recipe)
    problems += _check_multi_turn(recipe)
    problems += _check_lora(recipe, shape)
    if recipe.reward_model is not None and role_pool(recipe.placement, "reward_model") is not None:
        problems += _check_reward_model_training(recipe)
    return problems
