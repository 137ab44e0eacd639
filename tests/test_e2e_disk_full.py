"""End to end: the disk of a run fills up while it runs (a small tmpfs; the tests run as root).

`megarl train` writes step 1's checkpoint, then the disk is filled to 200 KB short of full: writing the next
checkpoint fails (step 2's, or step 3's when the run, a step a second, saved step 2 before the filling was
done). The run must say so in one line (which path, how much is free, what is intact) and exit with status 2,
without a traceback; the checkpoints before it stay complete and match their digests, the failed one leaves
no partial directory, and the failed run leaves neither its Ray temp dir nor a shared-memory segment of any
of its processes behind.
"""

from __future__ import annotations

import errno
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
SETTINGS = ["name=run", "trainer.total_steps=6", "trainer.checkpoint.save_every=1", "trainer.checkpoint.keep_last=0",
            "sft_warmup.steps=0", "trainer.val_every=0", "trainer.val_before_train=false", "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size=64", "trainer.logging.console=false",
            "data.synthetic.num_train=200", "data.synthetic.num_val=10"]
TORCH_SHM = re.compile(r"torch_(\d+)_")
# A scan of the run's descendants reads every process's /proc entry (~10 ms on a busy machine): done every
# RECORD_EVERY_S, while the step-1 checkpoint is looked for every POLL_S (the filling must follow it closely).
POLL_S, RECORD_EVERY_S = 0.02, 0.25
LEAVE = 200_000  # bytes left free: room for a log line, not for a checkpoint


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
    # Lazily: a failed run's Ray head, stopped by its watchdog a second after the driver, may still hold a file.
    subprocess.run(["umount", "--lazy", str(mount)], check=True)


def _fill(disk: Path, *, leave: int) -> None:
    """Fill `disk` up to `leave` bytes short of full (adding to its filler), also when the run writes meanwhile
    (then the write falls short or finds no room at all, and the filler gives `leave` bytes back)."""
    size = shutil.disk_usage(disk).free - leave
    if size <= 0:
        return
    with open(disk / "filler", "ab", buffering=0) as filler:
        before = filler.tell()
        try:
            written = filler.write(b"\0" * size)
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
            written = 0
        if written < size:
            filler.truncate(max(before + written - leave, 0))


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

    def record() -> None:
        try:
            pids.update(child.pid for child in psutil.Process(process.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    try:
        deadline, recorded = time.monotonic() + 600, 0.0
        while not complete_steps(run_dir):
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no step_1 checkpoint within 600 s"
            if time.monotonic() - recorded >= RECORD_EVERY_S:
                record()
                recorded = time.monotonic()
            time.sleep(POLL_S)
        _fill(disk, leave=LEAVE)
        # Room the run gives back (a save's temporary files) is filled again, so a later save still meets a full
        # disk: once, the run freed what it held while the filler found no room, and all its saves succeeded.
        deadline = time.monotonic() + 600
        while process.poll() is None:
            assert time.monotonic() < deadline, "the run did not end within 600 s of the filling"
            if shutil.disk_usage(disk).free > 2 * LEAVE:
                _fill(disk, leave=LEAVE)
            if time.monotonic() - recorded >= RECORD_EVERY_S:
                record()
                recorded = time.monotonic()
            time.sleep(POLL_S)
        status = process.returncode
        stderr = process.stderr.read()
    finally:
        process.kill()
        process.wait()
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert status == 2 and "Traceback" not in stderr, (status, stderr[-3000:])
    (line,) = lines
    # The first save after the filling failed; every one before it is whole (keep_last=0 keeps them all).
    saved = complete_steps(run_dir)
    intact, failed = saved[-1], run_dir / "checkpoints" / f"step_{saved[-1].step + 1}"
    assert [checkpoint.step for checkpoint in saved] == list(range(1, intact.step + 1)) and intact.step < 6
    assert re.fullmatch(rf"error: cannot write {failed}: No space left on device \(\d+ KiB free on its disk, "
                        rf"[\d.]+ MiB needed\); {intact.path} is intact", line), line
    assert all(verify(checkpoint) == [] for checkpoint in saved)
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [
        f"step_{step}" for step in range(1, intact.step + 1)]
    # Nothing of the failed run is left: its Ray temp dir, its processes' shared memory, its footprint.
    leaked = [name for name in set(os.listdir("/dev/shm")) - shm_before
              if (match := TORCH_SHM.match(name)) and int(match.group(1)) in pids]
    assert list(scratch.glob("megarl-ray-*")) == [] and leaked == [] and not (run_dir / ".footprint.json").exists()
    shutil.rmtree(scratch, ignore_errors=True)
