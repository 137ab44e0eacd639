"""`megarl train`: turn a validated recipe into a running job and drive it to the last step.

Set-up order: run directory (resume or start over) and resolved recipe, tokenizer and
data, initial HF weights, metric sinks, Ray and the resource pools, the Megatron worker
groups, the optional SFT warm-up (fresh runs) or the checkpoint (resumed runs), the
rollout fleet with the first weight sync, then the step loop. Everything started here
is stopped here, by handle, also when a signal stops the run (`preemption`).
"""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from megarl import atomic
from megarl.cluster.engine_worker import start_engine_group
from megarl.cluster.fleet import sleeps_between_phases, start_rollout_fleet
from megarl.cluster.memory import MemoryCycle
from megarl.cluster.placement import plan_pools, total_devices
from megarl.cluster.ray_cluster import ray_for_run
from megarl.cluster.worker_group import WorkerGroup
from megarl.config import Recipe, dump_recipe
from megarl.config.schema import read_hf_config
from megarl.config.settings import (
    logprob_batching,
    optimizer_settings,
    policy_update_settings,
    value_update_settings,
    weight_sync_settings,
)
from megarl.controller import run_state
from megarl.controller.bootstrap import prepare_data, prepare_initial_weights
from megarl.controller.checkpointing import StepCheckpoint, load_step
from megarl.controller.loop import StepLoop
from megarl.controller.preemption import Preempted, Preemption
from megarl.controller.preflight import check_checkpoints, prepare_run_dir
from megarl.controller.resume import resume_or_start
from megarl.controller.reward_setup import start_reward_loop
from megarl.controller.roles import CriticRole, PolicyRole, Roles
from megarl.controller.sft import run_sft_warmup
from megarl.controller.step import StepSettings, Trainer
from megarl.errors import InputError
from megarl.tracking.tracker import Tracker, controller_log
from megarl.tracking.wandb_sink import WandbSink


def _engine_group(recipe: Recipe, pool, *, name: str, kind: str, parallel, hf_config: dict, weights: Path,
                  optimizer, log_dir: Path) -> WorkerGroup:
    """`pool.world_size` ranks hosting one engine of `kind` ("policy" or "value")."""
    return start_engine_group(pool, name=name, kind=kind, parallel=parallel.model_dump(), hf_config=hf_config,
                              weights=str(weights), seed=recipe.seed, params_dtype=recipe.model.dtype,
                              transformer_impl=recipe.model.transformer_impl, optimizer=optimizer, log_dir=log_dir)


def _start_roles(recipe: Recipe, *, pools, weights: Path, data, run_dir: Path, tracker: Tracker,
                 cleanup: ExitStack, resume_from: StepCheckpoint | None, preemption: Preemption) -> Roles:
    """Worker groups, the SFT warm-up (fresh runs) or the checkpoint (resumed runs), the fleet and the first
    weight sync; registers their teardown."""
    for pool in set(pools.values()):
        cleanup.callback(pool.release)
    hf_config, log_dir = recipe.model.hf_config(), run_dir / "logs"
    actor_group = _engine_group(recipe, pools["actor"], name="actor", kind="policy", parallel=recipe.actor.parallel,
                                hf_config=hf_config, weights=weights, optimizer=optimizer_settings(recipe, "actor"),
                                log_dir=log_dir)
    cleanup.callback(actor_group.kill)
    actor = PolicyRole(actor_group, batching=logprob_batching(recipe), update=policy_update_settings(recipe))
    reference = None
    if "reference" in pools:
        ref_group = _engine_group(recipe, pools["reference"], name="reference", kind="policy",
                                  parallel=recipe.reference.parallel, hf_config=hf_config, weights=weights,
                                  optimizer=None, log_dir=log_dir)
        cleanup.callback(ref_group.kill)
        reference = PolicyRole(ref_group, batching=logprob_batching(recipe))
    critic = None
    if recipe.critic is not None:
        critic_path = recipe.critic.model_path
        critic_group = _engine_group(
            recipe, pools["critic"], name="critic", kind="value", parallel=recipe.critic.parallel,
            hf_config=read_hf_config(critic_path, key="critic.model_path") if critic_path else hf_config,
            weights=Path(critic_path) if critic_path else weights, optimizer=optimizer_settings(recipe, "critic"),
            log_dir=log_dir,
        )
        cleanup.callback(critic_group.kill)
        critic = CriticRole(critic_group, update=value_update_settings(recipe))
    if resume_from is None and recipe.sft_warmup.steps > 0:
        run_sft_warmup(actor, data, recipe, tracker, stop_requested=lambda: preemption.requested)
        if preemption.requested:
            raise Preempted(None, None)
        # The reference is the policy RL starts from: the warmed-up weights, not the initial ones;
        # a critic without its own checkpoint starts from the same backbone.
        followers = [reference.group] if reference is not None else []
        if critic is not None and not recipe.critic.model_path:
            followers.append(critic.group)
        if followers:
            # Through a weights-only checkpoint of the actor: every rank of a follower reads only its own
            # shards, and no full copy of the model passes through this driver.
            handoff = run_dir / "sft_handoff"
            actor_group.run("save_checkpoint", str(handoff), weights_only=True)
            for group in followers:
                group.run("load_policy_checkpoint", str(handoff))
            shutil.rmtree(handoff)
    api_key = secrets.token_hex(16)
    fleet = start_rollout_fleet(recipe, pool=pools["rollout"], weights=weights, tokenizer=data.tokenizer,
                                api_key=api_key, log_dir=log_dir)
    cleanup.callback(fleet.shutdown)
    # The fleet re-pushes the actor's current weights to a server it had to restart.
    fleet.set_weight_source(partial(actor.push_weights, api_key=api_key,
                                    settings=weight_sync_settings(recipe, run_dir)))
    # Registered after fleet.shutdown, so it runs first: leave the servers' broadcast groups.
    cleanup.callback(actor_group.run, "close_weight_sync")
    reward = start_reward_loop(recipe, pools=pools, tokenizer=data.tokenizer, manager=data.reward_manager,
                               api_key=api_key, run_dir=run_dir, cleanup=cleanup)
    idle = [role.group for role in (reference, critic) if role is not None]
    memory = MemoryCycle(fleet, actor=actor_group, idle_groups=idle, enabled=sleeps_between_phases(recipe))
    roles = Roles(actor=actor, rollout=fleet, reward=reward, memory=memory, reference=reference, critic=critic,
                  kl_ctrl=data.kl_ctrl)
    version = 0
    if resume_from is not None:
        load_step(roles, resume_from)
        state = resume_from.controller_state()
        run_state.restore(state, loader=data.train_batches, kl_ctrl=data.kl_ctrl)
        version = state["weight_version"]
    roles.sync_weights(version=version)
    memory.sleep_all()  # the fleet generates first
    return roles


