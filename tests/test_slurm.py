"""megarl submit on a real two-node Slurm (tests/_slurm.py): two hosts in network namespaces, each with its own
address and a hostname that resolves to 127.0.1.1, as under Debian's default /etc/hosts.

One job carries the tier (its starts take most of the time, so every test reads the same job): the CPU
quickstart, cut to six short steps, with the actor on one host and the rollout server on the other (a
weight-update group between them, over gloo), submitted with --requeue. Once its first step is logged a job
on a higher-priority partition preempts it (PreemptMode=REQUEUE with a grace time): Slurm signals every
process of the job's steps, Ray stays up, the driver checkpoints and exits with 75, the job requeues itself
and its second start, under the same job id, resumes and finishes. A second, one-node job fails preflight on a port
taken on its node. Where Slurm cannot be installed or started (not root, no apt-get) every test here skips
with the reason.
"""

from __future__ import annotations

import json
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
# A few small steps of the quickstart, no warm-up or validation; the actor and the rollout server on pools of
# one process slot each, on two nodes of one slot: one on each host.
SHORT = ["sft_warmup.steps=0", "data.synthetic.num_train=256", "data.synthetic.num_val=16",
         "trainer.val_before_train=false", "trainer.val_every=0", "trainer.logging.console=false",
         "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size=8"]
TWO_HOSTS = ["placement.nodes=2", "placement.colocate=false",
             "placement.pools={train: {nodes: 1, gpus_per_node: 1}, gen: {nodes: 1, gpus_per_node: 1}}",
             "placement.roles={actor: train, rollout: gen}", "weight_sync.transport=distributed", "rollout.host=node",
             "trainer.checkpoint.preempt_timeout_s=30"]
# A step takes a second or two. With 6 steps, a fast 2-core machine (2026-12-03) finished the run 13 s after the
# preemption's SIGTERM arrived (the last phase ran to its end), exit 0, so Slurm had nothing to requeue: 12 keep
# the preemption well inside the run.
TOTAL_STEPS = 12
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")
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
    # In the controller's namespace: where sbatch reaches slurmctld.
    return subprocess.run(cluster.client(sys.executable, "-m", "megarl", *map(str, args)), capture_output=True,
                          text=True, env=cluster.env, cwd=cwd, timeout=180)


