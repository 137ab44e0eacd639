"""Robustness tier: paths a user names are regular files or directories, and reading them always ends.

A FIFO blocks whoever opens it and a device such as /dev/zero says its size is 0 and never ends. Recipes (and
their base), model checkpoints and configs, tokenizers, data files and `megarl preprocess` inputs and outputs
that are one of them are refused with one line naming the path and what it is; `preprocess` also refuses
records it cannot parse without a traceback (nesting too deep for the JSON reader), final answers no response
could match, outputs that are or lie under a file, and names the file (and the space left) on a full disk.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megarl.cli import main

pytestmark = pytest.mark.robust

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart-grpo-cpu.yaml"
SMALL = ["data.synthetic.num_train=200", "data.synthetic.num_val=20", "sft_warmup.batch_size=64"]


def refused(capsys, *args: str) -> list[str]:
    """`megarl ARGS` in this process: exit 2, every stderr line an `error:` line; those lines."""
    status = main(list(args))
    lines = capsys.readouterr().err.splitlines()
    assert status == 2 and lines and all(line.startswith("error: ") for line in lines), (status, lines)
    return lines


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def test_validate_of_a_device_ends_at_once():
    """`megarl validate /dev/urandom` (size 0 to stat, endless to read) used to read until the OOM killer came."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "megarl", "validate", "/dev/urandom"], capture_output=True,
                            text=True, timeout=120)
    assert time.monotonic() - start < 120
    assert result.returncode == 2 and result.stderr == "error: /dev/urandom: is a character device, not a recipe file\n"


def test_recipe_and_base_that_are_fifos_are_refused_without_blocking(capsys, tmp_path, fifo):
    assert refused(capsys, "validate", str(fifo)) == [f"error: {fifo}: is a FIFO, not a recipe file"]
    child = tmp_path / "child.yaml"
    child.write_text(f"base: {fifo.name}\nname: child\n")
    assert refused(capsys, "validate", "--offline", str(child)) == [f"error: {fifo}: is a FIFO, not a recipe file"]


def _checkpoint(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4}
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"")
    return model


def test_model_paths_that_are_devices_or_hold_fifos_are_refused(capsys, tmp_path):
    lines = refused(capsys, "validate", str(QUICKSTART), *sum((["--set", s] for s in SMALL), []),
                    "--set", "model.path=/dev/null", "--set", "model.config=null")
    assert lines == ["error: --set: model.path: is a character device, not a directory (got '/dev/null')"]
    model = _checkpoint(tmp_path)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")  # reading it would wait for a writer forever
    lines = refused(capsys, "validate", str(QUICKSTART), "--set", f"model.path={model}", "--set", "model.config=null")
    assert lines == [f"error: --set: model.path: {model / 'config.json'}: is a FIFO, not a regular file "
                     f"(got '{model}')"]
    model = _checkpoint(tmp_path / "second")
    os.mkfifo(model / "model-00002-of-00002.safetensors")
    lines = refused(capsys, "validate", str(QUICKSTART), *sum((["--set", s] for s in SMALL), []),
                    "--set", f"model.path={model}", "--set", "model.config=null")
    assert f"error: model.path: {model / 'model-00002-of-00002.safetensors'}: is a FIFO, not a regular file " \
           f"(got '{model}')" in lines


def test_tokenizer_dirs_and_data_files_that_are_not_regular_are_refused(capsys, tmp_path, fifo):
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(REPO / "megarl" / "assets" / "tokenizer", tokenizer)
    (tokenizer / "tokenizer.json").unlink()
    os.mkfifo(tokenizer / "tokenizer.json")
    lines = refused(capsys, "validate", str(QUICKSTART), *sum((["--set", s] for s in SMALL), []),
                    "--set", f"model.tokenizer={tokenizer}", "--set", "data.synthetic=null",
                    "--set", f"data.train_files=[{fifo}, /dev/zero]", "--set", "data.val_files=[]",
                    "--set", "trainer.val_every=0", "--set", "sft_warmup.stop_accuracy=null")
    assert f"error: model.tokenizer: tokenizer '{tokenizer}': {tokenizer / 'tokenizer.json'}: is a FIFO, not a " \
           "regular file" in lines
    assert f"error: data.train_files: data file {fifo}: is a FIFO, not a regular file" in lines
    assert "error: data.train_files: data file /dev/zero: is a character device, not a regular file" in lines


