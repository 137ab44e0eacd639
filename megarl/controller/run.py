"""`megarl train`: turn a validated recipe into a running job and drive it to the last step.

Set-up order: run directory (resume or start over) and resolved recipe, tokenizer and
data, initial HF weights, metric sinks, Ray and the resource pools, the Megatron worker
groups, the optional SFT warm-up (fresh runs) or the checkpoint (resumed runs), the
engines off their devices (colocated: the fleet sizes its KV cache from the memory
free when it starts), the rollout fleet with the first weight sync, then the step loop. Everything started here
is stopped here, by handle, also when a signal stops the run (`preemption`).
"""

from __future__ import annotations

import logging
import secrets
import shutil
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from megarl import atomic
from megarl.cluster.engine_worker import MegatronWorker, start_engine_group
from megarl.cluster.fleet import start_fleet
from megarl.cluster.leftovers import Footprint, clear_dead_previous
from megarl.cluster.memory import MemoryCycle
from megarl.cluster.placement import plan_pools, total_devices
from megarl.cluster.ray_cluster import ray_for_run
from megarl.cluster.worker_group import WorkerGroup
from megarl.config import Recipe, dump_recipe
from megarl.config.layout import reference_fused
from megarl.config.schema import read_hf_config
from megarl.config.settings import (
    SamplingSettings,
    engine_settings,
    logprob_batching,
    multi_turn_settings,
    policy_update_settings,
    rollout_fleet_settings,
    rollout_sampling,
    sleeps_between_phases,
    StepSettings,
    step_settings,
    validation_sampling,
    value_update_settings,
    weight_sync_settings,
)
from megarl.controller import run_state
from megarl.controller.banner import start_banner
from megarl.controller.bootstrap import prepare_data, prepare_initial_weights
from megarl.controller.checkpointing import StepCheckpoint, complete_steps, load_step
from megarl.controller.disk_full import disk_full_error
from megarl.controller.loop import StepLoop
from megarl.controller.multi_turn import EpisodeRewards, start_agent
from megarl.controller.preemption import Preempted, Preemption
from megarl.controller.preflight import check_checkpoints, prepare_run_dir
from megarl.controller.resume import resume_or_start
from megarl.controller.reward_setup import start_reward_loop
from megarl.controller.roles import CriticRole, PolicyRole, Roles
from megarl.controller.rollout_ahead import AsyncRollout
from megarl.controller.sft import run_sft_warmup
from megarl.controller.step import Trainer
from megarl.errors import InputError
from megarl.rollout import RolloutFleet
from megarl.tracking.tracker import Tracker, controller_log
from megarl.tracking.wandb_sink import WandbSink

logger = logging.getLogger(__name__)


def _engine_group(recipe: Recipe, role: str, pool, *, hf_config: dict, weights: Path, log_dir: Path) -> WorkerGroup:
    """`pool.world_size` ranks hosting the engine of `role` (`engine_settings`), named after the role."""
    return start_engine_group(pool, name=role, settings=engine_settings(recipe, role), hf_config=hf_config,
                              weights=str(weights), log_dir=log_dir)


@dataclass(frozen=True)
class _Engines:
    """The run's engine groups: the actor, and the reference and the critic when the recipe has them."""

    actor: PolicyRole
    reference: PolicyRole | None
    critic: CriticRole | None

    def idle_groups(self) -> list[WorkerGroup]:
        """The groups that sleep through generation and the weight sync (all but the actor's: a fused reference and
        a LoRA actor's reference run on it, and sleep with it)."""
        return [role.group for role in (self.reference, self.critic)
                if role is not None and role.group is not self.actor.group]


