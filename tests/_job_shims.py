"""A rendered job script run without Slurm: stand-ins for srun, scontrol, squeue, scancel and the job's interpreter.

Every call the batch script makes is appended to `calls.log` (a Ray node's own
calls go to `node-<name>.log`), so tests compare them with golden lists. The
Ray node steps run the script's real `megarl_ray_node` in one shell per node:
the real shield and sweep (`megarl.processes`), with a stand-in for `ray start`
that sleeps (or, with SHIM_RAY=fail-once, fails its first start on each node), and a registration wait
that ends once every node's stand-in runs.
`scancel` delivers signals to the shells of a step, or (`--batch`) to the batch
script, as Slurm does. The driver stand-in exits 0, or on SIGTERM 99 (`hang`)
or 75 (`preemptible`, a driver that checkpointed).
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

from megarl.cli import main

REPO = Path(__file__).resolve().parents[1]
QWEN = REPO / "recipes" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2.yaml"
JOB_ID = 4242
HEAD_IP = "10.1.2.3"
VERSIONS = {"torch": "2.4.0", "megatron-core": "0.16.1", "sglang": "0.5.23", "ray": "2.60.0", "megarl": "0.1.0"}

SHIMS = {
    "scontrol": """
echo "scontrol $*" >>"$SHIM_LOG"
[ "$1 $2" = "show hostnames" ] && printf '%s\\n' $SHIM_NODES
exit 0
""",
    "squeue": """
echo "squeue $*" >>"$SHIM_LOG"
for f in "$SHIM_DIR"/step-*.pids; do [ -e "$f" ] && n=${f##*/step-} && echo "$SLURM_JOB_ID.${n%.pids} ${n%.pids}"; done
""",
    "scancel": """
echo "scancel $*" >>"$SHIM_LOG"
sig=TERM
for arg in "$@"; do case "$arg" in --signal=*) sig=${arg#--signal=} ;; esac; done
target=${@: -1}
if [ "$1" = --batch ]; then
  kill -"$sig" "$(cat "$SHIM_DIR/batch.pid")"
else
  kill -"$sig" $(cat "$SHIM_DIR/step-${target#*.}.pids") 2>/dev/null
fi
exit 0
""",
    "srun": """
call="srun $*"
[[ "$call" = *"preflight reach"* ]] || echo "$call" >>"$SHIM_LOG"
name= nodes=$SHIM_NODES
while [ $# -gt 0 ] && [ "${1:0:2}" = -- ]; do
  case "$1" in
    --job-name=*) name=${1#--job-name=} ;;
    --nodelist=*) nodes=${1#--nodelist=}; nodes=${nodes//,/ } ;;
  esac
  shift
done
case "$*" in
  *"preflight reach"*)
    until [ -e "$SHIM_DIR/step-megarl-ray-head.pids" ]; do sleep 0.1; done
    echo "$call" >>"$SHIM_LOG" ;;
  *"preflight facts"*)
    cat "$SHIM_DIR/facts.jsonl" ;;
  *megarl_ray_node*)
    pids=()
    for node in $nodes; do
      SLURMD_NODENAME=$node "$@" >>"$SHIM_DIR/node-$node.log" 2>&1 &
      pids+=($!)
    done
    echo "${pids[*]}" >"$SHIM_DIR/step-$name.pids"
    wait ;;
  *)
    if [ -n "$name" ]; then
      "$@" & echo $! >"$SHIM_DIR/step-$name.pids"; wait $!; exit $?
    fi
    exec "$@" ;;
esac
""",
    "python": """
log=$SHIM_LOG
[ -n "${SLURMD_NODENAME:-}" ] && log=$SHIM_DIR/node-$SLURMD_NODENAME.log
case "$1 $2 $3" in
  "-m ray.scripts.scripts start")
    tries=$SHIM_DIR/ray-tries-$SLURMD_NODENAME
    echo x >>"$tries"
    echo "ray start on $SLURMD_NODENAME (try $(wc -l <"$tries"))" >>"$log"
    if [ "$SHIM_RAY" = fail-once ] && [ "$(wc -l <"$tries")" -eq 1 ]; then exit 1; fi
    touch "$SHIM_DIR/ray-up-$SLURMD_NODENAME"
    exec sleep 1000 ;;
esac
case "$*" in
  *megarl.submit.registration*)
    [ "$(echo $SHIM_NODES | wc -w)" -gt 1 ] && [[ "$*" != *"--nodes 1 "* ]] && until [ -e "$SHIM_DIR/step-megarl-ray-workers.pids" ]; do sleep 0.1; done ;;
