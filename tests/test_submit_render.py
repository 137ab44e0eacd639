"""megarl submit without a cluster: the rendered job script for 1, 2 and 16 nodes, and the refusals.

The script is not only read but run, under stand-ins for srun, scontrol,
squeue, scancel and the job's interpreter that record every call (the same
bash, traps and teardown a real job runs). The recorded calls are compared
with golden lists: preflight, head and worker bring-up, the registration wait,
the driver, SIGTERM forwarding and teardown in order. The real single-node
Slurm runs of tests/test_slurm.py cover the same script end to end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.cli import main
from megarl.config import load_recipe
from megarl.errors import InputError
from megarl.submit.fit import check_fit
from megarl.submit.preflight import check_facts, head_ip
from megarl.submit.ray_ports import BLOCK_SIZE, FIRST_PORT, NUM_BLOCKS, block_for

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"
JOB_ID = 4242
HEAD_IP = "10.1.2.3"
PORT = FIRST_PORT + (JOB_ID % NUM_BLOCKS) * BLOCK_SIZE
VERSIONS = {"torch": "2.4.0", "megatron-core": "0.16.1", "sglang": "0.5.23", "ray": "2.60.0", "megarl": "0.1.0"}

# Stand-ins. Every call is appended to $SHIM_LOG. Long-running ones (Ray nodes, a hanging driver) wait on a
# child sleep they kill on SIGTERM, so no process outlives a test.
SHIMS = {
    "scontrol": """
echo "scontrol $*" >>"$SHIM_LOG"
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $SHIM_NODES
""",
    "squeue": """
echo "squeue $*" >>"$SHIM_LOG"
for f in "$SHIM_DIR"/step-*.pid; do [ -e "$f" ] && n=${f##*/step-} && echo "$SLURM_JOB_ID.${n%.pid} ${n%.pid}"; done
""",
    "scancel": """
echo "scancel $*" >>"$SHIM_LOG"
name=${2#*.}
kill -TERM "$(cat "$SHIM_DIR/step-$name.pid")"
""",
    "srun": """
case "$*" in
  *"preflight reach"*)
    until [ -e "$SHIM_DIR/step-megarl-ray-head.pid" ]; do sleep 0.1; done
    echo "srun $*" >>"$SHIM_LOG" ;;
  *megarl_ray_node*)
    echo "srun $*" >>"$SHIM_LOG"
    name=$(echo "$*" | sed 's/.*--job-name=\\([^ ]*\\).*/\\1/')
    sleep 1000 & child=$!
    trap 'echo "$name: SIGTERM" >>"$SHIM_LOG"; kill $child; exit 0' TERM
    echo $$ >"$SHIM_DIR/step-$name.pid"
    wait $child ;;
  *"preflight facts"*)
    echo "srun $*" >>"$SHIM_LOG"
    cat "$SHIM_DIR/facts.jsonl" ;;
  *) echo "srun $*" >>"$SHIM_LOG" ;;
esac
""",
    "python": """
case "$*" in
  *megarl.submit.registration*)
    [ "$(echo $SHIM_NODES | wc -w)" -gt 1 ] && until [ -e "$SHIM_DIR/step-megarl-ray-workers.pid" ]; do sleep 0.1; done
    echo "python $*" >>"$SHIM_LOG"
    case "$SHIM_REGISTRATION" in
      fail) echo "megarl-launch: 1 of 2 node(s) registered" >&2; exit 1 ;;
      hang) sleep 1000 & child=$!; trap 'kill $child; exit 143' TERM; wait $child ;;
    esac
    exit 0 ;;
esac
if [ "$SHIM_DRIVER" = hang ] && [[ "$*" = *"megarl train"* ]]; then
  trap 'echo "driver: SIGTERM" >>"$SHIM_LOG"; kill $child; exit 99' TERM  # before the test sees the call
fi
echo "python $*" >>"$SHIM_LOG"
case "$*" in
  *"preflight head-ip"*) echo "$SHIM_HEAD_IP" ;;
  *"megarl train"*)
    if [ "$SHIM_DRIVER" = hang ]; then
      sleep 1000 & child=$!
      wait $child
    fi ;;
  *) exec "$SHIM_REAL_PYTHON" "$@" ;;
