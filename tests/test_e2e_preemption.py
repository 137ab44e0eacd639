"""End to end: `megarl train` as its own process, stopped by SIGTERM, by Ctrl-C and by SIGKILL, then resumed.

One run directory goes through four lives:
1. SIGTERM to the driver's whole process group (what a shell's job control, a container runtime
   or Slurm's step signalling send) while step 2 generates: the step is abandoned, the state after
   step 1 is checkpointed, exit status 75 within the stop budget. Ray's processes, in a session of
   their own, outlive the signal until the driver has saved and stops them.
2. Resumed; SIGINT to the whole process group (a Ctrl-C in a terminal) while step 3
   updates the actor: the step is finished and checkpointed, exit status 75. Ray's workers
   get the SIGINT too and must survive it until the driver has saved.
3. Resumed; SIGKILL while the checkpoint of step 4 is being written: the previous
   checkpoint stays complete, the half-written one has no marker.
4. Resumed and run to its end: the half-written checkpoint is removed, step 4 is redone, exit
   status 0, and the finished run leaves no Ray temp dir (every run used to leave one; the life
   has a TMPDIR of its own, which tells its dirs from other runs').
After each life no process the run started is left (the multiprocessing children of Ray's
workers included), and no shared-memory file of theirs.
The same under asynchronous rollout (`recipes/quickstart-async-cpu.yaml`, k = 1): SIGTERM while step 2
updates the actor, with step 3's batch already generating; the checkpoint keeps what was trained, and the
resumed run generates the rest afresh.
"""

from __future__ import annotations

import json
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from megarl.controller.checkpointing import MARKER
from megarl.controller.preemption import EXIT_PREEMPTED

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart-grpo-cpu.yaml"
REPO = Path(__file__).resolve().parents[1]
PREEMPT_TIMEOUT_S = 120  # the stop budget: a stopped run checkpoints and exits within it
# One request at a time per server: generation takes long enough to be caught in the act.
SETTINGS = ["trainer.total_steps=4", "trainer.val_every=0", "sft_warmup.steps=5", "sft_warmup.batch_size=32",
            "data.synthetic.num_val=16", "data.train_batch_size=8", "rollout.n=4", "rollout.max_concurrency=1",
            "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=8", "actor.entropy_coeff=0.01",
            "trainer.checkpoint.save_every=0", "trainer.checkpoint.keep_last=0", "trainer.logging.console=false",
            f"trainer.checkpoint.preempt_timeout_s={PREEMPT_TIMEOUT_S}"]
# Asynchronous rollout (k = 1, disaggregated: a trainer slot and a rollout slot), three short steps.
ASYNC_RECIPE = REPO / "recipes" / "quickstart-async-cpu.yaml"
ASYNC_SETTINGS = ["trainer.total_steps=3", "trainer.val_every=0", "trainer.val_before_train=false",
                  "sft_warmup.steps=0", "data.synthetic.num_val=16", "data.train_batch_size=8",
                  "data.max_response_length=24", "actor.entropy_coeff=0.01", "actor.ppo_mini_batch_size=32",
                  "actor.ppo_micro_batch_size=16", "trainer.checkpoint.save_every=0", "trainer.checkpoint.keep_last=0",
                  "trainer.logging.console=false",
                  f"trainer.checkpoint.preempt_timeout_s={PREEMPT_TIMEOUT_S}"]
TORCH_SHM = re.compile(r"torch_(\d+)_")
RECORD_EVERY_S = 0.25