def test_preprocess_refuses_inputs_that_are_not_data_and_outputs_under_files(capsys, tmp_path, fifo):
    source = tmp_path / "raw"
    source.mkdir()
    (source / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "so #### 7"}) + "\n")
    for path, kind in ((fifo, "a FIFO"), (Path("/dev/zero"), "a character device")):
        assert refused(capsys, "preprocess", "gsm8k", "--input", str(path), "--output", str(tmp_path / "out")) == [
            f"error: --input {path}: is {kind}, not a data file or directory"]
    assert refused(capsys, "preprocess", "math", "--input", str(source), "--output", "/dev/null") == [
        "error: --output /dev/null: is a character device, not a directory"]
    existing = tmp_path / "existing.parquet"
    existing.write_bytes(b"not a directory")
    assert refused(capsys, "preprocess", "gsm8k", "--input", str(source), "--output", str(existing / "a" / "b")) == [
        f"error: --output {existing / 'a' / 'b'}: its parent {existing} is a regular file, not a directory"]
    assert existing.read_bytes() == b"not a directory" and not (tmp_path / "out").exists()


def test_preprocess_refuses_records_too_deep_to_parse_and_answers_no_response_can_match(capsys, tmp_path):
    source = tmp_path / "raw"
    source.mkdir()
    deep = '{"question": ' + '{"a": ' * 60_000 + "1" + "}" * 60_000 + ', "answer": "#### 1"}'
    (source / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 7"}) + "\n" + deep + "\n")
    (source / "test.jsonl").write_text("".join(json.dumps({"question": "q", "answer": answer}) + "\n"
                                               for answer in ("so #### 2.5.1", "#### 12", "#### 3..4")))
    lines = refused(capsys, "preprocess", "gsm8k", "--input", str(source), "--output", str(tmp_path / "out"))
    assert lines == [f"error: {source / 'train.jsonl'} line 2: JSON nested too deeply to be a record"]
    (source / "train.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 7"}) + "\n")
    lines = refused(capsys, "preprocess", "gsm8k", "--input", str(source), "--output", str(tmp_path / "out"))
    hint = "its final answer is not a number a response could match (digits, an optional '-' and at most one " \
           "decimal point)"
    assert lines == [f"error: {source / 'test.jsonl'} line 1: field 'answer': {hint} (got '2.5.1')",
                     f"error: {source / 'test.jsonl'} line 3: field 'answer': {hint} (got '3..4')"]
    assert not (tmp_path / "out").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB tmpfs (the tests run as root; elsewhere the reason is given)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip() or made.returncode}): needs root")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_preprocess_on_a_full_disk_names_the_file_and_the_space_left(capsys, tmp_path, small_disk):
    source = tmp_path / "raw"
    source.mkdir()
    # Random text does not compress: ~3 MB of train rows cannot fit in 2 MiB.
    (source / "train.jsonl").write_text("".join(json.dumps({"question": os.urandom(500).hex(), "answer": "#### 4"})
                                                + "\n" for _ in range(3000)))
    (source / "test.jsonl").write_text(json.dumps({"question": "q", "answer": "#### 4"}) + "\n")
    out = small_disk / "gsm8k"
    (line,) = refused(capsys, "preprocess", "gsm8k", "--input", str(source), "--output", str(out))
    assert line.startswith(f"error: cannot write {out / 'train.parquet'}: No space left on device (")
    free = re.search(r"\((\d+) (KiB|MiB) free on its disk\)$", line)
    assert free and (free.group(2) == "KiB" or int(free.group(1)) < 2), line
    assert list(out.iterdir()) == []