def _tracker(recipe: Recipe, run_dir: Path, resume_from: StepCheckpoint | None) -> Tracker:
    logging = recipe.trainer.logging
    wandb = logging.wandb
    sink = WandbSink(run_dir, name=recipe.name, project=wandb.project, entity=wandb.entity, mode=wandb.mode,
                     config=recipe.model_dump(mode="json")) if wandb.enabled else None
    return Tracker(run_dir, total_steps=recipe.trainer.total_steps, jsonl=logging.jsonl,
                   tensorboard=logging.tensorboard, console=logging.console, wandb=sink,
                   resume_step=resume_from.step if resume_from is not None else None)


def train(recipe: Recipe, *, ray_address: str | None = None,
          on_phase: Callable[[int, str], None] | None = None) -> Path:
    """Run `recipe` to its last step, resuming its run directory's newest checkpoint when it has one
    (`trainer.checkpoint.resume: auto`); returns the run directory. `on_phase(step, phase)` hears every
    phase of every step begin (`megarl bench` draws its progress line with it).

    Joins `ray_address`, or the Ray already initialised in this process, or starts a
    local one (and then stops it at the end). On SIGTERM/SIGINT it checkpoints, stops
    everything it started and raises `Preempted`.
    """
    problems = check_checkpoints(recipe)
    if problems:
        raise InputError(problems)
    run_dir = prepare_run_dir(recipe)
    resume_from = resume_or_start(run_dir, recipe, say=lambda line: print(f"megarl: {line}", flush=True))
    start_step = resume_from.step if resume_from is not None else 0
    if start_step >= recipe.trainer.total_steps:
        print(f"megarl: {run_dir} already completed step {start_step} (trainer.total_steps="
              f"{recipe.trainer.total_steps}); raise total_steps to continue it", flush=True)
        return run_dir
    data = prepare_data(recipe, run_dir)
    weights = prepare_initial_weights(recipe, run_dir, data.tokenizer)
    # Written once every check passed, so a refused run leaves an earlier run's recipe alone.
    atomic.write_text(run_dir / "recipe.yaml", dump_recipe(recipe))
    checkpoint = recipe.trainer.checkpoint

    with controller_log(run_dir), ExitStack() as cleanup:
        tracker = _tracker(recipe, run_dir, resume_from)
        cleanup.callback(tracker.close)
        ray_for_run(cleanup, ray_address)
        # After ray.init, which installs a SIGTERM handler of its own that ends the process at once.
        preemption = cleanup.enter_context(Preemption(checkpoint.preempt_timeout_s))
        pools = plan_pools(recipe)
        roles = _start_roles(recipe, pools=pools, weights=weights, data=data, run_dir=run_dir, tracker=tracker,
                             cleanup=cleanup, resume_from=resume_from, preemption=preemption)
        preemption.on_request(roles.rollout.stop_generating)
        trainer = Trainer(roles, _step_settings(recipe, total_devices(pools)),
                          stop_requested=lambda: preemption.requested, on_phase=on_phase)
        loop = StepLoop(recipe, run_dir=run_dir, trainer=trainer, roles=roles, data=data, tracker=tracker,
                        preemption=preemption, newest=resume_from)
        loop.run(start_step)
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
