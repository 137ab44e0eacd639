"""The rendered job script, run under stand-ins for Slurm's commands (tests/_job_shims.py): bring-up, the
driver, stop requests, preemption, requeue and teardown, compared call by call with golden lists.

The Ray node steps run the script's own `megarl_ray_node` (shield, retries, sweep), so what a node does when
Slurm signals its step is the real thing; tests/test_slurm.py runs the same script on a real two-node Slurm.
"""

from __future__ import annotations

import json
import signal

import pytest

from _job_shims import JOB_ID, Job, facts, golden_calls, kill_leftovers, nodes_named, normalise_tmp


@pytest.fixture
def job_factory(tmp_path, capsys):
    jobs = []

    def start(nodes: int, **kwargs) -> Job:
        job = Job(tmp_path, capsys, nodes, **kwargs)
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        kill_leftovers(job)


def _record(job: Job) -> list[dict]:
    path = job.run_dir / "slurm" / f"job-{JOB_ID}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_job_script_brings_up_runs_and_tears_down(job_factory, tmp_path, nodes):
    job = job_factory(nodes)
    status, output = job.finish()
    assert status == 0, output
    golden = golden_calls(job.nodes)
    assert normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["driver"] + golden["teardown"]
    assert "driver exited with status 0\n" in output and "torn down; exit status 0" in output
    assert [(start["restart"], start["status"], start["requeued"]) for start in _record(job)] == [(0, 0, False)]
    for node in job.nodes:  # every node ran shielded Ray once, and its teardown stopped it
        log = job.node_log(node)
        assert f"ray start on {node} (try 1)" in log and "stopped (status 0)" in log, log
        assert "python -m megarl.processes shield" in log and "python -m megarl.processes sweep" in log


def test_sigterm_goes_to_the_driver_then_everything_stops(job_factory, tmp_path):
    job = job_factory(2, driver="hang")
    job.wait_for(lambda: (job.dir / "driver.started").exists(), "the driver never started")
    job.process.send_signal(signal.SIGTERM)
    status, output = job.finish()
    assert status == 99, output  # the driver's own exit status is the job's
    golden = golden_calls(job.nodes)
    assert normalise_tmp(job.calls(), tmp_path) == (
        golden["bring_up"] + golden["driver"] + ["driver: SIGTERM"] + golden["teardown"]
    )
    assert "SIGTERM: forwarded to the driver" in output and "driver exited with status 99 after SIGTERM" in output
    assert _record(job)[-1]["requeued"] is False  # 99 is no stop with a checkpoint


@pytest.mark.parametrize("requeue", [True, False])
def test_a_preemption_keeps_ray_up_tells_the_driver_once_and_requeues(job_factory, tmp_path, requeue):
    job = job_factory(2, driver="preemptible", extra=("--requeue",) if requeue else ())
    job.wait_for(lambda: (job.dir / "driver.started").exists(), "the driver never started")
    # Slurm preempts with a grace time: SIGTERM to every process of every step, Ray's included.
    job.signal_steps(signal.SIGTERM)
    status, output = job.finish()
    assert status == 75, output
    golden = golden_calls(job.nodes)
    calls = normalise_tmp(job.calls(), tmp_path)
    # Each node's shell told the batch script; the driver got exactly one SIGTERM.
    told = [call for call in calls if call == f"scancel --batch --signal=USR1 {JOB_ID}"]
    assert len(told) == 2 and calls.count("driver: SIGTERM") == 1, calls
    after_driver = [call for call in calls[len(golden["bring_up"]) + 1:] if call not in told]
    requeued = [f"scontrol requeue {JOB_ID}"] if requeue else []
    assert after_driver == ["driver: SIGTERM"] + golden["teardown"] + requeued
    for node in job.nodes:  # Ray outlived the SIGTERM: each node started once and was stopped by the teardown
        log = job.node_log(node)
        assert "SIGTERM from Slurm; telling the batch script" in log and "stopped (status 0)" in log, log
        assert "(try 2)" not in log
    assert output.count("forwarded to the driver") == 1, output
    assert [(start["status"], start["requeued"]) for start in _record(job)] == [(75, requeue)]