class Driver:
    """A `megarl train` process in its own session; remembers every process it ever had below it."""

    def __init__(self, output_dir: Path, log: Path, env: dict[str, str] | None = None, recipe: Path = RECIPE,
                 settings: list[str] = SETTINGS):
        args = [sys.executable, "-m", "megarl.cli", "train", str(recipe), "--set", f"trainer.output_dir={output_dir}",
                "--set", "name=run"]
        for setting in settings:
            args += ["--set", setting]
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
        self.log = log
        self.shm_before = set(os.listdir("/dev/shm"))
        self.process = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        self.pids = {self.process.pid}

    def watch(self, until, timeout_s: float = 300.0) -> None:
        """Poll until `until()` is true, recording descendants meanwhile; fail if the driver exits first.
        `until` is checked every 10 ms (the signal must land inside a phase); the descendants only every
        RECORD_EVERY_S, because a scan reads every process's /proc entry (~10 ms with the suite's other
        stream running, so scanning at 100 Hz took half a core): a process that stays is seen by a later scan,
        and Ray's daemons outlive the `ray start` they are reparented from by far longer than that."""
        deadline = time.monotonic() + timeout_s
        recorded = 0.0
        while not until():
            if time.monotonic() - recorded >= RECORD_EVERY_S:
                self._record()
                recorded = time.monotonic()
            assert self.process.poll() is None, f"driver exited with {self.process.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"timed out; driver output:\n{self.output()}"
            time.sleep(0.01)
        self._record()

    def _record(self) -> None:
        try:
            self.pids |= {child.pid for child in psutil.Process(self.process.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass

    def wait(self, timeout_s: float = 300.0) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"driver did not exit within {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def leftovers(self, grace_s: float = 30.0) -> tuple[list[str], list[str]]:
        """(processes of the run still alive after `grace_s`, its new /dev/shm files)."""
        deadline = time.monotonic() + grace_s
        alive = []
        while time.monotonic() < deadline:
            alive = [f"{pid} {_describe(pid)}" for pid in sorted(self.pids) if _alive(pid)]
            if not alive:
                break
            time.sleep(0.5)
        shm = [name for name in set(os.listdir("/dev/shm")) - self.shm_before
               if (match := TORCH_SHM.match(name)) and int(match.group(1)) in self.pids]
        return alive, shm

    @contextmanager
    def leaves_nothing(self):
        """Around a life: on the way out, whatever happened, what is left of the run is killed; if the life ended
        normally, nothing may have been left (`leftovers`)."""
        try:
            yield
        finally:
            alive, shm = self.leftovers()
            self.kill_leftovers()
        assert not alive and not shm, (alive, shm)

    def kill_leftovers(self, *, remove_shm: bool = True) -> list[str]:
        """SIGKILL what is left of the run; its shared memory, which nothing can unlink then, is removed too
        unless `remove_shm` is false (the next start of the run directory must remove it): returns those names."""
        for pid in self.pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        segments = [name for name in set(os.listdir("/dev/shm")) - self.shm_before
                    if (match := TORCH_SHM.match(name)) and int(match.group(1)) in self.pids]
        if remove_shm:
            for name in segments:
                os.unlink(f"/dev/shm/{name}")
        return segments


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:160]
    except psutil.Error:
        return "?"


def _phase_started(run_dir: Path, step: int, phase: str):
    log = run_dir / "logs" / "controller.log"
    return lambda: log.exists() and f"step {step}: {phase}\n" in log.read_text()


def _complete_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
                  if (p / MARKER).is_file())