def _submit(cluster, tmp_path: Path, name: str, *overrides: str, extra: tuple[str, ...] = ()) -> SimpleNamespace:
    sets = [f"trainer.output_dir={tmp_path / 'runs'}", f"name={name}", *SHORT, *overrides]
    argv = ["submit", QUICKSTART, *extra, *(arg for item in sets for arg in ("--set", item))]
    submitted = _megarl(cluster, *argv, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    job_id = next(line for line in submitted.stdout.splitlines() if line.startswith("submitted job")).split()[2]
    cluster.jobs.append(job_id)
    run_dir = tmp_path / "runs" / name
    return SimpleNamespace(argv=argv, job_id=job_id, run_dir=run_dir, log=run_dir / "logs" / f"slurm-{job_id}.out",
                           submitted=submitted.stdout)


def _status(cluster, run) -> str:
    shown = _megarl(cluster, "submit", "--status", run.run_dir, cwd=run.run_dir)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def _slurm_state(cluster, job_id: str) -> tuple[str, str]:
    listed = cluster.run("squeue", "--noheader", "--jobs", job_id, "--format", "%T|%r")
    return tuple(listed.stdout.strip().split("|")) if "|" in listed.stdout else ("", "")


def _wait(what: str, done, run, timeout_s: float, cluster=None) -> None:
    """Poll until `done()`; fail after `timeout_s`, or at once when `cluster` says the job is no longer queued."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{_tail(run.log)}"
        if cluster is not None:
            assert _slurm_state(cluster, run.job_id)[0] in ACTIVE, f"{what}: the job ended first\n{_tail(run.log)}"
        time.sleep(2)


def _tail(path: Path, lines: int = 60) -> str:
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


def _secrets_on_command_lines(job_id: str) -> tuple[int, list[str]]:
    """(processes of the job looked at, command lines that hold the job's Ray token)."""
    marker, tokens, cmdlines = f"SLURM_JOB_ID={job_id}\0".encode(), set(), []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes() if proc.name.isdigit() else b""
            if marker in environ:
                tokens |= {entry.split(b"=", 1)[1] for entry in environ.split(b"\0")
                           if entry.startswith(b"RAY_AUTH_TOKEN=")}
                cmdlines.append((proc / "cmdline").read_bytes())
        except OSError:
            continue
    assert tokens, "no process of the job carries its Ray token"
    return len(cmdlines), [line.decode(errors="replace") for line in cmdlines if any(t in line for t in tokens)]


def _steps_logged(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lifecycle(slurm, tmp_path_factory):
    """The two-node job: six steps, preempted by a higher-priority job after its first, requeued, resumed."""
    tmp_path = tmp_path_factory.mktemp("two-hosts")
    run = _submit(slurm, tmp_path, "two-hosts", f"trainer.total_steps={TOTAL_STEPS}", *TWO_HOSTS,
                  extra=("--nodes", "2", "--requeue"))
    metrics = run.run_dir / "metrics.jsonl"
    _wait("the first step", lambda: metrics.exists() and metrics.read_text().strip(), run, 600, slurm)
    run.secrets = _secrets_on_command_lines(run.job_id)
    run.preemptor = slurm.run("sbatch", "--parsable", "--partition=urgent", "--nodes=1", f"--chdir={tmp_path}",
                              f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 2")
    assert run.preemptor.returncode == 0, run.preemptor.stderr
    slurm.jobs.append(run.preemptor.stdout.strip().split(";")[0])
    starts = run.run_dir / "slurm" / f"job-{run.job_id}.jsonl"
    _wait("the first start recorded", starts.exists, run, 240)
    # Slurm holds a requeued job about two minutes before it may start again; the test does not wait that out.
    _wait("requeued", lambda: _slurm_state(slurm, run.job_id)[0] == "PENDING", run, 60)
    slurm.run("scontrol", "update", f"JobId={run.job_id}", "StartTime=now")
    _wait("the second start finished", lambda: len(starts.read_text().splitlines()) >= 2, run, 480)
    _wait("the job ended", lambda: _slurm_state(slurm, run.job_id)[0] not in ACTIVE, run, 60)
    run.status = _status(slurm, run)
    return run


def test_ray_spans_both_hosts_with_the_actor_on_one_and_the_rollout_server_on_the_other(slurm, lifecycle):
    run, (head, other) = lifecycle, list(slurm.nodes)
    log = run.log.read_text()
    assert f"2 node(s) registered with 1 CPU each: {head} {other}" in log, _tail(run.log)
    # Each host's Ray ran, was stopped by the teardown and kept its logs; which actor ran where is in them.
    actors = {}
    for node in (head, other):
        ray_logs = run.run_dir / "logs" / f"ray-{node}-{run.job_id}.0"
        assert (ray_logs / "raylet.out").exists(), sorted(p.name for p in (run.run_dir / "logs").iterdir())
        actors[node] = {line.split(":actor_name:")[1].strip() for path in ray_logs.glob("worker-*.out")
                        for line in path.read_text(errors="replace").splitlines() if ":actor_name:" in line}
    hosts_of = {name: [node for node in actors if name in actors[node]] for name in ("MegatronWorker", "ServerHost")}
    assert len(hosts_of["MegatronWorker"]) == 1 and len(hosts_of["ServerHost"]) == 1, actors
    assert hosts_of["MegatronWorker"] != hosts_of["ServerHost"], actors
    # The weights crossed hosts through the weight-update group: the server generates with the trainer's policy.
    records = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        assert not [key for key in CONTRACT_KEYS if key not in record], record
        assert record["rollout/logprob_diff"] < 1e-4, record


def test_addresses_are_the_hosts_own_although_their_names_resolve_to_127_0_1_1(slurm, lifecycle):
    run, (head, other) = lifecycle, list(slurm.nodes)
    for node, address in slurm.nodes.items():
        resolved = subprocess.run(slurm.on_node(node, "getent", "hosts", node), capture_output=True, text=True)
        assert resolved.stdout.split()[0] == "127.0.1.1", resolved
    log = run.log.read_text()
    assert f"ray head on {head} at {slurm.nodes[head]}:" in log, _tail(run.log)  # resolved on the head node
    for node, role in ((head, "head"), (other, "worker")):
        node_log = (run.run_dir / "logs" / f"ray-{role}-{node}-{run.job_id}.0.log").read_text()
        assert f"ray {role} on {node} ({slurm.nodes[node]}), try 1: " in node_log, node_log


def test_preemption_checkpoints_requeues_and_resumes_in_the_same_job(slurm, lifecycle):
    run = lifecycle
    log = run.log.read_text()
    first, second = log.split(f"job {run.job_id} start 1 on")
    # Slurm signalled the steps; every Ray node kept running and told the batch script; the driver got one SIGTERM.
    assert first.count("forwarded to the driver") == 1 and "SIGTERM to the job steps (preemption)" in first, first
    for node in slurm.nodes:
        role = "head" if node == next(iter(slurm.nodes)) else "worker"
        node_log = (run.run_dir / "logs" / f"ray-{role}-{node}-{run.job_id}.0.log").read_text()
        assert "SIGTERM from Slurm; telling the batch script" in node_log and ", try 2:" not in node_log, node_log
    assert "driver exited with status 75 after SIGTERM\n" in first  # exactly 75: stopped with a checkpoint
    assert f"requeueing job {run.job_id}" in first and "Traceback" not in log
    assert "driver exited with status 0\n" in second
    starts = [json.loads(line) for line in (run.run_dir / "slurm" / f"job-{run.job_id}.jsonl").read_text().splitlines()]
    assert [(start["restart"], start["status"], start["requeued"]) for start in starts] == [(0, 75, True),
                                                                                           (1, 0, False)]
    controller_log = (run.run_dir / "logs" / "controller.log").read_text()
    stopped = int(controller_log.split("stop requested: step ")[1].split()[0])  # abandoned, or finished
    assert 2 <= stopped <= TOTAL_STEPS, controller_log[-3000:]
    assert _steps_logged(run.run_dir) == list(range(1, TOTAL_STEPS + 1))  # nothing lost, nothing done twice
    # Each start has its own preflight facts and Ray logs; the job log holds both starts.
    for restart in (0, 1):
        assert (run.run_dir / "logs" / f"preflight-{run.job_id}.{restart}.jsonl").read_text().count('"node"') == 2
    assert run.status.startswith(f"job {run.job_id}: finished"), run.status
    assert f"last metrics: step {TOTAL_STEPS}: " in run.status


def test_the_ray_token_is_on_no_command_line_and_nothing_is_left_behind(slurm, lifecycle):
    looked_at, leaked = lifecycle.secrets
    assert looked_at >= 8 and leaked == [], leaked  # the Ray daemons, workers, servers and the driver
    assert _job_processes(lifecycle.job_id) == []
    assert not Path(f"/tmp/megarl-ray-{lifecycle.job_id}").exists()


def test_preflight_stops_a_job_whose_ray_port_is_taken(slurm, tmp_path):
    node = list(slurm.nodes)[-1]
    ports = free_block(0)
    squatter = subprocess.Popen(slurm.on_node(node, sys.executable, "-c",
                                              f"import socket, time; s = socket.socket(); s.bind(('', {ports.base})); "
                                              "s.listen(); print('bound', flush=True); time.sleep(600)"),
                                stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout.readline() == "bound\n"
        run = _submit(slurm, tmp_path, "port-taken", "trainer.total_steps=1",
                      extra=("--nodes", "1", f"--sbatch-arg=--nodelist={node}", "--env",
                             f"MEGARL_RAY_PORT_BASE={ports.base}"))
        _wait("the job ended", lambda: _slurm_state(slurm, run.job_id)[0] not in ACTIVE, run, 180)
    finally:
        squatter.kill()
        squatter.wait()
    status = _status(slurm, run)
    assert status.startswith(f"job {run.job_id}: failed: status 1: preflight: node {node}: 1 port(s) of this job's "
                             f"Ray port block are in use: {ports.base} (gcs)"), status
    assert not list((run.run_dir / "logs").glob("ray-*"))  # no Ray was started
    assert _job_processes(run.job_id) == []
