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
