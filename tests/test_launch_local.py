"""launch/local.sh: the Slurm job's bring-up on one machine: Ray head, preflight, registration, driver, teardown."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LOCAL = REPO / "launch" / "local.sh"
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"


def _local(tmp_path: Path, *overrides: str, timeout_s: float = 600) -> subprocess.CompletedProcess:
    argv = ["bash", str(LOCAL), str(QUICKSTART), "--set", f"trainer.output_dir={tmp_path}", "--set", "name=local"]
    for override in overrides:
        argv += ["--set", override]
    return subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=timeout_s)


def _processes_with(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def test_local_launcher_refuses_bad_input_before_starting_anything(tmp_path):
    launched = _local(tmp_path, "trainer.total_steps=0", "placement.nodes=2")
    assert launched.returncode == 2, launched.stderr
    assert "error: --set: trainer.total_steps: Input should be greater than 0" in launched.stderr
    assert not (tmp_path / "local").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_local_launcher_runs_a_recipe_and_stops_what_it_started(tmp_path):
    # No checkpoint: nothing here reads it, and its save is seconds of the run.
    launched = _local(tmp_path, "trainer.total_steps=1", "trainer.val_every=0", "sft_warmup.steps=0",
                      "data.synthetic.num_train=128", "trainer.logging.console=false",
                      "trainer.checkpoint.enabled=false")
    output = launched.stdout + launched.stderr
    assert launched.returncode == 0, output[-4000:]
    records = [json.loads(line) for line in (tmp_path / "local" / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == [1]
    assert records[0]["rollout/logprob_diff"] < 1e-4
    host = socket.gethostname().split(".")[0]
    assert f"1 node(s) registered with 1 CPU each: {host}" in output
    assert "driver exited with status 0\n" in output and "torn down; exit status 0" in output
    # The run's Ray: on loopback, in a temp dir of its own that is gone now; its logs kept in the run dir.
    temp_dir = re.search(r"ray head at 127\.0\.0\.1:\d+ \(temp dir (\S+)\)", output).group(1)
    assert not Path(temp_dir).exists()
    assert (tmp_path / "local" / "logs" / f"ray-{host}-local" / "raylet.out").exists()
    assert _processes_with(f"MEGARL_RAY_TMPDIR={temp_dir}\0") == []
