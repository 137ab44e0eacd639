"""How the suite splits over two pytest-xdist workers (`-n 2 --dist loadgroup`, see tests/README.md).

`--dist loadgroup` hands a worker one group at a time and never splits a group. Every test gets one:
- the tests that share a run built once per session (a session fixture defined here, such as
  `warmed_quickstart`, `grpo_reference`, `ppo_reference`, `slurm`, or a cached job of `_engine_jobs`)
  are one group with every module they sit in, so the run is built once, not once per worker;
- every other test is grouped by its module, so a module's fixtures are built once too.
The groups are handed out heaviest first (xdist keeps the order we collect in once its own reordering,
by number of tests, is off): the last group a worker starts is then a small one, and a worker is not
left alone with a 9-minute test at the end.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Session fixtures cheap enough for each worker to build its own (seconds): grouping their users would put
# half the suite in one group.
PER_WORKER = {"ray_session", "tokenizer"}
# Session runs built once per test run across the workers (a file lock in the run's shared temp root,
# tests/conftest.py): their users need no common group. The warm-up's users are the four heaviest modules
# (about 1,100 s in all): one group would be most of one stream.
ACROSS_WORKERS = {"warmed_quickstart"}
# Seconds each module took in the serial suite (clean-clone CI of 2026-12-01, a quiet 2-core machine, to 5 s;
# test_e2e_preemption and test_e2e_async re-estimated 2026-12-02 for their new runs); only their order matters. A module not listed: 20 s if it has a slow or e2e test, plus 0.2 s a test.
MODULE_SECONDS = {
    "test_e2e_reward_model": 540, "test_slurm": 236, "test_e2e_ppo": 211, "test_e2e_preemption": 280,
    "test_e2e_lora": 175, "test_e2e_resume": 215, "test_e2e_quickstart": 165, "test_weightsync_transports": 111,
    "test_robust_inputs": 91, "test_cpu_engine_strict": 85, "test_cpu_engine_bounds": 80, "test_e2e_async": 85,
    "test_fleet": 70, "test_cpu_engine_robust": 70, "test_engine_forward": 67, "test_launch_local": 65,
    "test_weightsync_multiserver": 55, "test_e2e_disk_full": 50, "test_cpu_engine": 36,
    "test_checkpoint": 36, "test_robust_recipe_values": 35, "test_rm_export": 35, "test_e2e_agent": 35,
    "test_lora_checkpoint": 30, "test_job_script": 30, "test_engine_critic": 30, "test_router": 25,
    "test_lora_weight_sync": 25, "test_weightsync_session": 20, "test_examples": 20, "test_engine_reward_model": 20,
    "test_engine_moe": 20, "test_train_rm": 15, "test_sync_buffers": 15, "test_rollout_client": 15,
    "test_plan_bytes": 15, "test_lora_engine": 15, "test_cli_export": 15, "test_cpu_engine_kv_pool": 20,
    "test_preemption": 10, "test_lora_moe": 10, "test_leftovers": 10, "test_export": 10, "test_engine_offload": 10,
    "test_engine_actor": 10, "test_cpu_engine_lora": 10, "test_cli_validate": 10,
}


def _shared_runs(item: pytest.Item) -> set[str]:
    """The runs built once per session that `item` reads."""
    shared = set()
    for name, definitions in item._fixtureinfo.name2fixturedefs.items():
        fixture = definitions[-1]
        if (fixture.scope == "session" and name not in PER_WORKER | ACROSS_WORKERS
                and TESTS in Path(inspect.getfile(fixture.func)).resolve().parents):
            shared.add(name)
    # `_engine_jobs` runs its jobs once per process (functools.cache): the modules that import one share it.
    for value in vars(getattr(item, "module", None) or object()).values():
        if getattr(value, "__module__", None) == "_engine_jobs" and hasattr(value, "cache_info"):
            shared.add(value.__name__)
    return shared


def _estimate(module: str, items: list[pytest.Item]) -> float:
    if module in MODULE_SECONDS:
        return MODULE_SECONDS[module]
    slow = any(item.get_closest_marker(tier) for item in items for tier in ("slow", "e2e"))
    return 20.0 * slow + 0.2 * len(items)


def group_and_order(items: list[pytest.Item]) -> dict[str, float]:
    """Mark each item with its `xdist_group` and sort `items` heaviest group first (in place, the order within a
    group kept); returns each group's estimated seconds."""
    # Union-find over modules: two modules that read the same shared run are one group.
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    modules: dict[str, list[pytest.Item]] = {}
    for item in items:
        module = item.path.stem
        modules.setdefault(module, []).append(item)
        for run in _shared_runs(item):
            parent[root(f"run:{run}")] = root(module)
    groups: dict[str, list[str]] = {}
    for module in modules:
        groups.setdefault(root(module), []).append(module)
    names, seconds = {}, {}
    for members in groups.values():
        runs = sorted(key[4:] for key in parent if key.startswith("run:") and root(key) == root(members[0]))
        name = "+".join(runs) if runs else members[0]
        seconds[name] = sum(_estimate(module, modules[module]) for module in members)
        names.update(dict.fromkeys(members, name))
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        item.add_marker(pytest.mark.xdist_group(names[item.path.stem]))
        first.setdefault(names[item.path.stem], index)
    position = {id(item): index for index, item in enumerate(items)}
    # In a group, the tests that read a run shared across workers go last: by then the other worker,
    # which may be building it, has likely finished (no module that has them holds a module fixture).
    later = {id(item) for item in items if ACROSS_WORKERS & set(item.fixturenames)}
    items.sort(key=lambda item: (-seconds[names[item.path.stem]], first[names[item.path.stem]],
                                 id(item) in later, position[id(item)]))
    return seconds