def _steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_sigterm_ctrl_c_and_sigkill_each_leave_a_resumable_run(tmp_path):
    run_dir = tmp_path / "run"

    # 1. SIGTERM to the driver's process group while step 2 generates.
    driver = Driver(tmp_path, tmp_path / "life1.log")
    with driver.leaves_nothing():
        driver.watch(_phase_started(run_dir, 2, "gen"))
        signalled = time.monotonic()
        os.killpg(driver.process.pid, signal.SIGTERM)
        assert driver.wait() == EXIT_PREEMPTED, driver.output()
        assert time.monotonic() - signalled < PREEMPT_TIMEOUT_S
    controller_log = (run_dir / "logs" / "controller.log").read_text()
    assert "stop requested: step 2 abandoned during gen" in controller_log
    assert "preempted:" in driver.output() and _complete_steps(run_dir) == [1] and _steps_logged(run_dir) == [1]
    state = json.loads((run_dir / "checkpoints" / "step_1" / "controller_state.json").read_text())
    assert state["step"] == 1 and state["loader"]["position"] == 8  # step 2's batch was given back

    # 2. Ctrl-C (SIGINT to the process group: driver and Ray's processes) while step 3 updates the actor.
    driver = Driver(tmp_path, tmp_path / "life2.log")
    with driver.leaves_nothing():
        driver.watch(_phase_started(run_dir, 3, "update_actor"))
        os.killpg(driver.process.pid, signal.SIGINT)
        assert driver.wait() == EXIT_PREEMPTED, driver.output()
    assert "stop requested: step 3 finished" in (run_dir / "logs" / "controller.log").read_text()
    assert _complete_steps(run_dir) == [1, 3] and _steps_logged(run_dir) == [1, 2, 3]

    # 3. SIGKILL while the last checkpoint is being written.
    driver = Driver(tmp_path, tmp_path / "life3.log")
    partial = run_dir / "checkpoints" / ".tmp-step_4"
    try:
        driver.watch(partial.exists)
        driver.process.kill()
        driver.wait()
    finally:
        driver.leftovers(grace_s=10)  # what SIGKILL leaves: Ray's agents are stopped here, their files are not
        life3_segments = driver.kill_leftovers(remove_shm=False)
    assert partial.is_dir() and not (partial / MARKER).exists() and _complete_steps(run_dir) == [1, 3]

    # 4. Resumed from step 3: the torn save is gone, step 4 is redone and logged once; what the killed run left
    #    on this host (its Ray temp dir, its processes' shared memory) is removed by this start. Ray's socket
    #    paths must stay under 108 bytes: the life's own TMPDIR is short.
    life3_temp_dir = json.loads((run_dir / ".footprint.json").read_text())["ray_temp_dir"]
    assert Path(life3_temp_dir).is_dir()
    scratch = Path(tempfile.mkdtemp(prefix="mr", dir="/tmp"))
    driver = Driver(tmp_path, tmp_path / "life4.log", env={"TMPDIR": str(scratch)})
    with driver.leaves_nothing():
        assert driver.wait() == 0, driver.output()
    assert list(scratch.glob("megarl-ray-*")) == []
    shutil.rmtree(scratch, ignore_errors=True)
    assert not Path(life3_temp_dir).exists()
    assert [name for name in life3_segments if os.path.exists(f"/dev/shm/{name}")] == []
    assert not partial.exists() and _complete_steps(run_dir) == [1, 3, 4]
    assert _steps_logged(run_dir) == [1, 2, 3, 4]


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.slow
def test_sigterm_under_asynchronous_rollout_checkpoints_what_was_trained_and_the_resume_generates_the_rest(tmp_path):
    """k = 1: while step 2 updates the actor, the batch of step 3 is already admitted; SIGTERM finishes step 2,
    the checkpoint records batches 0-1 as trained and none of batch 2, and the resumed run generates batch 2 afresh
    and trains it as step 3, once."""
    run_dir = tmp_path / "run"
    driver = Driver(tmp_path, tmp_path / "life1.log", recipe=ASYNC_RECIPE, settings=ASYNC_SETTINGS)
    with driver.leaves_nothing():
        driver.watch(_phase_started(run_dir, 2, "update_actor"))
        os.killpg(driver.process.pid, signal.SIGTERM)
        assert driver.wait() == EXIT_PREEMPTED, driver.output()
    assert "stop requested: step 2 finished" in (run_dir / "logs" / "controller.log").read_text()
    assert _complete_steps(run_dir) == [2] and _steps_logged(run_dir) == [1, 2]
    state = json.loads((run_dir / "checkpoints" / "step_2" / "controller_state.json").read_text())
    # The loader goes back to the first untrained batch (2 of 8 prompts each): nothing of it was trained.
    assert state["step"] == 2 and state["loader"]["position"] == 16
    assert state["async"]["next_batch"] == 2 and state["async"]["trained"] == {}

    driver = Driver(tmp_path, tmp_path / "life2.log", recipe=ASYNC_RECIPE, settings=ASYNC_SETTINGS)
    with driver.leaves_nothing():
        assert driver.wait() == 0, driver.output()
    assert _complete_steps(run_dir) == [2, 3] and _steps_logged(run_dir) == [1, 2, 3]
    final = json.loads((run_dir / "checkpoints" / "step_3" / "controller_state.json").read_text())
    assert final["step"] == 3 and final["async"]["next_batch"] == 3
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["async/staleness/max"] == 0  # batch 2 generated afresh under the restored weights

