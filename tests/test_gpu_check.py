"""`benchmarks/gpu_check.sh` off the GPU: the wheels it fetches are the GPU machine's, and its report says what ran.

The GPU machine runs Python 3.12 with nothing reachable: `--download` must ask pip for
CPython 3.12 manylinux wheels whatever Python runs it (pip itself is stubbed here,
recording its arguments), with a floor on megatron-core (whose 0.19 wheels carry only
manylinux_2_28 tags; without that tag pip falls back to megatron-core 0.3.0). The
report (`benchmarks/gpu_report.py`) is fed the JUnit XML of a small pytest run with a
pass, a skip with its reason and a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_report  # noqa: E402


def test_download_fetches_wheels_for_the_gpu_machines_python(tmp_path):
    stub_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    stub_dir.mkdir()
    stub = stub_dir / "python3"
    stub.write_text(f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then echo "$@" >> {log}; exit 0; fi\n'
                    f'exec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub_dir}:{os.environ['PATH']}"}
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--download", str(tmp_path / "wheels")], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    megatron, packages = [line.split() for line in log.read_text().splitlines()]
    for call in (megatron, packages):
        assert call[:3] == ["-m", "pip", "download"]
        assert call[call.index("--python-version") + 1] == "3.12"
        platforms = [call[i + 1] for i, arg in enumerate(call) if arg == "--platform"]
        assert platforms == ["manylinux2014_x86_64", "manylinux_2_28_x86_64"]
        assert "--only-binary=:all:" in call
    assert "megatron-core>=0.16" in megatron and "--no-deps" in megatron
    assert {"pydantic", "pyyaml", "fastapi", "uvicorn", "aiohttp", "psutil"} <= set(packages)
    assert "CPython 3.12" in result.stdout


SAMPLE_TESTS = '''
import pytest

def test_runs():
    pass

@pytest.mark.skipif(True, reason="NCCL refuses two ranks of one communicator on one GPU: needs 2 GPUs")
def test_needs_two_gpus():
    pass

def test_breaks():
    assert 1 == 2, "one is not two"
'''


def _junit(tmp_path: Path, source: str) -> Path:
    (tmp_path / "test_sample.py").write_text(source)
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", str(tmp_path / "test_sample.py"), "-p", "no:cacheprovider",
                    "-q", f"--junitxml={junit}"], cwd=tmp_path, capture_output=True, timeout=120)
    return junit


def test_the_report_names_what_ran_and_what_was_skipped_and_why(tmp_path, capsys):
    junit = _junit(tmp_path, SAMPLE_TESTS)
    code = gpu_report.main([str(junit), str(tmp_path / "out.json"), "1", "3"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert lines[0].startswith("gpu_check: {'passed': 1, 'failed': 1, 'error': 0, 'skipped': 1} in 3 s")
    assert lines[1] == "ran 2 tests:"
    assert lines[2].startswith("  passed  test_sample::test_runs (")
    assert lines[3].startswith("  failed  test_sample::test_breaks (") and "one is not two" in lines[3]
    assert lines[4:] == ["skipped 1 tests:", "  skipped test_sample::test_needs_two_gpus: NCCL refuses two ranks "
                         "of one communicator on one GPU: needs 2 GPUs"]
    report = json.loads((tmp_path / "out.json").read_text())
    assert report["ok"] is False and report["counts"]["skipped"] == 1
    assert {"python", "torch", "cuda", "gpus", "megatron_core", "importable"} <= set(report["environment"])


def test_a_run_without_failures_is_ok_and_a_missing_junit_file_is_an_error(tmp_path, capsys):
    junit = _junit(tmp_path, SAMPLE_TESTS.split("def test_breaks")[0])
    assert gpu_report.main([str(junit), str(tmp_path / "out.json"), "0", "2"]) == 0
    assert gpu_report.main([str(tmp_path / "absent.xml"), str(tmp_path / "out.json"), "124", "330"]) == 1
    assert "  error   pytest (0.0 s): " in capsys.readouterr().out
