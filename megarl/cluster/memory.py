"""The sleep/wake cycle of colocated roles: the rollout fleet and the Megatron engines take turns on the devices.

While the fleet generates, the engines hold nothing on the device; while they train,
the fleet has released its memory (SGLang's memory saver, or the CPU engine that
imitates it). One step, with `placement.offload` on a colocated placement:

    generate -> wake_trainers: fleet releases kv_cache (+ weights when the actor will
    be updated), engines onload -> old_log_prob, ref, values, adv, update_critic,
    update_actor -> before_sync: critic and reference offload everything, the actor its
    optimizer state and gradients, the fleet resumes its weights -> update_weights ->
    after_sync: the actor offloads its weights, the fleet resumes its kv_cache.

In a step that does not update the actor (critic warm-up) the fleet keeps its weights,
since nothing would sync them back. A LoRA actor's sync moves only what its adapters change
(merged adapted linears, or the adapters alone): its fleet runs with a host copy of its
weights (`--enable-weights-cpu-backup`), so the released frozen base comes back from there.
The step loop times each direction as `timing_s/onload` and `timing_s/offload`. Without the
cycle every call is a no-op.

Start-up: SGLang sizes its KV cache from the device memory free when it starts
(`mem_fraction` of it, less its weights: `mem_cache/kv_cache_configurator.py` in
0.5.23), so every engine goes to sleep
(`sleep_all`) before the fleet starts, and the first sync (`sync_from_sleep`) wakes
the actor alone, with the fleet's memory released as around every later sync.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megarl.cluster.engine_worker import MegatronWorker
from megarl.cluster.worker_group import WorkerGroup

GENERATION_MEMORY = ["kv_cache", "cuda_graph"]


class MemoryCycle:
    """Drives the fleet's memory release/resume and the engines' offload/onload; `enabled=False` does nothing."""

    def __init__(self, fleet: Any, *, actor: WorkerGroup, idle_groups: Sequence[WorkerGroup], enabled: bool):
        """`fleet` may be None until the fleet has started (after `sleep_all`); set `fleet` then."""
        self.fleet, self.actor, self.idle_groups, self.enabled = fleet, actor, list(idle_groups), enabled
        self._fleet_weights_released = False

    def _groups(self) -> list[WorkerGroup]:
        return [self.actor, *self.idle_groups]

    def sleep_all(self) -> None:
        """Every engine off the device (after set-up, before the fleet starts)."""
        if self.enabled:
            for group in self._groups():
                group.run(MegatronWorker.offload, weights=True)

    def sync_from_sleep(self, sync: Callable[[], Any]) -> Any:
        """The run's first `sync()`, the engines asleep and the fleet holding all its memory: the fleet lets go
        of its KV cache and weights, the actor wakes with its weights only, syncs, and everything is as after
        any later sync. Returns what `sync` returns."""
        if not self.enabled:
            return sync()
        self.fleet.release_memory(GENERATION_MEMORY + ["weights"])
        self._fleet_weights_released = True
        self.actor.run(MegatronWorker.onload)
        self.actor.run(MegatronWorker.offload, weights=False)
        self.fleet.resume_memory(["weights"])
        result = sync()
        self.after_sync()
        return result

    def wake_trainers(self, *, actor_updates: bool) -> None:
        """After generation: the fleet gives its memory back, the engines come back onto the device."""
        if not self.enabled:
            return
        self._fleet_weights_released = actor_updates
        self.fleet.release_memory(GENERATION_MEMORY + (["weights"] if actor_updates else []))
        for group in self._groups():
            group.run(MegatronWorker.onload)

    def before_sync(self) -> None:
        """After the updates: idle engines off the device, the actor keeps only its weights, the fleet its weights."""
        if not self.enabled:
            return
        for group in self.idle_groups:
            group.run(MegatronWorker.offload, weights=True)
        self.actor.run(MegatronWorker.offload, weights=False)
        if self._fleet_weights_released:
            self.fleet.resume_memory(["weights"])

    def after_sync(self) -> None:
        """The actor's weights off the device too; the fleet ready to generate."""
        if not self.enabled:
            return
        self.actor.run(MegatronWorker.offload, weights=True)
        self.fleet.resume_memory(GENERATION_MEMORY)
        self._fleet_weights_released = False


def peak_memory_metrics(groups: dict[str, WorkerGroup]) -> dict[str, float]:
    """`perf/max_memory_gb/<role>`: the largest peak of any rank of each role (device memory on GPUs, the
    process's resident memory on CPU); `perf/train_state_gb/<role>`: the largest training state of a rank
    (weights, gradient buffers, optimizer state), what a role keeps whatever the runtime around it weighs."""
    metrics = {}
    for role, group in groups.items():
        metrics[f"perf/max_memory_gb/{role}"] = max(group.run(MegatronWorker.peak_memory_gb))
        metrics[f"perf/train_state_gb/{role}"] = max(group.run(MegatronWorker.train_state_gb))
    return metrics