esac
""",
}


@pytest.fixture(autouse=True)
def _submit_from_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the job's working directory is where megarl submit ran


def _nodes(count: int) -> list[str]:
    return [f"node{index:03d}" for index in range(1, count + 1)]


def _facts(nodes: list[str], **changes_by_node) -> str:
    lines = []
    for node in nodes:
        fact = {"node": node, "gpus": 8, "cuda_visible_devices": "0,1,2,3,4,5,6,7", "busy_ports": [],
                "versions": dict(VERSIONS)}
        fact["versions"].update(changes_by_node.get(node, {}))
        lines.append(json.dumps(fact))
    return "\n".join(lines) + "\n"


def _overrides(tmp_path: Path, nodes: int) -> list[str]:
    # The 2n8g recipe scaled to `nodes` x 8 GPUs: TP4 x PP2 with DP = nodes, 4 rollout servers of TP2 per node.
    return [f"trainer.output_dir={tmp_path / 'runs'}", f"placement.nodes={nodes}", f"rollout.num_servers={4 * nodes}",
            "cluster.env.NCCL_SOCKET_IFNAME=ib0"]


def _render(tmp_path: Path, capsys, nodes: int, python: Path) -> str:
    argv = ["submit", str(QWEN), "--nodes", str(nodes), "--dry-run", "--python", str(python),
            "--partition", "gpu", "--time", "2:00:00", "--sbatch-arg=--qos=high", "--env", "NCCL_DEBUG=WARN"]
    for override in _overrides(tmp_path, nodes):
        argv += ["--set", override]
    assert main(argv) == 0
    return capsys.readouterr().out


class Job:
    """A rendered script run under the stand-ins, with its recorded calls."""

    def __init__(self, tmp_path: Path, capsys, nodes: int, *, facts: str | None = None, **behaviour: str):
        self.dir = tmp_path / "shims"
        self.dir.mkdir()
        for name, body in SHIMS.items():
            (self.dir / name).write_text("#!/bin/bash\n" + body)
            (self.dir / name).chmod(0o755)
        self.nodes = _nodes(nodes)
        (self.dir / "facts.jsonl").write_text(facts or _facts(self.nodes))
        self.log = self.dir / "calls.log"
        self.log.touch()
        self.run_dir = tmp_path / "runs" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2"
        self.run_dir.joinpath("logs").mkdir(parents=True)
        self.script = tmp_path / "job.sbatch"
        self.script.write_text(_render(tmp_path, capsys, nodes, self.dir / "python"))
        env = {**os.environ, "PATH": f"{self.dir}:{os.environ['PATH']}", "SHIM_DIR": str(self.dir),
               "SHIM_LOG": str(self.log), "SHIM_NODES": " ".join(self.nodes), "SHIM_HEAD_IP": HEAD_IP,
               "SHIM_REAL_PYTHON": sys.executable, "SHIM_DRIVER": "", "SHIM_REGISTRATION": "",
               "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NODELIST": f"node[001-{nodes:03d}]"}
        env.update({f"SHIM_{key.upper()}": value for key, value in behaviour.items()})
        env.pop("MEGARL_RAY_PORT_BASE", None)
        self.process = subprocess.Popen(["bash", str(self.script)], env=env, cwd=tmp_path,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for_call(self, fragment: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while fragment not in self.log.read_text():
            assert time.monotonic() < deadline and self.process.poll() is None, self.log.read_text()
            time.sleep(0.1)

    def finish(self, timeout_s: float = 120) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, output

    def calls(self) -> list[str]:
        text = self.log.read_text().replace(str(self.dir / "python"), "PY").replace(str(self.run_dir), "RUN")
        text = text.replace(str(QWEN), "RECIPE")
        return re.sub(r"--watch-pid \d+", "--watch-pid PID", text).splitlines()


def golden_calls(nodes: list[str]) -> dict[str, list[str]]:
    """The calls of a job on `nodes`, by phase."""
    count, head, workers, address = len(nodes), nodes[0], nodes[1:], f"{HEAD_IP}:{PORT}"
    bring_up = [
        f"scontrol show hostnames node[001-{count:03d}]",
        f"python -m megarl.submit.ray_ports --seed {JOB_ID}",
        "python -c import secrets; print(secrets.token_hex(32))",
        f"srun --overlap --nodes={count} --ntasks-per-node=1 PY -m megarl.submit.preflight facts --device cuda "
        f"--port-seed {JOB_ID}",
        f"python -m megarl.submit.preflight check --nodes {' '.join(nodes)} --device cuda --gpus-per-node 8",
        "python -m megarl.submit.preflight head-ip",
        f"srun --overlap --nodes=1 --ntasks=1 --nodelist={head} --job-name=megarl-ray-head "
        "--output=RUN/logs/ray-head-%N.log bash -c megarl_ray_node head",
        f"srun --overlap --nodes={count} --ntasks-per-node=1 PY -m megarl.submit.preflight reach --address {address} "
        "--timeout 120",
    ]
    if workers:
        bring_up.append(
            f"srun --overlap --nodes={len(workers)} --ntasks-per-node=1 --nodelist={','.join(workers)} "
            "--job-name=megarl-ray-workers --output=RUN/logs/ray-worker-%N.log bash -c megarl_ray_node worker"
        )
    bring_up.append(
        f"python -m megarl.submit.registration --address {address} --nodes {count} --device cuda --per-node 8 "
        f"--hosts {' '.join(nodes)} --log-dir RUN/logs --watch-pid PID"
        + (" --watch-pid PID" if workers else "") + " --timeout 300"
    )
    driver = [f"python -m megarl train RECIPE --ray-address {address} "
              + " ".join(f"--set {override}" for override in _overrides(Path("TMP"), count))]
    teardown = []
    for name in (["megarl-ray-workers"] if workers else []) + ["megarl-ray-head"]:
        teardown += [f"squeue --noheader --steps --jobs {JOB_ID} --format %i %j",
                     f"scancel --signal=TERM {JOB_ID}.{name}", f"{name}: SIGTERM"]
    return {"bring_up": bring_up, "driver": driver, "teardown": teardown}


def _normalise_tmp(calls: list[str], tmp_path: Path) -> list[str]:
    return [call.replace(str(tmp_path), "TMP") for call in calls]


@pytest.mark.parametrize("nodes", [1, 2, 16])
def test_job_script_brings_up_runs_and_tears_down(tmp_path, capsys, nodes):
    job = Job(tmp_path, capsys, nodes)
    status, output = job.finish()
    assert status == 0, output
    golden = golden_calls(job.nodes)
    assert _normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["driver"] + golden["teardown"]
    assert "driver exited with status 0\n" in output and "torn down; exit status 0" in output

    script = job.script.read_text()
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=megarl-grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2", f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --mem=0",
        f"#SBATCH --output={job.run_dir}/logs/slurm-%j.out", f"#SBATCH --chdir={tmp_path}",
        "#SBATCH --signal=B:TERM@300", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
        "#SBATCH --time=2:00:00", "#SBATCH --qos=high",
    ]
    # The NCCL environment from the recipe's cluster.env and from --env, for every node.
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport NCCL_DEBUG=WARN\n" in script
    assert f"export MEGARL_PYTHON={job.dir / 'python'}\n" in script
    assert "trap megarl_on_term TERM INT\ntrap megarl_teardown EXIT\nmegarl_main\n" in script
    # Per-job ports and temp dir, no user paths, no broad kill.
    assert 'MEGARL_RAY_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/megarl-ray-$SLURM_JOB_ID}' in script
    commands = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"pkill|killall|ray stop|/home/|/root/", commands.replace(sys.executable, "PY"))


def test_sigterm_goes_to_the_driver_then_everything_stops(tmp_path, capsys):
    job = Job(tmp_path, capsys, 2, driver="hang")
    job.wait_for_call("megarl train")
    job.process.send_signal(signal.SIGTERM)
    status, output = job.finish()
    assert status == 99, output  # the driver's own exit status is the job's
    golden = golden_calls(job.nodes)
    assert _normalise_tmp(job.calls(), tmp_path) == (
        golden["bring_up"] + golden["driver"] + ["driver: SIGTERM"] + golden["teardown"]
    )
    assert "SIGTERM: forwarded to the driver" in output
    assert "driver exited with status 99 after SIGTERM" in output


def test_sigterm_before_the_driver_tears_down_the_bring_up(tmp_path, capsys):
    job = Job(tmp_path, capsys, 2, registration="hang")
    job.wait_for_call("megarl.submit.registration")
    job.process.send_signal(signal.SIGTERM)
    status, output = job.finish()
    assert status == 143, output
    golden = golden_calls(job.nodes)
    assert _normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["teardown"]
    assert "SIGTERM before the driver started" in output and "stopping a bring-up step" in output


def test_workers_that_never_register_fail_the_job_and_stop_ray(tmp_path, capsys):
    job = Job(tmp_path, capsys, 2, registration="fail")
    status, output = job.finish()
    assert status == 1, output
    golden = golden_calls(job.nodes)
    assert _normalise_tmp(job.calls(), tmp_path) == golden["bring_up"] + golden["teardown"]
    assert "1 of 2 node(s) registered" in output


def test_preflight_names_the_node_that_differs_and_starts_no_ray(tmp_path, capsys):
    facts = _facts(_nodes(2), node002={"torch": "2.5.1"})
    job = Job(tmp_path, capsys, 2, facts=facts)
    status, output = job.finish()
    assert status == 1, output
    assert "preflight: node node002: torch 2.5.1 differs from node001's 2.4.0" in output
    assert not [call for call in job.calls() if "megarl_ray_node" in call or "megarl train" in call]


def test_refuses_a_recipe_that_needs_more_nodes_than_asked_for(tmp_path, capsys):
    overrides = ["--set", f"trainer.output_dir={tmp_path}"]
    assert main(["submit", str(QWEN), "--nodes", "1", "--dry-run", *overrides]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: placement.nodes: pool 'colocated' = 2 x 8 for actor, reference, rollout "
                            "needs more nodes than the job asks for, --nodes 1 --gpus-per-node 8 = 8 GPUs (got 2)")
    assert main(["submit", str(QWEN), "--nodes", "4", "--gpus-per-node", "4", "--dry-run", *overrides]) == 2
    assert "error: placement.gpus_per_node: pool 'colocated' = 2 x 8" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def _three_pools(tmp_path: Path):
    # actor, reference and rollout each on their own pool of 1 node x 2 process slots.
    return load_recipe(QUICKSTART, [
        f"trainer.output_dir={tmp_path}", "placement.colocate=false", "placement.nodes=2",
        "placement.gpus_per_node=3", "actor.use_kl_loss=true", "weight_sync.transport=distributed",
        "rollout.num_servers=2", "placement.pools={a: {nodes: 1, gpus_per_node: 2}, b: {nodes: 1, gpus_per_node: 2}, "
        "c: {nodes: 1, gpus_per_node: 2}}", "placement.roles={actor: a, reference: b, rollout: c}",
    ])


def test_refuses_pools_that_add_up_but_do_not_pack_onto_the_nodes(tmp_path):
    recipe = _three_pools(tmp_path)
    # 6 slots asked for and 6 needed, but three shares of 2 do not pack onto two nodes of 3.
    with pytest.raises(InputError, match=r"placement.pools: the pools in use need 6 process slots .* which do not "
                                         r"fit --nodes 2 --gpus-per-node 3 = 6 process slots"):
        check_fit(recipe, nodes=2, gpus_per_node=3)
    check_fit(recipe, nodes=2, gpus_per_node=4)  # 2 + 2 on one node, 2 on the other
    check_fit(recipe, nodes=3, gpus_per_node=2)


def test_submit_arguments_are_checked(tmp_path, capsys):
    assert main(["submit", str(QUICKSTART), "--dry-run"]) == 2
    assert "error: --nodes: required to submit a recipe" in capsys.readouterr().err
    assert main(["submit", str(QUICKSTART), "--nodes", "1", "--env", "1BAD=x", "--dry-run"]) == 2
    assert ("error: --env: expected KEY=VALUE with a shell variable name as KEY (got '1BAD=x')"
            in capsys.readouterr().err)
    assert main(["submit", str(QUICKSTART), "--status", str(tmp_path)]) == 2
    assert "give exactly one of RECIPE, --status RUN_DIR, --cancel RUN_DIR" in capsys.readouterr().err
    assert main(["submit", "--status", str(tmp_path)]) == 2
    assert f"error: {tmp_path}: no job submitted by megarl submit" in capsys.readouterr().err
    assert main(["submit", str(QUICKSTART), "--nodes", "1", "--sbatch-arg=qos", "--dry-run"]) == 2
    assert "error: --sbatch-arg: each value must be one sbatch option" in capsys.readouterr().err
    assert main(["submit", str(QUICKSTART), "--nodes", "1", "--set", "cluster.env={1X: y}", "--dry-run"]) == 2
    assert ("error: --set: cluster.env: environment variable names must match [A-Za-z_][A-Za-z0-9_]*: ['1X'] "
            "(got {'1X': 'y'})") in capsys.readouterr().err


def test_preflight_check_names_each_node_and_difference():
    nodes = _nodes(3)
    facts = [json.loads(line) for line in _facts(nodes, node003={"megarl": "0.1.0 (sources abc)"}).splitlines()]
    facts[1].update(gpus=7, cuda_visible_devices="0,1,2,3,4,5,6", busy_ports=[["gcs", 22400], ["worker", 22410]])
    del facts[2]["versions"]["sglang"]
    assert check_facts(facts, nodes=nodes + ["node004"], device="cuda", gpus_per_node=8) == [
        "node node004: preflight reported nothing (see its lines in the job log)",
        "node node002: 7 GPU(s) visible (CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6), expected 8",
        "node node002: 2 port(s) of this job's Ray port block are in use: 22400 (gcs), 22410 (worker) "
        "(another Ray on the node? pin another block with --env MEGARL_RAY_PORT_BASE=...)",
        "node node003: megarl 0.1.0 (sources abc) differs from node001's 0.1.0",
    ]
    good = [json.loads(line) for line in _facts(nodes).splitlines()]
    assert check_facts(good, nodes=nodes, device="cuda", gpus_per_node=8) == []
    # A CPU recipe has no GPUs to count.
    assert check_facts([{**good[0], "gpus": None}], nodes=nodes[:1], device="cpu", gpus_per_node=2) == []


def test_port_blocks_of_different_jobs_do_not_overlap(monkeypatch):
    monkeypatch.delenv("MEGARL_RAY_PORT_BASE", raising=False)
    blocks = [set(port for _, port in block_for(seed).every_port()) for seed in range(NUM_BLOCKS)]
    assert all(len(block) == BLOCK_SIZE - 2 for block in blocks)  # 8 named + 190 worker ports, 2 spare
    assert len(set().union(*blocks)) == sum(len(block) for block in blocks)
    assert min(min(block) for block in blocks) == FIRST_PORT and max(max(block) for block in blocks) < 32768
    assert block_for(JOB_ID).named()["gcs"] == PORT and block_for(JOB_ID + NUM_BLOCKS).base == PORT
    monkeypatch.setenv("MEGARL_RAY_PORT_BASE", "15000")
    assert block_for(JOB_ID).base == 15000


def test_head_ip_comes_from_the_named_interface(monkeypatch):
    monkeypatch.setenv("MEGARL_RAY_IFACE", "lo")
    assert head_ip() == "127.0.0.1"
    monkeypatch.setenv("MEGARL_RAY_IFACE", "nosuchif0")
    with pytest.raises(OSError):
        head_ip()
