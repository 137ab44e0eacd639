"""megarl submit on a real single-node Slurm (tests/_slurm.py): a quickstart job, a preemption, a preflight failure.

The jobs run the CPU quickstart cut to a few steps (no warm-up, little
validation), so each takes about a minute and a half on 2 busy cores. Where
Slurm cannot be installed or started (not root, no apt-get) every test here
skips with the reason.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from _slurm import SlurmUnavailable, start_slurm
from megarl.cluster.ray_ports import free_block

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"
# A few steps of the quickstart: no warm-up, a small generated data set, one small validation.
SHORT = ["sft_warmup.steps=0", "data.synthetic.num_train=256", "data.synthetic.num_val=16",
         "trainer.val_before_train=false", "trainer.logging.console=false"]
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")
CONTRACT_KEYS = ["critic/score/mean", "critic/advantages/mean", "actor/pg_loss", "actor/entropy",
                 "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/update_weights",
                 "timing_s/step", "perf/throughput", "rollout/logprob_diff"]


@pytest.fixture(scope="session")
def slurm():
    try:
        cluster = start_slurm()
    except SlurmUnavailable as reason:
        pytest.skip(f"no Slurm: {reason}")
    yield cluster
    cluster.stop()


def _megarl(cluster, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl", *map(str, args)], capture_output=True, text=True,
                          env=cluster.env, cwd=cwd, timeout=120)


def _submit(cluster, tmp_path: Path, name: str, *overrides: str, extra: tuple[str, ...] = ()) -> SimpleNamespace:
    sets = [f"trainer.output_dir={tmp_path / 'runs'}", f"name={name}", *SHORT, *overrides]
    argv = ["submit", QUICKSTART, "--nodes", "1", *extra, *(arg for item in sets for arg in ("--set", item))]
    submitted = _megarl(cluster, *argv, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[2]
    cluster.jobs.append(job_id)
    run_dir = tmp_path / "runs" / name
    return SimpleNamespace(argv=argv, job_id=job_id, run_dir=run_dir, log=run_dir / "logs" / f"slurm-{job_id}.out")


def _status(cluster, run) -> str:
    shown = _megarl(cluster, "submit", "--status", run.run_dir, cwd=run.run_dir)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def _wait_until_done(cluster, run, timeout_s: float = 420) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(cluster, run)
        state = status.split()[2].rstrip(",")
        if state not in ACTIVE:
            return status
        assert time.monotonic() < deadline, f"job {run.job_id} still {state} after {timeout_s} s:\n{_tail(run.log)}"
        time.sleep(3)


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else f"({path} missing)"


def _job_processes(job_id: str) -> list[str]:
    """Command lines of processes still carrying the job's id in their environment."""
    marker = f"SLURM_JOB_ID={job_id}\0".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue  # exited while we looked, or not ours to read
    return found


def _assert_torn_down(cluster, run) -> None:
    log = run.log.read_text()
    assert "torn down; exit status" in log, _tail(run.log)
    assert not Path(f"/tmp/megarl-ray-{run.job_id}").exists()  # every node removed its Ray temp dir
    assert (run.run_dir / "logs" / f"ray-{cluster.node}" / "raylet.out").exists()  # and kept Ray's logs
    assert f"ray head on {cluster.node} stopped" in (run.run_dir / "logs" / f"ray-head-{cluster.node}.log").read_text()
    assert _job_processes(run.job_id) == []


