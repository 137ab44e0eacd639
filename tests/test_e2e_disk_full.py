"""End to end: the disk of a run fills up while it runs (a small tmpfs; the tests run as root).

`megarl train` writes step 1's checkpoint, then the disk is filled to 200 KB short of full: writing step 2's
checkpoint fails. The run must say so in one line (which path, how much is free, what is intact) and exit
with status 2, without a traceback; step 1's checkpoint stays complete and matches its digests, step 2 leaves
no partial directory, and the failed run leaves neither its Ray temp dir nor a shared-memory segment of any
of its processes behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megarl.controller.checkpointing import complete_steps, verify

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart-grpo-cpu.yaml"
SETTINGS = ["name=run", "trainer.total_steps=3", "trainer.checkpoint.save_every=1", "trainer.checkpoint.keep_last=0",
            "sft_warmup.steps=0", "trainer.val_every=0", "trainer.val_before_train=false", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size=64", "trainer.logging.console=false",
            "data.synthetic.num_train=200", "data.synthetic.num_val=10"]
TORCH_SHM = re.compile(r"torch_(\d+)_")


@pytest.fixture
def disk(tmp_path):
    """A 300 MiB tmpfs: room for a run to start (it wants 256 MiB free), small enough to fill at once."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.robust
@pytest.mark.e2e
@pytest.mark.slow
def test_a_full_disk_is_named_exits_2_and_keeps_the_previous_checkpoint(disk):
    scratch = Path(tempfile.mkdtemp(prefix="mr", dir="/tmp"))  # the run's own TMPDIR: its Ray temp dir goes there
    args = [sys.executable, "-m", "megarl", "train", str(RECIPE), "--set", f"trainer.output_dir={disk}"]
    for setting in SETTINGS:
        args += ["--set", setting]
    shm_before = set(os.listdir("/dev/shm"))
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": "1",
                                    "PYTHONPATH": str(REPO)})
    run_dir, pids = disk / "run", {process.pid}
    try:
        deadline = time.monotonic() + 600
        while not complete_steps(run_dir):
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step_1 checkpoint within 600 s"
            try:
                pids |= {child.pid for child in psutil.Process(process.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)
        with open(disk / "filler", "wb") as filler:
            filler.write(b"\0" * (shutil.disk_usage(disk).free - 200_000))
        status = process.wait(timeout=600)
        stderr = process.stderr.read()
    finally:
        process.kill()
        process.wait()
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in stderr, (status, stderr[-3000:])
    (line,) = lines
    step_1, step_2 = run_dir / "checkpoints" / "step_1", run_dir / "checkpoints" / "step_2"
    assert re.fullmatch(rf"error: cannot write {step_2}: No space left on device \(\d+ KiB free on its disk, "
                        rf"[\d.]+ MiB needed\); {step_1} is intact", line), line
    (checkpoint,) = complete_steps(run_dir)
    assert checkpoint.step == 1 and verify(checkpoint) == []
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == ["step_1"]
    # Nothing of the failed run is left: its Ray temp dir, its processes' shared memory, its footprint.
    leaked = [name for name in set(os.listdir("/dev/shm")) - shm_before
              if (match := TORCH_SHM.match(name)) and int(match.group(1)) in pids]
    assert list(scratch.glob("megarl-ray-*")) == [] and leaked == [] and not (run_dir / ".footprint.json").exists()
    shutil.rmtree(scratch, ignore_errors=True)
