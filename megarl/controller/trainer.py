"""The controller's step loop: one PPO/GRPO step is the phase table of DESIGN.md §1.

`Trainer.step()` reads top to bottom like that table, one call per phase, each
timed under `timing_s/<phase>`. The reward phase starts during generation (each row
is scored once generated); `timing_s/reward` is the part left after generation,
`timing_s/reward_total` all the time scoring was in progress. The roles (actor,
reference, critic, rollout, reward loop) are built by `megarl.controller.run` and
handed in ready to use.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from megarl.algorithms.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics
from megarl.algorithms.metrics import rollout_logprob_diff
from megarl.controller import phases
from megarl.controller.roles import Roles
from megarl.protocol import Batch


@dataclass
class StepSettings:
    """The few per-step knobs the loop needs, resolved from the recipe once."""

    rollout_n: int
    temperature: float
    max_prompt_length: int
    max_response_length: int
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std: bool
    use_kl_in_reward: bool
    kl_penalty: str
    balance_batch: bool
    critic_warmup: int
    num_devices: int  # every device of the placement the run uses (perf/throughput is per device)


class Trainer:
    def __init__(self, roles: Roles, settings: StepSettings):
        self.roles = roles
        self.settings = settings
        self.timings: dict[str, float] = {}

    @contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        yield
        self.timings[phase] = time.perf_counter() - start

    def step(self, step: int, prompts: Batch) -> dict[str, float]:
        """Run one step on a batch of prompts; returns the step's metrics."""
        r, s, metrics = self.roles, self.settings, {}
        self.timings = {}
        with self._timed("step"):
            batch = phases.add_uids(prompts)
            gen_batch = phases.split_generation_batch(batch).repeat(s.rollout_n, interleave=True)
            batch = batch.repeat(s.rollout_n, interleave=True)
            with self._timed("gen"):
                # Rows are scored as soon as they are generated, while the others still generate.
                scoring = r.reward.begin(batch, gen_batch)
                rollout = r.rollout.generate(gen_batch, temperature=s.temperature, seed=step, on_rows=scoring.add)
            batch = phases.add_response_mask(batch.union(rollout))
            order = np.arange(len(batch))  # the generation row of each batch row
            if s.balance_batch:
                batch, order = batch.balance(r.actor.dp_size)
            with self._timed("reward"):
                batch, reward_metrics = scoring.finish(batch, rows=order)
            self.timings["reward_total"] = scoring.busy_seconds
            with self._timed("old_log_prob"):
                batch, entropy_metrics = r.actor.compute_log_prob(batch, temperature=s.temperature)
            if r.reference is not None:
                with self._timed("ref"):
                    batch = r.reference.compute_ref_log_prob(batch, temperature=s.temperature)
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
            if r.critic is not None:
                with self._timed("update_critic"):
                    metrics.update(r.critic.update(batch))
            # During the critic warm-up the actor is frozen: its weights are the fleet's already.
            if step >= s.critic_warmup:
                with self._timed("update_actor"):
                    metrics.update(r.actor.update(batch))
                with self._timed("update_weights"):
                    metrics.update(r.sync_weights(version=step + 1))
        metrics.update(reward_metrics)
        metrics.update(entropy_metrics)
        metrics.update(self._step_metrics(batch))
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