esac
echo "python $*" >>"$log"
case "$*" in
  *megarl.submit.registration*)
    if [ "$(echo $SHIM_NODES | wc -w)" -gt 1 ] && [[ "$*" = *"--nodes 1 "* ]]; then  # the head alone
      until [ -e "$SHIM_DIR/ray-up-${SHIM_NODES%% *}" ]; do sleep 0.1; done
      exit 0
    fi
    case "$SHIM_REGISTRATION" in
      fail) echo "megarl-launch: 1 of 2 node(s) registered" >&2; exit 1 ;;
      hang) exec sleep 1000 ;;
    esac
    for node in $SHIM_NODES; do  # as Ray's registration: every node's Ray is up
      until [ -e "$SHIM_DIR/ray-up-$node" ]; do sleep 0.1; done
    done
    exit 0 ;;
  *"preflight node-ip"*) echo "$SHIM_HEAD_IP"; exit 0 ;;
  *"megarl train"*)
    case "$SHIM_DRIVER" in
      hang) trap 'echo "driver: SIGTERM" >>"$SHIM_LOG"; kill $child; exit 99' TERM ;;
      preemptible) trap 'echo "driver: SIGTERM" >>"$SHIM_LOG"; kill $child; exit 75' TERM ;;
      *) exit 0 ;;
    esac
    sleep 1000 & child=$!
    echo started >"$SHIM_DIR/driver.started"  # only now: the trap needs $child
    wait $child ;;
  *) exec "$SHIM_REAL_PYTHON" "$@" ;;