def _start_engines(recipe: Recipe, *, pools, weights: Path, sampling: SamplingSettings, log_dir: Path,
                   cleanup: ExitStack) -> _Engines:
    """The actor, the reference and the critic on their pools, from the run's initial `weights` (a critic from
    `critic.model_path` when it names a checkpoint); registers their teardown."""
    hf_config = recipe.model.hf_config()
    actor_group = _engine_group(recipe, "actor", pools["actor"], hf_config=hf_config, weights=weights,
                                log_dir=log_dir)
    cleanup.callback(actor_group.kill)
    actor = PolicyRole(actor_group, batching=logprob_batching(recipe),
                       update=policy_update_settings(recipe, sampling=sampling))
    reference = None
    if recipe.actor.lora is not None and (recipe.algorithm.use_kl_in_reward or recipe.actor.use_kl_loss):
        # No reference engine: the reference policy is the actor's frozen base, its adapters switched off.
        reference = PolicyRole(actor_group, batching=logprob_batching(recipe), adapters=False)
    if "reference" in pools and reference_fused(recipe):
        actor_group.run(MegatronWorker.init_reference, engine_settings(recipe, "reference"), hf_config=hf_config,
                        weights=str(weights))
        reference = PolicyRole(actor_group, batching=logprob_batching(recipe), fused=True)
    elif "reference" in pools:
        ref_group = _engine_group(recipe, "reference", pools["reference"], hf_config=hf_config, weights=weights,
                                  log_dir=log_dir)
        cleanup.callback(ref_group.kill)
        reference = PolicyRole(ref_group, batching=logprob_batching(recipe))
    critic = None
    if recipe.critic is not None:
        critic_path = recipe.critic.model_path
        critic_group = _engine_group(
            recipe, "critic", pools["critic"],
            hf_config=read_hf_config(critic_path, key="critic.model_path") if critic_path else hf_config,
            weights=Path(critic_path) if critic_path else weights, log_dir=log_dir,
        )
        cleanup.callback(critic_group.kill)
        critic = CriticRole(critic_group, update=value_update_settings(recipe))
    return _Engines(actor=actor, reference=reference, critic=critic)


def _hand_off_sft(recipe: Recipe, engines: _Engines, *, data, run_dir: Path, tracker: Tracker,
                  preemption: Preemption) -> None:
    """A fresh run's SFT warm-up on the actor, then its weights to the engines that start where it ends: the
    reference (the policy RL starts from) and a critic without a checkpoint of its own. Raises `Preempted`
    when a stop came during the warm-up."""
    run_sft_warmup(engines.actor, data, recipe, tracker, stop_requested=lambda: preemption.requested)
    if preemption.requested:
        raise Preempted(None, None)
    reference = engines.reference
    if reference is not None and reference.fused:
        engines.actor.group.run(MegatronWorker.copy_actor_to_reference)
    followers = [reference.group] if reference is not None and reference.group is not engines.actor.group else []
    if engines.critic is not None and not recipe.critic.model_path:
        followers.append(engines.critic.group)
    if followers:
        # Through a weights-only checkpoint of the actor: every rank of a follower reads only its own
        # shards, and no full copy of the model passes through this driver.
        handoff = run_dir / "sft_handoff"
        engines.actor.group.run(MegatronWorker.save_checkpoint, str(handoff), weights_only=True)
        for group in followers:
            group.run(MegatronWorker.load_policy_checkpoint, str(handoff))
        shutil.rmtree(handoff)


def _start_fleet(recipe: Recipe, actor: PolicyRole, *, pool, weights: Path, data, api_key: str, run_dir: Path,
                 log_dir: Path, cleanup: ExitStack) -> RolloutFleet:
    """The rollout fleet from the run's initial `weights`, with the actor as its weight source (a server it
    restarts gets the actor's current weights); registers its teardown and the actor's leaving the servers'
    weight-update groups before it."""
    fleet = start_fleet(rollout_fleet_settings(recipe), pool=pool, weights=weights,
                        pad_token_id=data.tokenizer.pad_token_id, api_key=api_key, log_dir=log_dir)
    cleanup.callback(fleet.shutdown)
    fleet.set_weight_source(partial(actor.push_weights, api_key=api_key,
                                    settings=weight_sync_settings(recipe, run_dir)))
    # Registered after fleet.shutdown, so it runs first: leave the servers' broadcast groups.
    cleanup.callback(actor.group.run, MegatronWorker.close_weight_sync)
    return fleet