def test_sigterm_before_the_driver_tears_down_the_bring_up_and_requeues(job_factory, tmp_path):
    job = job_factory(2, registration="hang", extra=("--requeue",))
    job.wait_for_call("--nodes 2 --device cuda --per-node 8 --hosts node001 node002")  # the wait for all nodes
    job.process.send_signal(signal.SIGTERM)
    status, output = job.finish()
    assert status == 143, output
    golden = golden_calls(job.nodes)
    assert normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["teardown"] + [
        f"scontrol requeue {JOB_ID}"]
    assert "SIGTERM before the driver started" in output and "stopping a bring-up step" in output


def test_a_cancelled_job_does_not_requeue(job_factory, tmp_path):
    job = job_factory(1, driver="preemptible", extra=("--requeue",))
    job.wait_for(lambda: (job.dir / "driver.started").exists(), "the driver never started")
    (job.run_dir / "slurm").mkdir(exist_ok=True)
    (job.run_dir / "slurm" / f"cancel-{JOB_ID}").write_text("")  # what `megarl submit --cancel` leaves
    job.process.send_signal(signal.SIGTERM)
    status, _ = job.finish()
    assert status == 75 and not [call for call in job.calls() if "requeue" in call]
    assert _record(job)[-1]["requeued"] is False


def test_a_finished_run_is_not_started_again(job_factory, tmp_path):
    job_dir = tmp_path / "runs" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2" / "slurm"
    job_dir.mkdir(parents=True)
    (job_dir / f"job-{JOB_ID}.jsonl").write_text(json.dumps({"job": str(JOB_ID), "restart": 0, "status": 0}) + "\n")
    job = job_factory(2)
    status, output = job.finish()
    assert status == 0 and "an earlier start of this job finished the run: nothing to do" in output
    assert normalise_tmp(job.calls(), tmp_path) == ["scontrol show hostnames node[001-002]"]


def test_workers_that_never_register_fail_the_job_and_stop_ray(job_factory, tmp_path):
    job = job_factory(2, registration="fail", extra=("--requeue",))
    status, output = job.finish()
    assert status == 1, output
    golden = golden_calls(job.nodes)
    assert normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["teardown"]  # and no requeue
    assert "1 of 2 node(s) registered" in output


def test_a_failed_ray_start_is_tried_again(job_factory):
    job = job_factory(2, ray="fail-once")
    status, output = job.finish()
    assert status == 0, output
    for node in job.nodes:
        log = job.node_log(node)
        assert "exited with status 1 during start-up: trying again" in log and ", try 2: ray start" in log, log
        assert "Killed" not in log


def test_preflight_names_the_node_that_differs_and_starts_no_ray(job_factory):
    job = job_factory(2, facts_text=facts(nodes_named(2), node002={"torch": "2.5.1"}))
    status, output = job.finish()
    assert status == 1, output
    assert "preflight: node node002: torch 2.5.1 differs from node001's 2.4.0" in output
    assert not [call for call in job.calls() if "megarl_ray_node" in call or "megarl train" in call]


def test_a_pyxis_job_runs_every_step_and_the_driver_in_the_container(job_factory, tmp_path):
    job = job_factory(2, driver="hang", extra=("--container-image", "nvcr.io/nvidia/pytorch:24.09-py3"))
    job.wait_for(lambda: (job.dir / "driver.started").exists(), "the driver never started")
    job.process.send_signal(signal.SIGTERM)  # the time-limit warning: to the driver step through scancel
    status, output = job.finish()
    assert status == 99, output
    calls = normalise_tmp(job.calls(), tmp_path)
    sruns = [call for call in calls if call.startswith("srun ")]
    assert sruns and all("--container-image=nvcr.io/nvidia/pytorch:24.09-py3" in call for call in sruns), sruns
    assert all("--container-name=megarl-grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2" in call for call in sruns)
    driver = [call for call in sruns if "megarl train" in call]
    assert len(driver) == 1 and "--job-name=megarl-driver" in driver[0] and "--gres=none" in driver[0]
    assert f"scancel --signal=TERM {JOB_ID}.megarl-driver" in calls and "driver: SIGTERM" in calls
    # Python in the batch script goes through a helper step on the head node: no host Python is needed.
    check = [call for call in sruns if call.endswith("PY -m megarl.submit.preflight check --nodes node001 node002 "
                                                      "--device cuda --gpus-per-node 8")]
    assert len(check) == 1 and "--gres=none" in check[0] and "--nodelist=node001" in check[0], sruns
