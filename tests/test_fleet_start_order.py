"""Colocated start-up: every engine is off its device before the rollout fleet starts, and the first sync wakes
the actor alone; a server restarted later is re-synced the same way, on the driver's thread.

SGLang sizes its KV cache from the device memory free when it starts (mem_fraction of
it, less its weights): an engine still holding its
weights, gradients and optimizer state then takes its footprint out of the cache for
the whole run. `_start_roles` runs here with recording stand-ins for the engine groups
and the fleet (nothing else of the run is faked), on the PPO quickstart (actor, critic
and reference; colocated with offload, and without it).
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

from megarl.config import load_recipe
from megarl.config.settings import rollout_sampling
from megarl.controller import run

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-ppo-cpu.yaml"


class _Group:
    def __init__(self, name: str, log: list):
        self.name, self.log, self.dp_size = name, log, 1

    def run(self, method, *args, **kwargs):
        name = getattr(method, "__name__", method)  # a method name, or (typed calls) the method itself
        self.log.append((self.name, name, kwargs.get("weights")))
        return [None]

    def kill(self) -> None:
        pass


class _Fleet:
    def __init__(self, log: list):
        self.log = log
        log.append(("fleet", "start", None))

    def set_weight_source(self, source) -> None:
        pass

    def set_resync(self, resync) -> None:
        self.log.append(("fleet", "set_resync", None))
        self.resync = resync

    @property
    def synced_version(self):
        return 3  # what a run that has synced version 3 re-syncs a restarted server to

    def release_memory(self, tags) -> None:
        self.log.append(("fleet", "release", tuple(tags)))

    def resume_memory(self, tags) -> None:
        self.log.append(("fleet", "resume", tuple(tags)))

    def sync_weights(self, *, version):
        self.log.append(("fleet", "sync", version))
        return {}

    def shutdown(self) -> None:
        pass


class _Pool:
    def release(self) -> None:
        pass


def _start(monkeypatch, tmp_path, overrides: list[str]) -> list:
    log: list = []
    monkeypatch.setattr(run, "_engine_group", lambda recipe, role, pool, **_: _Group(role, log))
    monkeypatch.setattr(run, "start_fleet", lambda settings, **_: _Fleet(log))
    monkeypatch.setattr(run, "start_reward_loop", lambda recipe, **_: "reward loop")
    recipe = load_recipe(RECIPE, ["sft_warmup.steps=0", f"trainer.output_dir={tmp_path}", *overrides])
    pool = _Pool()
    pools = {role: pool for role in ("actor", "critic", "reference", "rollout")}
    data = SimpleNamespace(tokenizer=SimpleNamespace(pad_token_id=0), reward_manager=None, kl_ctrl=None)
    with ExitStack() as cleanup:
        roles = run._start_roles(recipe, pools=pools, weights=tmp_path / "w", data=data,
                                 sampling=rollout_sampling(recipe, eos_token_id=1), run_dir=tmp_path, tracker=None, cleanup=cleanup,
                                 resume_from=None, preemption=SimpleNamespace(requested=False))
        assert roles.rollout is roles.memory.fleet and roles.reward == "reward loop"
        started = list(log)  # before the teardown adds its own calls
        if hasattr(roles.rollout, "resync"):  # a restarted server, later, with the engines asleep
            del log[:]
            roles.rollout.resync()
            started.append(("later", "resync", list(log)))
        return started


def test_the_engines_sleep_before_the_fleet_starts_and_the_actor_alone_wakes_to_sync(monkeypatch, tmp_path):
    log = _start(monkeypatch, tmp_path, [])
    start = log.index(("fleet", "start", None))
    asleep = {name for name, method, weights in log[:start] if method == "offload" and weights}
    assert asleep == {"actor", "critic", "reference"}
    assert log[start:] == [
        ("fleet", "start", None),
        ("fleet", "set_resync", None),  # a restarted server is re-synced with the actor woken (memory cycle)
        ("fleet", "release", ("kv_cache", "cuda_graph", "weights")),  # before any engine comes back
        ("actor", "onload", None),
        ("actor", "offload", False),  # the actor keeps only its weights for the sync
        ("fleet", "resume", ("weights",)),
        ("fleet", "sync", 0),
        ("actor", "offload", True),
        ("fleet", "resume", ("kv_cache", "cuda_graph")),
        # The re-sync the fleet asks the driver for: the same turn as the first sync, at the current version.
        ("later", "resync", [("fleet", "release", ("kv_cache", "cuda_graph", "weights")), ("actor", "onload", None),
                             ("actor", "offload", False), ("fleet", "resume", ("weights",)), ("fleet", "sync", 3),
                             ("actor", "offload", True), ("fleet", "resume", ("kv_cache", "cuda_graph"))]),
    ]


@pytest.mark.parametrize("override", ["placement.offload=false"])
def test_without_the_sleep_wake_cycle_nothing_moves(monkeypatch, tmp_path, override):
    log = _start(monkeypatch, tmp_path, [override])
    assert log == [("fleet", "start", None), ("fleet", "sync", 0)]
