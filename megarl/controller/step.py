"""One PPO/GRPO step: the phase table of docs/step.md.

`Trainer.step()` reads top to bottom like that table, one call per phase, each
timed under `timing_s/<phase>`. The reward phase starts during generation (each row
is scored once generated); `timing_s/reward` is the part left after generation,
`timing_s/reward_total` all the time scoring was in progress. The roles (actor,
reference, critic, rollout, reward loop) are built by `megarl.controller.run` and
handed in ready to use.

Stopping (SIGTERM): until the first update phase nothing but the controller's own
state has changed, so a step asked to stop before then is abandoned at the next phase
boundary (or as its generation is cancelled) with `StepAbandoned`; once an update has
begun the step runs to its end, so a checkpoint is always taken between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import contextmanager

import numpy as np

from megarl.algorithms.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from megarl.algorithms.metrics import rollout_logprob_diff
from megarl.config.settings import StepSettings
from megarl.controller import phases
from megarl.controller.group_buffer import Group
from megarl.controller.roles import Roles
from megarl.controller.rollout_ahead import AsyncRollout, assemble
from megarl.protocol import Batch
from megarl.rollout import GenerationInterrupted
from megarl.rollout.batching import rollout_batch

logger = logging.getLogger(__name__)

# Phases after which the engines' weights or optimizers have not changed yet.
ABANDONABLE = frozenset({"step", "gen", "reward", "old_log_prob", "ref", "values", "adv"})


class StepAbandoned(Exception):
    """A stop was requested before the step's first update: its results are discarded."""


