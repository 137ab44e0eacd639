"""`megarl train`: turn a validated recipe into a running job and drive it to the last step.

Set-up order: run directory and resolved recipe, tokenizer and data, initial HF
weights, Ray and the resource pools, the Megatron worker groups, the optional
SFT warm-up, the rollout fleet with the first weight sync, then the step loop
with validation. Everything started here is stopped here, by handle.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from megarl import atomic
from megarl.config import Recipe, dump_recipe
from megarl.config.schema import read_hf_config
from megarl.config.settings import (
    logprob_batching,
    optimizer_settings,
    policy_update_settings,
    value_update_settings,
    weight_sync_settings,
)
from megarl.controller.bootstrap import prepare_data, prepare_initial_weights
from megarl.controller.checkpointing import refuse_silent_restart, save_step
from megarl.controller.engine_worker import start_engine_group
from megarl.controller.fleet import start_rollout_fleet
from megarl.controller.placement import plan_pools, total_devices
from megarl.controller.preflight import check_checkpoints, prepare_run_dir
from megarl.controller.ray_cluster import connect_ray, start_local_ray
from megarl.controller.reward_setup import start_reward_loop
from megarl.controller.roles import CriticRole, PolicyRole, Roles
from megarl.controller.sft import run_sft_warmup
from megarl.controller.tracking import Tracker
from megarl.controller.trainer import StepSettings, Trainer
from megarl.controller.validation import validate
from megarl.controller.worker_group import WorkerGroup
from megarl.errors import InputError
from megarl.protocol import Batch


def _engine_group(recipe: Recipe, pool, *, name: str, kind: str, parallel, hf_config: dict, weights: Path,
                  optimizer) -> WorkerGroup:
    """`pool.world_size` ranks hosting one engine of `kind` ("policy" or "value")."""
    return start_engine_group(pool, name=name, kind=kind, parallel=parallel.model_dump(), hf_config=hf_config,
                              weights=str(weights), seed=recipe.seed, params_dtype=recipe.model.dtype,
                              optimizer=optimizer)


def _start_roles(recipe: Recipe, *, pools, weights: Path, data, run_dir: Path, tracker: Tracker,
                 cleanup: ExitStack) -> Roles:
    """Worker groups, the optional SFT warm-up, the fleet and the first weight sync; registers their teardown."""
    for pool in set(pools.values()):
        cleanup.callback(pool.release)
    hf_config = recipe.model.hf_config()
    actor_group = _engine_group(recipe, pools["actor"], name="actor", kind="policy", parallel=recipe.actor.parallel,
                                hf_config=hf_config, weights=weights, optimizer=optimizer_settings(recipe, "actor"))
    cleanup.callback(actor_group.kill)
    actor = PolicyRole(actor_group, batching=logprob_batching(recipe), update=policy_update_settings(recipe))
    reference = None
    if "reference" in pools:
        ref_group = _engine_group(recipe, pools["reference"], name="reference", kind="policy",
                                  parallel=recipe.reference.parallel, hf_config=hf_config, weights=weights,
                                  optimizer=None)
        cleanup.callback(ref_group.kill)
        reference = PolicyRole(ref_group, batching=logprob_batching(recipe))
    critic = None
    if recipe.critic is not None:
        critic_path = recipe.critic.model_path
        critic_group = _engine_group(
            recipe, pools["critic"], name="critic", kind="value", parallel=recipe.critic.parallel,
            hf_config=read_hf_config(critic_path, key="critic.model_path") if critic_path else hf_config,
            weights=Path(critic_path) if critic_path else weights, optimizer=optimizer_settings(recipe, "critic"),
        )
        cleanup.callback(critic_group.kill)
        critic = CriticRole(critic_group, update=value_update_settings(recipe))
    if recipe.sft_warmup.steps > 0:
        run_sft_warmup(actor, data, recipe, tracker)
        # The reference is the policy RL starts from: the warmed-up weights, not the initial ones;
        # a critic without its own checkpoint starts from the same backbone.
        followers = [reference.group] if reference is not None else []
        if critic is not None and not recipe.critic.model_path:
            followers.append(critic.group)
        if followers:
            named = next(sd for sd in actor_group.run("hf_state_dict") if sd is not None)
            for group in followers:
                group.run("load_hf_state_dict", named)
    api_key = secrets.token_hex(16)
    fleet = start_rollout_fleet(recipe, pool=pools["rollout"], weights=weights, tokenizer=data.tokenizer,
                                api_key=api_key, log_dir=run_dir / "logs")
    cleanup.callback(fleet.shutdown)
    # The fleet re-pushes the actor's current weights to a server it had to restart.
    fleet.set_weight_source(partial(actor.push_weights, api_key=api_key,
                                    settings=weight_sync_settings(recipe, run_dir)))
    # Registered after fleet.shutdown, so it runs first: leave the servers' broadcast groups.
    cleanup.callback(actor_group.run, "close_weight_sync")
    reward = start_reward_loop(recipe, pools=pools, tokenizer=data.tokenizer, manager=data.reward_manager,
                               api_key=api_key, run_dir=run_dir, cleanup=cleanup)
    roles = Roles(actor=actor, rollout=fleet, reward=reward, reference=reference, critic=critic,
                  kl_ctrl=data.kl_ctrl)
    roles.sync_weights(version=0)
    return roles


def train(recipe: Recipe, *, ray_address: str | None = None) -> Path:
    """Run `recipe` to its last step; returns the run directory.

    Joins `ray_address`, or the Ray already initialised in this process, or
    starts a local one (and then stops it at the end).
    """
    import ray

    problems = check_checkpoints(recipe)
    if problems:
        raise InputError(problems)
    run_dir = prepare_run_dir(recipe)
    checkpoint = recipe.trainer.checkpoint
    refuse_silent_restart(run_dir, resume=checkpoint.resume)
    data = prepare_data(recipe, run_dir)
    weights = prepare_initial_weights(recipe, run_dir, data.tokenizer)
    # Written once every check passed, so a refused run leaves an earlier run's recipe alone.
    atomic.write_text(run_dir / "recipe.yaml", dump_recipe(recipe))

    with ExitStack() as cleanup:
        if ray_address:
            connect_ray(ray_address)
        elif not ray.is_initialized():
            ray_dir = tempfile.mkdtemp(prefix="megarl-ray-")
            cleanup.callback(shutil.rmtree, ray_dir, True)
            start_local_ray(temp_dir=ray_dir, num_cpus=8)
            cleanup.callback(ray.shutdown)
        logging = recipe.trainer.logging
        tracker = Tracker(run_dir, total_steps=recipe.trainer.total_steps, jsonl=logging.jsonl,
                          tensorboard=logging.tensorboard, console=logging.console)
        cleanup.callback(tracker.close)
        pools = plan_pools(recipe)
        roles = _start_roles(recipe, pools=pools, weights=weights, data=data, run_dir=run_dir, tracker=tracker,
                             cleanup=cleanup)
        trainer = Trainer(roles, _step_settings(recipe, total_devices(pools)))

        def run_validation() -> dict[str, float]:
            return validate(data.val_batches(), generate=roles.rollout.generate, reward_fn=data.reward_fn,
                            temperature=recipe.rollout.val_temperature)

        val_every, total = recipe.trainer.val_every, recipe.trainer.total_steps
        if val_every and recipe.trainer.val_before_train:
            tracker.log(0, run_validation())
        for step in range(total):
            metrics = trainer.step(step, Batch.from_dict(next(data.train_batches)))
            if val_every and ((step + 1) % val_every == 0 or step + 1 == total):
                metrics.update(run_validation())
            metrics["train/epoch"] = data.train_batches.epoch
            tracker.log(step + 1, metrics)
            if checkpoint.save_every and (step + 1) % checkpoint.save_every == 0:
                save_step(roles, run_dir, step=step + 1, keep_last=checkpoint.keep_last)
    return run_dir


def _step_settings(recipe: Recipe, num_devices: int) -> StepSettings:
    algo = recipe.algorithm
    return StepSettings(
        rollout_n=recipe.rollout.n,
        temperature=recipe.rollout.temperature,
        max_prompt_length=recipe.data.max_prompt_length,
        max_response_length=recipe.data.max_response_length,
        adv_estimator=algo.adv_estimator,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
        use_kl_in_reward=algo.use_kl_in_reward,
        kl_penalty=algo.kl_penalty,
        balance_batch=recipe.trainer.balance_batch,
        critic_warmup=recipe.critic.warmup_steps if recipe.critic else 0,
        num_devices=num_devices,
    )