def _start_roles(recipe: Recipe, *, pools, weights: Path, data, sampling: SamplingSettings, run_dir: Path,
                 tracker: Tracker, cleanup: ExitStack, resume_from: StepCheckpoint | None,
                 preemption: Preemption) -> Roles:
    """The engines, the SFT hand-off (fresh runs) or the checkpoint (resumed runs), the engines to sleep, the
    fleet, the reward loop and the first weight sync; registers their teardown."""
    for pool in set(pools.values()):
        cleanup.callback(pool.release)
    log_dir = run_dir / "logs"
    engines = _start_engines(recipe, pools=pools, weights=weights, sampling=sampling, log_dir=log_dir,
                             cleanup=cleanup)
    if resume_from is None and recipe.sft_warmup.steps > 0:
        _hand_off_sft(recipe, engines, data=data, run_dir=run_dir, tracker=tracker, preemption=preemption)
    memory = MemoryCycle(None, actor=engines.actor.group, idle_groups=engines.idle_groups(),
                         enabled=sleeps_between_phases(recipe))
    roles = Roles(actor=engines.actor, rollout=None, reward=None, memory=memory, reference=engines.reference,
                  critic=engines.critic, kl_ctrl=data.kl_ctrl)
    version = 0
    if resume_from is not None:  # into the engines while they are still on their devices
        load_step(roles, resume_from)
        state = resume_from.controller_state()
        run_state.restore(state, loader=data.train_batches, kl_ctrl=data.kl_ctrl)
        version = state["weight_version"]
    # SGLang sizes its KV cache from the device memory free when it starts: the engines leave first.
    memory.sleep_all()
    api_key = secrets.token_hex(16)  # the policy's fleet and the judge's
    fleet = _start_fleet(recipe, engines.actor, pool=pools["rollout"], weights=weights, data=data, api_key=api_key,
                         run_dir=run_dir, log_dir=log_dir, cleanup=cleanup)
    roles.rollout = memory.fleet = fleet
    if memory.enabled:
        # A restarted server gets the current weights while the engines sleep: the actor wakes for a full sync.
        fleet.set_resync(lambda: memory.sync_from_sleep(lambda: fleet.sync_weights(version=fleet.synced_version)))
    multi_turn = multi_turn_settings(recipe)
    if multi_turn is not None:
        # Registered after fleet.shutdown: the sandbox and the environment stop first, on the fleet's loop.
        roles.episodes = start_agent(multi_turn, fleet=fleet, tokenizer=data.tokenizer, run_dir=run_dir,
                                     cleanup=cleanup)
        roles.reward = EpisodeRewards()
    else:
        roles.reward = start_reward_loop(recipe, pools=pools, tokenizer=data.tokenizer,
                                         manager=data.reward_manager, api_key=api_key, run_dir=run_dir,
                                         cleanup=cleanup)
    memory.sync_from_sleep(lambda: roles.sync_weights(version=version))  # the fleet generates first
    return roles


def _async_rollout(recipe: Recipe, settings: StepSettings, *, roles: Roles, data,
                   resume_from: StepCheckpoint | None, start_step: int, cleanup: ExitStack) -> AsyncRollout | None:
    """The producer and buffer of `rollout.async` (None without it), continuing a checkpoint's resume point (one
    written by a synchronous run: its next step's batch)."""
    if settings.async_rollout is None:
        return None
    ahead = AsyncRollout(roles.rollout, data.train_batches, sampling=settings.sampling, rollout_n=settings.rollout_n,
                         batch_size=recipe.data.train_batch_size, max_staleness=settings.async_rollout.max_staleness,
                         total_steps=recipe.trainer.total_steps,
                         in_flight_updates=settings.async_rollout.in_flight_updates,
                         partial_rollouts=settings.async_rollout.partial_rollouts)
    state = resume_from.controller_state().get("async") if resume_from is not None else None
    ahead.restore(state if state is not None else {"next_batch": start_step, "trained": {}})
    cleanup.callback(ahead.close)
    return ahead


def _tracker(recipe: Recipe, run_dir: Path, resume_from: StepCheckpoint | None) -> Tracker:
    logging = recipe.trainer.logging
    wandb = logging.wandb
    sink = WandbSink(run_dir, name=recipe.name, project=wandb.project, entity=wandb.entity, mode=wandb.mode,
                     config=recipe.model_dump(mode="json")) if wandb.enabled else None
    return Tracker(run_dir, total_steps=recipe.trainer.total_steps, jsonl=logging.jsonl,
                   tensorboard=logging.tensorboard, console=logging.console, wandb=sink,
                   resume_step=resume_from.step if resume_from is not None else None)