class Trainer:
    def __init__(self, roles: Roles, settings: StepSettings, *, stop_requested: Callable[[], bool] = lambda: False,
                 on_phase: Callable[[int, str], None] | None = None):
        """`on_phase(step, phase)` hears each phase begin (`step` first), steps numbered from 1 (a progress line)."""
        self.roles = roles
        self.settings = settings
        self.stop_requested = stop_requested
        self.on_phase = on_phase
        self.timings: dict[str, float] = {}
        self.last_batch: Batch | None = None  # the latest step's full batch (for sample logging)
        self._step = 0

    @contextmanager
    def _timed(self, phase: str):
        """Time a phase; a phase timed twice in one step (offload) adds up. A preemption request abandons
        the step at the next abandonable phase."""
        if phase in ABANDONABLE and self.stop_requested():
            raise StepAbandoned(phase)
        if phase != "step":
            logger.info("step %d: %s", self._step + 1, phase)  # where a stuck run is stuck
        if self.on_phase is not None:
            self.on_phase(self._step + 1, phase)
        start = time.perf_counter()
        try:
            yield
        except GenerationInterrupted as interrupted:
            raise StepAbandoned(phase) from interrupted
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start

    def _cycle(self, phase: str, move) -> None:
        """One direction of the sleep/wake cycle (`megarl.cluster.memory`), timed only when the cycle runs."""
        if self.roles.memory.enabled:
            with self._timed(phase):
                move()

    def step(self, step: int, prompts: Batch) -> dict[str, float]:
        """Run one step on a batch of prompts; returns the step's metrics."""
        r, s = self.roles, self.settings
        self.timings, self._step = {}, step
        with self._timed("step"):
            batch = phases.add_uids(prompts)
            gen_batch = phases.split_generation_batch(batch).repeat(s.rollout_n, interleave=True)
            batch = batch.repeat(s.rollout_n, interleave=True)
            with self._timed("gen"):
                # Rows are scored as soon as they are generated, while the others still generate.
                scoring = r.reward.begin(batch, gen_batch)
                rollout = r.generate(gen_batch, s.sampling, seed=step, on_rows=scoring.add)
            batch = phases.add_response_mask(batch.union(rollout))
            batch, metrics = self._train(step, batch, scoring)
        return self._finish(batch, metrics)

    def step_ahead(self, step: int, ahead: AsyncRollout) -> tuple[dict[str, float], list[Group]]:
        """One step of asynchronous RL: train on the oldest complete groups `ahead` has generated (the wait for
        them is `timing_s/gen`); returns the metrics and the groups trained (`ahead.commit` them)."""
        r, s = self.roles, self.settings
        self.timings, self._step = {}, step
        version = int(r.rollout.weight_version)  # the proximal policy's: the trainer's weights, as synced
        with self._timed("step"):
            with self._timed("gen"):
                groups, async_metrics = ahead.take(version=version, stop_requested=self.stop_requested)
            width = s.sampling.max_new_tokens
            rows, gen_batch, results, versions = assemble(groups, version=version, width=width)
            scoring = r.reward.begin(rows, gen_batch)
            scoring.add(list(range(len(results))), results)
            rollout = rollout_batch(gen_batch, results, pad_id=r.rollout.pad_token_id, max_response_length=width)
            rollout["token_versions"] = versions
            batch = phases.add_response_mask(rows.union(rollout))
            batch, metrics = self._train(step, batch, scoring, proximal_version=version)
        metrics.update(async_metrics)
        return self._finish(batch, metrics), groups

    def _train(self, step: int, batch: Batch, scoring, *,
               proximal_version: int | None = None) -> tuple[Batch, dict[str, float]]:
        """The phases after generation, reward to weight sync, on the generated `batch`."""
        r, s, metrics = self.roles, self.settings, {}
        order = np.arange(len(batch))  # the generation row of each batch row
        if s.balance_batch:
            batch, order = batch.balance(r.actor.dp_size)
        actor_updates = step >= s.critic_warmup  # the critic warm-up freezes the actor
        self._cycle("onload", lambda: r.memory.wake_trainers(actor_updates=actor_updates))
        with self._timed("reward"):
            batch, reward_metrics = scoring.finish(batch, rows=order)
        self.timings["reward_total"] = scoring.busy_seconds
        with self._timed("old_log_prob"):
            batch, entropy_metrics = r.actor.compute_log_prob(batch, temperature=s.sampling.temperature)
        if r.reference is not None:
            with self._timed("ref"):
                batch = r.reference.compute_ref_log_prob(batch, temperature=s.sampling.temperature)
        if r.critic is not None:
            with self._timed("values"):
                batch = r.critic.compute_values(batch)
        with self._timed("adv"):
            if s.use_kl_in_reward:
                metrics.update(r.apply_kl_in_reward(batch, kind=s.kl_penalty))
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
            batch = phases.compute_advantage(
                batch, estimator=s.adv_estimator, gamma=s.gamma, lam=s.lam, norm_by_std=s.norm_adv_by_std
            )
            actor_batch, corrected = batch, s.async_rollout
            if corrected is not None and proximal_version is not None:
                actor_batch, correction_metrics = phases.off_policy_corrected(
                    batch, proximal_version=proximal_version, mode=corrected.correction_mode,
                    level=corrected.correction_level, cap=corrected.correction_cap)
                metrics.update(correction_metrics)
        if r.critic is not None:
            with self._timed("update_critic"):
                metrics.update(r.critic.update(batch))
        if actor_updates:
            with self._timed("update_actor"):
                metrics.update(r.actor.update(actor_batch))
        self._cycle("offload", r.memory.before_sync)
        # A frozen actor's weights are the fleet's already: nothing to sync.
        if actor_updates:
            with self._timed("update_weights"):
                metrics.update(r.sync_weights(version=step + 1))
        self._cycle("offload", r.memory.after_sync)
        metrics.update(reward_metrics)
        metrics.update(entropy_metrics)
        return batch, metrics

    def _finish(self, batch: Batch, metrics: dict[str, float]) -> dict[str, float]:
        metrics.update(self.roles.peak_memory())
        metrics.update(self._step_metrics(batch))
        self.last_batch = batch
        return metrics

    def _step_metrics(self, batch: Batch) -> dict[str, float]:
        mask = batch["response_mask"]
        prompt_width = batch["prompts"].shape[1]
        metrics = compute_data_metrics(
            token_level_scores=batch["token_level_scores"],
            token_level_rewards=batch["token_level_rewards"],
            advantages=batch["advantages"],
            returns=batch["returns"],
            response_mask=mask,
            prompt_mask=batch["attention_mask"][:, :prompt_width],
            max_response_length=self.settings.max_response_length,
            max_prompt_length=self.settings.max_prompt_length,
            values=batch["values"] if "values" in batch else None,
            response_span=batch["attention_mask"][:, prompt_width:],
            kept=~batch["dropped"] if "dropped" in batch else None,  # rows a failed remote reward dropped
        )
        metrics["rollout/logprob_diff"] = float(
            rollout_logprob_diff(batch["rollout_log_probs"], batch["old_log_probs"], mask)
        )
        metrics.update(compute_timing_metrics(self.timings))
        metrics.update(
            compute_throughput_metrics(
                total_tokens=int(batch["attention_mask"].sum()),
                step_seconds=self.timings["step"],
                num_gpus=self.settings.num_devices,
            )
        )
        return metrics
