"""Shared test fixtures: one Ray cluster per test session, the in-repo tokenizer, the warmed-up quickstart
model, a CPU-only environment.

Ray is started lazily by the `ray_session` fixture the first time a test asks
for it, on loopback with a private temp dir, and stopped by PID (through
`ray.shutdown`) when the session ends. A module's CPU-engine servers come from
`cpu_engine`, the tiny models they serve from `tests/_tiny.py`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Multi-process tests on 2 cores swing wildly without this (step times 60x apart).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray's log monitor rescans its logs directory 10 times a second while it holds fewer than this many files
# (ray/_private/log_monitor.py), then every LOG_NAME_UPDATE_INTERVAL_S (0.5 s): the suite's Ray sessions start
# hundreds of workers, and the rescans cost each monitor ~3.5% of a core by the end (measured: 2.1 CPU s a
# minute with 126 log files, 1.1 at 0.5 s). Every run in this process and its subprocesses inherits it.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test of the session."""
    import ray

    from megarl.cluster.ray_cluster import new_temp_dir, start_local_ray

    tmp = new_temp_dir()
    start_local_ray(temp_dir=tmp, num_cpus=4)
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tokenizer():
    """The in-repo ("builtin") tokenizer, loaded once per session (tests only read it)."""
    from megarl.data.tokenizer import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="module")
def cpu_engine(tmp_path_factory):
    """Starts the module's CPU-engine servers: `cpu_engine(model_dir, **options)` is `start_cpu_engine`'s
    handle (healthy), with its log in a temp dir unless `log_path` is given; every server started is stopped
    when the module ends, and its process is seen to exit. The servers are forked from the session's forkserver
    (`_server_fork`) unless `spawn` says otherwise (`spawn_server`: a fresh process)."""
    from _server_fork import fork_server
    from megarl.rollout.server import start_cpu_engine

    logs = tmp_path_factory.mktemp("cpu_engine_logs")
    handles = []

    def start(model_dir, **options):
        options.setdefault("log_path", logs / f"server-{len(handles)}.log")
        options.setdefault("spawn", fork_server)
        handles.append(start_cpu_engine(model_dir, **options))
        return handles[-1]

    yield start
    for handle in handles:
        handle.stop()
    assert all(handle.process.poll() is not None for handle in handles)


@pytest.fixture(scope="session")
def warmed_quickstart(ray_session, tmp_path_factory) -> Path:
    """The quickstart model after the recipe's own supervised warm-up (`megarl warmup`), as an HF checkpoint dir,
    made once per session. The learning tests start RL from it (`model.path`, `sft_warmup.steps=0`), which is
    where their recipes' own warm-up would leave them: the GRPO, PPO and reward-model quickstarts share one
    model, one data set and one `sft_warmup`."""
    from filelock import FileLock

    from megarl.commands.warmup import warm_up
    from megarl.config import load_recipe

    # Made once per test run, also with two xdist workers: the first worker to ask builds it in the run's
    # shared temp root under a file lock, the other waits and reads the same directory. Its users can then
    # sit in different xdist groups (tests/_groups.py), which balances the two streams.
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's basetemp lies in the run's one root
    root, done = shared / "warmed", shared / "warmed.done"
    with FileLock(str(shared / "warmed.lock")):
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)  # what a worker that died while building left
            recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml",
                                 [f"trainer.output_dir={root}", "trainer.logging.console=false"])
            done.write_text(str(warm_up(recipe, root / "hf")))
    return Path(done.read_text())


@pytest.fixture(scope="session")
def grpo_reference(ray_session, tmp_path_factory):
    """The shortened GRPO quickstart (tests/_e2e.py), run once per session: the contract test checks it,
    the resume test resumes its copy; its command lines are watched for its API key."""
    import _e2e

    return _e2e.reference_run("quickstart-grpo-cpu.yaml", _e2e.GRPO, tmp_path_factory.mktemp("grpo_reference"),
                              watch=True)


@pytest.fixture(scope="session")
def ppo_reference(ray_session, tmp_path_factory):
    """The shortened PPO quickstart with both KL options (tests/_e2e.py), run once per session."""
    import _e2e

    return _e2e.reference_run("quickstart-ppo-cpu.yaml", _e2e.PPO, tmp_path_factory.mktemp("ppo_reference"))


def pytest_configure(config):
    # Under xdist, hand the groups out in our order (heaviest first, tests/_groups.py), not by number of tests.
    if config.pluginmanager.hasplugin("xdist"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # On an xdist worker (`-n 2 --dist loadgroup`): before xdist reads the groups (tests/_groups.py).
    if hasattr(config, "workerinput"):
        import _groups

        _groups.group_and_order(items)

    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        # The marker itself: `"gpu" in item.keywords` also matches a directory named gpu.
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    # Exit 5 (nothing collected) must never read as success in CI.
    if exitstatus == 5:
        session.exitstatus = 1
