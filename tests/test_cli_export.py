"""`megarl export` on bad input: exit 2 with one line naming the checkpoint, no traceback."""

import subprocess
import sys


def test_export_of_a_dir_that_is_not_a_checkpoint_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "megarl", "export", str(tmp_path / "missing"), "--hf", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint {tmp_path / 'missing'}: megarl_checkpoint.json not found "
        "(not a megarl checkpoint, or incomplete)"
    ]
    assert not (tmp_path / "out").exists()


def _export(*args):
    return subprocess.run([sys.executable, "-m", "megarl", "export", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_a_step_dir_exports_its_actor_or_the_role_asked_for(tmp_path):
    # A run's step dir (its marker, one dir per role); the actor's checkpoint is gone, so the error names the path
    # that export chose.
    step = tmp_path / "checkpoints" / "step_10"
    for role in ("actor", "critic"):
        (step / role).mkdir(parents=True)
    from megarl.controller.checkpointing import MARKER

    (step / MARKER).write_text("{}")
    result = _export(step, "--hf", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: checkpoint {step / 'actor'}: megarl_checkpoint.json not found "
                                     "(not a megarl checkpoint, or incomplete)")
    result = _export(step, "--role", "reference", "--hf", tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --role: {step} holds no checkpoint of role 'reference'; it holds actor, critic"
    assert not (tmp_path / "out").exists()


def test_exported_weights_get_the_users_umask_not_0600(tmp_path):
    import os

    import torch

    from megarl.engines.export import ShardedWriter

    previous = os.umask(0o027)
    try:
        writer = ShardedWriter(tmp_path, max_bytes=10**6)
        writer.add("w", torch.zeros(4))
        writer.close()
    finally:
        os.umask(previous)
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == oct(0o640)
