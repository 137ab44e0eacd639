"""megarl submit without a cluster: the rendered script (golden renders), what submit freezes into the run dir,
the refusals, --status and --cancel over stand-in Slurm commands, preflight's checks and the port blocks.

The rendered scripts are run under stand-ins in tests/test_job_script.py, and on a real two-node Slurm in
tests/test_slurm.py. A template change shows up here as a golden render that differs: look at the diff,
then rewrite the renders with `MEGARL_UPDATE_GOLDEN=1 pytest tests/test_submit_render.py -k golden`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _job_shims import JOB_ID, QWEN, facts as _facts, nodes_named as _nodes, render
from megarl.cli import main
from megarl.cluster.ray_ports import BLOCK_SIZE, FIRST_PORT, NUM_BLOCKS, WORKER_PORTS, block_for
from megarl.config import load_recipe
from megarl.errors import InputError
from megarl.submit.fit import check_fit
from megarl.submit.freeze import input_paths
from megarl.submit.preflight import check_facts, megarl_source_digest
from megarl.submit.render import StopBudget

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"
GOLDEN = REPO / "tests" / "fixtures" / "sbatch"
PORT = FIRST_PORT + (JOB_ID % NUM_BLOCKS) * BLOCK_SIZE
PYTHON = "/opt/venv/bin/python"


@pytest.fixture(autouse=True)
def _submit_from_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the job's working directory is where megarl submit ran
    monkeypatch.setenv("PYTHONPATH", "/opt/megarl-src")


@pytest.mark.parametrize("variant, extra", [
    ("plain", ()),
    ("requeue-pyxis", ("--requeue", "--container-image", "nvcr.io/nvidia/pytorch:24.09-py3")),
    ("apptainer", ("--apptainer-image", "/images/megarl.sif")),
])
def test_golden_renders(tmp_path, capsys, variant, extra):
    script = render(tmp_path, capsys, 2, PYTHON, *extra).replace(str(tmp_path), "TMP").replace(str(Path.home()), "~")
    golden = GOLDEN / f"{variant}.sbatch"
    if os.environ.get("MEGARL_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(script)
    assert script == golden.read_text(), f"the render of {variant} changed; see the module docstring"


def _directives(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def test_directives_environment_and_budget(tmp_path, capsys):
    script = render(tmp_path, capsys, 2, PYTHON)
    budget = StopBudget.for_timeout(300)
    assert (budget.driver_s, budget.kill_driver_s, budget.teardown_s) == (300, 300 + budget.hard_exit_s + 15, 60)
    assert budget.signal_lead_s == budget.kill_driver_s + 60 + 15
    assert _directives(script) == [
        "#SBATCH --job-name=megarl-grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2", "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1", "#SBATCH --exclusive", "#SBATCH --mem=0",
        f"#SBATCH --output={tmp_path}/runs/grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2/logs/slurm-%j.out",
        "#SBATCH --open-mode=append", f"#SBATCH --chdir={tmp_path}", f"#SBATCH --signal=B:TERM@{budget.signal_lead_s}",
        "#SBATCH --no-requeue", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --time=2:00:00",
        "#SBATCH --qos=high",
    ]
    run_dir = tmp_path / "runs" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2"
    # The job runs the recipe and the sources frozen at submit; the frozen sources come first on PYTHONPATH.
    assert f"export PYTHONPATH={run_dir}/slurm/code:/opt/megarl-src\n" in script
    assert f"export MEGARL_RECIPE={run_dir}/slurm/recipe.yaml\n" in script
    assert f"export MEGARL_TERM_GRACE_S={budget.kill_driver_s}\nexport MEGARL_TEARDOWN_S=60\n" in script
    # One setting gives every deadline: a shorter driver budget moves them all.
    short = render(tmp_path, capsys, 2, PYTHON, "--set", "trainer.checkpoint.preempt_timeout_s=30")
    quick = StopBudget.for_timeout(30)
    assert f"#SBATCH --signal=B:TERM@{quick.signal_lead_s}" in _directives(short)
    assert f"export MEGARL_TERM_GRACE_S={quick.kill_driver_s}\n" in short
    # The NCCL environment from the recipe's cluster.env and from --env, for every node.
    assert "export NCCL_SOCKET_IFNAME=ib0\nexport NCCL_DEBUG=WARN\n" in script
    assert "trap megarl_on_term TERM INT\ntrap megarl_on_nodes_signalled USR1\ntrap megarl_teardown EXIT\n" in script
    # Per-job ports and temp dir, no user paths, no broad kill, no secret on a command line.
    assert 'MEGARL_RAY_TMPDIR=${MEGARL_RAY_TMPDIR:-/tmp/megarl-ray-$SLURM_JOB_ID}' in script
    commands = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"pkill|killall|ray stop|/home/|/root/", commands.replace(sys.executable, "PY"))
    # The Ray token is made in the job and lives in its environment only: no command is given it.
    assert [line.strip() for line in commands.splitlines() if "AUTH_TOKEN" in line] == [
        "RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n') || return 1", "export RAY_AUTH_TOKEN"]


def test_containers_mount_the_run_the_working_dir_and_the_inputs(tmp_path, capsys):
    requeued = render(tmp_path, capsys, 2, PYTHON, "--requeue", "--container-image", "img:1")
    assert "#SBATCH --requeue" in _directives(requeued)
    run_dir = tmp_path / "runs" / "grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2"
    home = Path("~").expanduser()
    # The run dir sits in the working dir: one mount covers both; the inputs' directories are mounted too.
    mounts = f"{tmp_path}:{tmp_path},/models/Qwen3-8B:/models/Qwen3-8B,{home}/data/gsm8k:{home}/data/gsm8k," \
             f"{home}/data/math:{home}/data/math"
    assert (f"MEGARL_SRUN_CONTAINER=(--container-image=img:1 "
            f"--container-name=megarl-grpo-qwen3-8b-gsm8k-math-2n8g-tp4pp2 --container-mounts={mounts} "
            "--no-container-mount-home)") in requeued
    assert "export MEGARL_PYTHON=python3\n" in render(tmp_path, capsys, 2, "python3", "--container-image", "img:1")
    apptainer = render(tmp_path, capsys, 2, PYTHON, "--apptainer-image", "/images/megarl.sif")
    assert (f"export MEGARL_CONTAINER_EXEC='apptainer exec --nv --bind {tmp_path},/models/Qwen3-8B,{home}/data/gsm8k,"
            f"{home}/data/math /images/megarl.sif'\n") in apptainer
    assert run_dir.as_posix() not in apptainer.split("--bind ")[1].split(" ")[0]  # covered by the working dir
    with pytest.raises(SystemExit) as refused:  # argparse: one container kind at a time
        main(["submit", str(QWEN), "--nodes", "2", "--dry-run", "--container-image", "a", "--apptainer-image", "b"])
    assert refused.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_input_paths_lists_what_the_recipe_reads():
    recipe = load_recipe(QWEN)
    home = Path("~").expanduser()
    assert input_paths(recipe) == [
        ("model.path", Path("/models/Qwen3-8B")), ("model.tokenizer", Path("/models/Qwen3-8B")),
        ("data.train_files[0]", home / "data/gsm8k/train.parquet"),
        ("data.train_files[1]", home / "data/math/train.parquet"),
        ("data.val_files[0]", home / "data/gsm8k/test.parquet"), ("data.val_files[1]", home / "data/math/test.parquet"),
    ]
    assert input_paths(load_recipe(QUICKSTART)) == []  # a built-in tokenizer and generated data


SBATCH = """#!/bin/bash
echo "sbatch $*" >>"$SHIM_LOG"
echo "4243;cluster"
"""


def _stand_ins(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm-calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SHIM_LOG", str(log))
    return log


def test_submit_freezes_the_resolved_recipe_and_the_sources(tmp_path, capsys, monkeypatch):
    log = _stand_ins(tmp_path, monkeypatch, sbatch=SBATCH, squeue="#!/bin/bash\n", sacct="#!/bin/bash\nexit 1\n",
                     scontrol="#!/bin/bash\nexit 1\n")
    argv = ["submit", str(QUICKSTART), "--nodes", "1", "--requeue", "--set", f"trainer.output_dir={tmp_path / 'runs'}",
            "--set", "trainer.total_steps=7"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "quickstart-grpo-cpu"
    assert f"submitted job 4243 (1 node(s)): run dir {run_dir}" in out
    assert "a preemption needs the partition's GraceTime >=" in out
    assert log.read_text() == f"sbatch --parsable {run_dir}/slurm/megarl.sbatch\n"
    frozen = load_recipe(run_dir / "slurm" / "recipe.yaml")
    assert frozen == load_recipe(QUICKSTART, [f"trainer.output_dir={tmp_path / 'runs'}", "trainer.total_steps=7"])
    code = run_dir / "slurm" / "code"
    source = json.loads((code / "SOURCE.json").read_text())
    assert source["digest"] == megarl_source_digest() and source["from"] == str(REPO / "megarl")
    assert (code / "megarl" / "processes.py").read_bytes() == (REPO / "megarl" / "processes.py").read_bytes()
    assert (code / "megarl" / "assets").is_dir() and not list(code.rglob("__pycache__"))
    # The frozen copy is what the job imports, with the same digest preflight compares across nodes.
    digest = subprocess.run([sys.executable, "-c", "from megarl.submit.preflight import megarl_source_digest as d; "
                             "import megarl; print(d(), megarl.__file__)"], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(code)}, check=True).stdout.split()
    assert digest == [megarl_source_digest(), str(code / "megarl" / "__init__.py")]
    record = json.loads((run_dir / "slurm" / "job.json").read_text())
    assert record["job_id"] == "4243" and record["requeue"] is True and record["recipe"] == str(QUICKSTART)


def test_submit_checks_the_inputs_it_can_see_and_names_those_it_cannot(tmp_path, capsys, monkeypatch):
    _stand_ins(tmp_path, monkeypatch, sbatch=SBATCH, squeue="#!/bin/bash\n", sacct="#!/bin/bash\nexit 1\n",
               scontrol="#!/bin/bash\nexit 1\n")
    base = ["submit", str(QUICKSTART), "--nodes", "1", "--set", f"trainer.output_dir={tmp_path / 'runs'}"]
    not_a_tokenizer = tmp_path / "tok"
    not_a_tokenizer.mkdir()
    assert main([*base, "--set", f"model.tokenizer={not_a_tokenizer}"]) == 2
    assert capsys.readouterr().err.startswith(f"error: model.tokenizer: ")
    assert not (tmp_path / "runs" / "quickstart-grpo-cpu" / "slurm" / "job.json").exists()
    # The cluster recipe's model and data live on the cluster's filesystems, not here: named, not refused.
    assert main(["submit", str(QWEN), "--nodes", "2", "--set", f"trainer.output_dir={tmp_path / 'runs'}"]) == 0
    out = capsys.readouterr().out
    home = Path("~").expanduser()
    assert [line for line in out.splitlines() if line.startswith("note: ")] == [
        f"note: {key}: {path} is not visible from this node; the job checks it on its nodes when it starts"
        for key, path in (("model.path", "/models/Qwen3-8B"), ("model.tokenizer", "/models/Qwen3-8B"),
                          ("data.train_files[0]", f"{home}/data/gsm8k/train.parquet"),
                          ("data.train_files[1]", f"{home}/data/math/train.parquet"),
                          ("data.val_files[0]", f"{home}/data/gsm8k/test.parquet"),
                          ("data.val_files[1]", f"{home}/data/math/test.parquet"))]


def _status_run(tmp_path: Path, *, starts: list[dict], log_lines: str = "", checkpoint: int | None = None) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / "slurm").mkdir(parents=True)
    log = run_dir / "logs" / "slurm-77.out"
    log.parent.mkdir()
    log.write_text(log_lines)
    (run_dir / "slurm" / "job.json").write_text(json.dumps({"job_id": "77", "log": str(log), "nodes": 2}))
    (run_dir / "slurm" / "job-77.jsonl").write_text("".join(json.dumps(start) + "\n" for start in starts))
    if checkpoint is not None:
        step = run_dir / "checkpoints" / f"step_{checkpoint}"
        step.mkdir(parents=True)
        from megarl.controller import checkpointing

        (step / checkpointing.MARKER).write_text(json.dumps({"format_version": checkpointing.FORMAT_VERSION,
                                                              "step": checkpoint}))
    return run_dir


# sacct without an accounting database answers only with --completion (the job completion log).
SACCT = """#!/bin/bash
echo "sacct $*" >>"$SHIM_LOG"
case "$*" in *--completion*) printf '%s\n' "$SHIM_SACCT" ;; *) echo "Slurm accounting storage is disabled" >&2; exit 1 ;; esac
"""


@pytest.mark.parametrize("starts, sacct, checkpoint, expected", [
    ([{"restart": 0, "status": 0}], "COMPLETED|0:0|00:09:00|n[1-2]", 5, "job 77: finished (Slurm state COMPLETED, "
                                                                          "exit code 0:0)"),
    ([{"restart": 0, "status": 75, "requeued": False}], "FAILED|75:0|00:03:00|n[1-2]", 3,
     "job 77: preempted, resumable from step 3 (Slurm state FAILED, exit code 75:0); resume: megarl submit "),
    ([], "PREEMPTED|0:0|00:01:00|n[1-2]", None, "job 77: preempted, no checkpoint yet (Slurm state PREEMPTED"),
    ([{"restart": 0, "status": 1}], "FAILED|1:0|00:00:40|n1", None,
     "job 77: failed: status 1: preflight: node n2: torch 2.5.1 differs from n1's 2.4.0 (Slurm state FAILED"),
])
def test_status_of_an_ended_job_comes_from_sacct_and_the_jobs_record(tmp_path, capsys, monkeypatch, starts, sacct,
                                                                      checkpoint, expected):
    log = _stand_ins(tmp_path, monkeypatch, squeue="#!/bin/bash\n", sacct=SACCT, scontrol="#!/bin/bash\nexit 1\n")
    monkeypatch.setenv("SHIM_SACCT", sacct)
    run_dir = _status_run(tmp_path, starts=starts, checkpoint=checkpoint,
                          log_lines="preflight: node n2: torch 2.5.1 differs from n1's 2.4.0\n")
    assert main(["submit", "--status", str(run_dir)]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith(expected), shown
    assert "sacct --completion --noheader --parsable2 --allocations --jobs 77" in log.read_text()


def test_status_of_a_running_job_and_cancel(tmp_path, capsys, monkeypatch):
    log = _stand_ins(tmp_path, monkeypatch, squeue="#!/bin/bash\necho 'RUNNING|1:02|n[1-2]|None'\n",
                     scancel='#!/bin/bash\necho "scancel $*" >>"$SHIM_LOG"\n')
    run_dir = _status_run(tmp_path, starts=[{"restart": 0, "status": 75, "requeued": True}])
    assert main(["submit", "--status", str(run_dir)]) == 0
    assert capsys.readouterr().out.startswith("job 77: RUNNING, on n[1-2], elapsed 1:02, 1 earlier start(s)\n")
    assert main(["submit", "--cancel", str(run_dir)]) == 0
    assert "job 77: sent SIGTERM to its batch script" in capsys.readouterr().out
    assert log.read_text() == "scancel --batch --signal=TERM 77\n"
    assert (run_dir / "slurm" / "cancel-77").exists()  # the job will not requeue itself


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
    # 8 named and 512 worker ports: Ray's idle workers for 128 CPUs plus the actors, three times over.
    assert WORKER_PORTS >= 3 * (128 + 40) and all(len(block) == 8 + WORKER_PORTS for block in blocks)
    assert len(set().union(*blocks)) == sum(len(block) for block in blocks)
    assert min(min(block) for block in blocks) == FIRST_PORT and max(max(block) for block in blocks) < 32768
    assert block_for(JOB_ID).named()["gcs"] == PORT and block_for(JOB_ID + NUM_BLOCKS).base == PORT
    monkeypatch.setenv("MEGARL_RAY_PORT_BASE", "15000")
    assert block_for(JOB_ID).base == 15000