def _drive(recipe: Recipe, *, run_dir: Path, data, weights: Path, resume_from: StepCheckpoint | None,
           start_step: int, ray_address: str | None, on_phase, decisions: list[str]) -> None:
    """Ray, the roles and the step loop from `start_step` on; everything started here is stopped here.
    `decisions` (what the start decided, shown already) go to controller.log."""
    checkpoint = recipe.trainer.checkpoint
    with controller_log(run_dir), ExitStack() as cleanup:
        for line in decisions:
            logger.info(line)
        # First in, last out: once everything is stopped, the shared memory of its processes goes too.
        footprint = Footprint(run_dir)
        cleanup.callback(footprint.release)
        tracker = _tracker(recipe, run_dir, resume_from)
        cleanup.callback(tracker.close)
        for line in start_banner(recipe, run_dir, resume_from):
            tracker.message(line)
        footprint.set_temp_dir(ray_for_run(cleanup, ray_address))
        footprint.watch()
        # After ray.init, which installs a SIGTERM handler of its own that ends the process at once.
        preemption = cleanup.enter_context(Preemption(checkpoint.preempt_timeout_s))
        pools = plan_pools(recipe)
        eos = data.tokenizer.eos_token_id
        sampling = rollout_sampling(recipe, eos_token_id=eos)
        roles = _start_roles(recipe, pools=pools, weights=weights, data=data, sampling=sampling, run_dir=run_dir,
                             tracker=tracker, cleanup=cleanup, resume_from=resume_from, preemption=preemption)
        preemption.on_request(roles.rollout.stop_generating)
        settings = step_settings(recipe, sampling=sampling, num_devices=total_devices(pools))
        trainer = Trainer(roles, settings, stop_requested=lambda: preemption.requested, on_phase=on_phase)
        ahead = _async_rollout(recipe, settings, roles=roles, data=data, resume_from=resume_from,
                               start_step=start_step, cleanup=cleanup)
        loop = StepLoop(recipe, run_dir=run_dir, trainer=trainer, roles=roles, data=data, tracker=tracker,
                        preemption=preemption, newest=resume_from,
                        val_sampling=validation_sampling(recipe, eos_token_id=eos), ahead=ahead)
        loop.run(start_step)


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
    decisions: list[str] = []  # shown now, written to controller.log once it is open

    def decide(line: str) -> None:
        decisions.append(line)
        print(f"megarl: {line}", flush=True)

    for leftover in clear_dead_previous(run_dir):
        decide(f"removed {leftover}, left by a previous run of {run_dir} that died")
    resume_from = resume_or_start(run_dir, recipe, say=decide)
    start_step = resume_from.step if resume_from is not None else 0
    if start_step >= recipe.trainer.total_steps:
        print(f"megarl: {run_dir} already completed step {start_step} (trainer.total_steps="
              f"{recipe.trainer.total_steps}); raise total_steps to continue it", flush=True)
        return run_dir
    data = prepare_data(recipe, run_dir)
    weights = prepare_initial_weights(recipe, run_dir, data.tokenizer)
    # Written once every check passed, so a refused run leaves an earlier run's recipe alone.
    atomic.write_text(run_dir / "recipe.yaml", dump_recipe(recipe))
    try:
        _drive(recipe, run_dir=run_dir, data=data, weights=weights, resume_from=resume_from, start_step=start_step,
               ray_address=ray_address, on_phase=on_phase, decisions=decisions)
    except (Preempted, InputError):
        raise
    except Exception as error:
        # The disk filled under the run (a log, metrics, a sync file): said as such, not as what failed on it.
        newest = complete_steps(run_dir)
        full = disk_full_error(error, run_dir,
                               note=f"{newest[-1].path} is intact" if newest else "no checkpoint was written")
        if full is not None and full is not error:
            raise full from error
        raise
    return run_dir