def test_quickstart_job_runs_to_completion(slurm, tmp_path):
    run = _submit(slurm, tmp_path, "slurm-quickstart", "trainer.total_steps=2", "trainer.val_every=2")
    # Submitting the same run again while its job is queued or running is refused, naming the job.
    again = _megarl(slurm, *run.argv, cwd=tmp_path)
    assert again.returncode == 2 and f"job {run.job_id} of this run is still" in again.stderr, again.stderr

    status = _wait_until_done(slurm, run)
    assert status.startswith(f"job {run.job_id}: COMPLETED, on {slurm.node}"), status + _tail(run.log)
    assert "exit code 0:0" in status and "last metrics: step 2: critic/score/mean" in status, status

    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "timing_s/step" in record]
    assert [record["step"] for record in steps] == [1, 2]
    for record in steps:
        assert not [key for key in CONTRACT_KEYS if key not in record], record
        assert record["rollout/logprob_diff"] < 1e-4  # weights reached the engine through the job's Ray
    assert "val/score/mean" in steps[-1]

    log = run.log.read_text()
    assert "preflight: 1 node(s) agree" in log
    assert f"1 node(s) registered with 1 CPU each: {slurm.node}" in log
    assert "driver exited with status 0\n" in log
    assert (run.run_dir / "slurm" / "megarl.sbatch").read_text().startswith("#!/bin/bash")
    _assert_torn_down(slurm, run)


@pytest.fixture(scope="module")
def preempted(slurm, tmp_path_factory):
    """A long quickstart job stopped after its first step by `megarl submit --cancel` (SIGTERM to the batch script)."""
    tmp_path = tmp_path_factory.mktemp("preempted")
    run = _submit(slurm, tmp_path, "slurm-preempted", "trainer.total_steps=200", "trainer.val_every=0")
    metrics, deadline = run.run_dir / "metrics.jsonl", time.monotonic() + 420
    while not (metrics.exists() and '"timing_s/step"' in metrics.read_text()):
        assert time.monotonic() < deadline, f"no step after 420 s:\n{_tail(run.log)}"
        time.sleep(3)
    # What Slurm sends at --signal=B:TERM@<lead> before the time limit: SIGTERM to the batch script only.
    # (A plain `scancel --signal=TERM` signals the job steps, i.e. the Ray processes, not the script.)
    run.cancel = _megarl(slurm, "submit", "--cancel", run.run_dir, cwd=tmp_path)
    run.status = _wait_until_done(slurm, run, timeout_s=300)
    return run


def test_preempted_job_forwards_sigterm_to_the_driver_and_tears_down(slurm, preempted):
    assert preempted.cancel.returncode == 0, preempted.cancel.stderr
    assert f"job {preempted.job_id}: sent SIGTERM to its batch script" in preempted.cancel.stdout
    log = preempted.log.read_text()
    assert "SIGTERM: forwarded to the driver" in log, _tail(preempted.log)
    assert "after SIGTERM" in log.split("SIGTERM: forwarded to the driver")[1]
    _assert_torn_down(slurm, preempted)


def test_preempted_job_checkpointed_and_exited_cleanly(preempted):
    checkpoints = sorted((preempted.run_dir / "checkpoints").glob("step_*"))
    assert checkpoints, f"no checkpoint after SIGTERM:\n{_tail(preempted.log)}"
    step = int(checkpoints[-1].name.removeprefix("step_"))
    assert 1 <= step < 200 and (checkpoints[-1] / "actor" / "megarl_checkpoint.json").exists()
    driver_status = int(preempted.log.read_text().split("driver exited with status ")[1].split()[0])
    # Issue 11: a distinct exit status, neither success, a failure, nor death by a signal (134, 137, 143).
    assert driver_status not in (0, 1, 2) and driver_status < 128, driver_status
    assert "Traceback" not in preempted.log.read_text()


def test_preflight_stops_a_job_whose_ray_port_is_taken(slurm, tmp_path):
    ports = free_block(os.getpid())
    with socket.socket() as squatter:
        squatter.bind(("", ports.base))
        squatter.listen()
        run = _submit(slurm, tmp_path, "slurm-port-taken", "trainer.total_steps=1",
                      extra=("--env", f"MEGARL_RAY_PORT_BASE={ports.base}"))
        status = _wait_until_done(slurm, run, timeout_s=120)
    assert status.startswith(f"job {run.job_id}: FAILED") and "exit code 1:0" in status, status
    log = run.log.read_text()
    assert (f"preflight: node {slurm.node}: 1 port(s) of this job's Ray port block are in use: {ports.base} (gcs)"
            in log), _tail(run.log)
    assert not list((run.run_dir / "logs").glob("ray-*"))  # no Ray was started
    assert _job_processes(run.job_id) == []