esac
""",
}


def nodes_named(count: int) -> list[str]:
    return [f"node{index:03d}" for index in range(1, count + 1)]


def facts(nodes: list[str], **changes_by_node) -> str:
    lines = []
    for node in nodes:
        fact = {"node": node, "gpus": 8, "cuda_visible_devices": "0,1,2,3,4,5,6,7", "busy_ports": [],
                "versions": dict(VERSIONS)}
        fact["versions"].update(changes_by_node.get(node, {}))
        lines.append(json.dumps(fact))
    return "\n".join(lines) + "\n"


def overrides(tmp_path: Path, nodes: int) -> list[str]:
    # The 2n8g recipe scaled to `nodes` x 8 GPUs: TP4 x PP2 with DP = nodes, 4 rollout servers of TP2 per node.
    return [f"trainer.output_dir={tmp_path / 'runs'}", f"placement.nodes={nodes}", f"rollout.num_servers={4 * nodes}",
            "cluster.env.NCCL_SOCKET_IFNAME=ib0"]


def render(tmp_path: Path, capsys, nodes: int, python: Path | str, *extra: str) -> str:
    argv = ["submit", str(QWEN), "--nodes", str(nodes), "--dry-run", "--python", str(python),
            "--partition", "gpu", "--time", "2:00:00", "--sbatch-arg=--qos=high", "--env", "NCCL_DEBUG=WARN", *extra]
    for override in overrides(tmp_path, nodes):
        argv += ["--set", override]
    assert main(argv) == 0
    return capsys.readouterr().out


class Job:
    """A rendered script run under the stand-ins, with its recorded calls."""

    def __init__(self, tmp_path: Path, capsys, nodes: int, *, facts_text: str | None = None, extra=(),
                 **behaviour: str):
        self.dir = tmp_path / "shims"
        self.dir.mkdir()
        for name, body in SHIMS.items():
            (self.dir / name).write_text("#!/bin/bash\n" + body)
            (self.dir / name).chmod(0o755)
        self.nodes = nodes_named(nodes)
        (self.dir / "facts.jsonl").write_text(facts_text or facts(self.nodes))
        self.log = self.dir / "calls.log"
        self.log.touch()
        self.run_dir = tmp_path / "runs" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2"
        self.run_dir.joinpath("logs").mkdir(parents=True, exist_ok=True)
        self.script = tmp_path / "job.sbatch"
        self.script.write_text(render(tmp_path, capsys, nodes, self.dir / "python", *extra))
        env = {**os.environ, "PATH": f"{self.dir}:{os.environ['PATH']}", "SHIM_DIR": str(self.dir),
               "SHIM_LOG": str(self.log), "SHIM_NODES": " ".join(self.nodes), "SHIM_HEAD_IP": HEAD_IP,
               "SHIM_REAL_PYTHON": sys.executable, "SHIM_DRIVER": "", "SHIM_REGISTRATION": "", "SHIM_RAY": "",
               "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NODELIST": f"node[001-{nodes:03d}]"}
        env.update({f"SHIM_{key.upper()}": value for key, value in behaviour.items()})
        for name in ("MEGARL_RAY_PORT_BASE", "SLURM_RESTART_COUNT", "MEGARL_SHIELD_SIGTERM"):
            env.pop(name, None)
        self.process = subprocess.Popen(["bash", str(self.script)], env=env, cwd=tmp_path,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (self.dir / "batch.pid").write_text(str(self.process.pid))

    def wait_for(self, done, what: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline and self.process.poll() is None, f"{what}:\n{self.log.read_text()}"
            time.sleep(0.1)

    def wait_for_call(self, fragment: str, timeout_s: float = 60) -> None:
        self.wait_for(lambda: fragment in self.log.read_text(), f"no call with {fragment!r}", timeout_s)

    def step_pids(self, name: str) -> list[int]:
        return [int(pid) for pid in (self.dir / f"step-{name}.pids").read_text().split()]

    def signal_steps(self, signum: int) -> None:
        """What Slurm does when it preempts a job with a grace time: `signum` to every process of every step."""
        import psutil

        for name in ("megarl-ray-head", "megarl-ray-workers"):
            if not (self.dir / f"step-{name}.pids").exists():
                continue
            for pid in self.step_pids(name):
                family = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
                for process in family:
                    try:
                        process.send_signal(signum)
                    except psutil.NoSuchProcess:
                        pass

    def finish(self, timeout_s: float = 120) -> tuple[int, str]:
        output, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, output

    def node_log(self, node: str) -> str:
        path = self.dir / f"node-{node}.log"
        return path.read_text() if path.exists() else ""

    def calls(self) -> list[str]:
        text = self.log.read_text().replace(str(self.dir / "python"), "PY").replace(str(self.run_dir), "RUN")
        return text.splitlines()


def golden_calls(nodes: list[str], *, job_step: str = f"{JOB_ID}.0") -> dict[str, list[str]]:
    """The batch script's calls of a job on `nodes`, by phase."""
    from megarl.cluster.ray_ports import BLOCK_SIZE, FIRST_PORT, NUM_BLOCKS

    port = FIRST_PORT + (JOB_ID % NUM_BLOCKS) * BLOCK_SIZE
    count, head, workers, address = len(nodes), nodes[0], nodes[1:], f"{HEAD_IP}:{port}"
    helper = "srun --overlap --gres=none"
    bring_up = [
        f"scontrol show hostnames node[001-{count:03d}]",
        f"python -m megarl.cluster.ray_ports --seed {JOB_ID}",
        f"{helper} --nodes={count} --ntasks={count} --ntasks-per-node=1 PY -m megarl.submit.preflight facts --device cuda "
        f"--port-seed {JOB_ID}",
        f"python -m megarl.submit.preflight check --nodes {' '.join(nodes)} --device cuda --gpus-per-node 8",
        f"{helper} --nodes=1 --ntasks=1 --nodelist={head} PY -m megarl.submit.preflight node-ip",
        "python -m megarl.submit.preflight node-ip",
        f"srun --overlap --nodes=1 --ntasks=1 --nodelist={head} --job-name=megarl-ray-head --open-mode=append "
        f"--output=RUN/logs/ray-head-%N-{job_step}.log bash -c megarl_ray_node head",
        f"{helper} --nodes={count} --ntasks={count} --ntasks-per-node=1 PY -m megarl.submit.preflight reach --address {address} "
        "--timeout 120",
    ]
    if workers:
        bring_up.append(
            f"python -m megarl.submit.registration --address {address} --nodes 1 --device cuda --per-node 8 "
            f"--hosts {head} --log-dir RUN/logs --attempt {job_step} --timeout 300")
        bring_up.append(
            f"srun --overlap --nodes={len(workers)} --ntasks={len(workers)} --ntasks-per-node=1 "
            f"--nodelist={','.join(workers)} "
            f"--job-name=megarl-ray-workers --open-mode=append --output=RUN/logs/ray-worker-%N-{job_step}.log "
            "bash -c megarl_ray_node worker"
        )
    bring_up.append(
        f"python -m megarl.submit.registration --address {address} --nodes {count} --device cuda --per-node 8 "
        f"--hosts {' '.join(nodes)} --log-dir RUN/logs --attempt {job_step} --timeout 300"
    )
    driver = [f"python -m megarl train RUN/slurm/recipe.yaml --ray-address {address}"]
    teardown = []
    for name in (["megarl-ray-workers"] if workers else []) + ["megarl-ray-head"]:
        teardown += [f"squeue --noheader --steps --jobs {JOB_ID} --format %i %j",
                     f"scancel --signal=USR2 {JOB_ID}.{name}"]
    return {"bring_up": bring_up, "driver": driver, "teardown": teardown}


def normalise_tmp(calls: list[str], tmp_path: Path) -> list[str]:
    return [re.sub(r"\s+$", "", call.replace(str(tmp_path), "TMP")) for call in calls]


def kill_leftovers(job: Job) -> None:
    """SIGKILL whatever a test's job left running: every process that carries this job's SHIM_DIR."""
    needle = f"SHIM_DIR={job.dir}\0".encode()
    if job.process.poll() is None:
        job.process.kill()
        job.process.wait()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle in b"\0" + (proc / "environ").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            continue
