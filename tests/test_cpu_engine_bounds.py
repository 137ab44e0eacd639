"""Robustness tier (`pytest -m robust`): the CPU engine bounds its work and its start-up, and keeps its key secret.

- A request whose reply could exceed `--max-reply-entries` (n x tokens x (1 + top_logprobs_num)) or that asks
  for more than `--max-sequences` sequences is refused with 400 naming the limit, before any work.
- A large body is parsed off the event loop: /model_info and /health answer within a second meanwhile.
- Inputs that used to end in a 500 are 4xx naming the field or file: text that is no Unicode, a weight-update
  group of absurd size, a checkpoint with a garbage safetensors header.
- Bad start-up arguments are one line and exit status 2; the API key travels in a `--config` file only its
  owner can read, never on the command line.
"""

from __future__ import annotations

import json
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _http import call as http_call
from _tiny import served_model
from test_cpu_engine import API_KEY, VOCAB, call, word_tokenizer

from megarl.rollout.server import spawn_server


pytestmark = [pytest.mark.robust, pytest.mark.dist]

MAX_SEQUENCES = 8
MAX_REPLY_ENTRIES = 5_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds_model")
    served_model(0).save_pretrained(root)
    word_tokenizer(eos=2).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def server(model_dir, cpu_engine):
    # A fresh process, not a fork: its command line is what a test below reads.
    return cpu_engine(model_dir, api_key=API_KEY, max_sequences=MAX_SEQUENCES, max_reply_entries=MAX_REPLY_ENTRIES,
                      spawn=spawn_server)


def generate(server, **body) -> tuple[int, dict]:
    return call(server, "/generate", {"input_ids": [5, 6, 7], **body})


@pytest.mark.parametrize("body, needle", [
    # 3 prompts x n=3 = 9 sequences
    ({"input_ids": [[5, 6]] * 3, "sampling_params": {"n": 3, "max_new_tokens": 1}}, "--max-sequences is 8"),
    # 2 x 50 tokens x (1 + 64 alternatives) = 6500 entries
    ({"sampling_params": {"n": 2, "max_new_tokens": 50}, "return_logprob": True, "top_logprobs_num": 64},
     "--max-reply-entries is 5000"),
    # the prompt's own scored tokens count too: 1 x (1 + 100) x (1 + 49) = 5050
    ({"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
      "logprob_start_len": 0, "top_logprobs_num": 49}, "would hold 5050 token entries"),
    # one sample per prompt, but many prompts: 8 x 200 x (1 + 3) = 6400
    ({"input_ids": [[5, 6]] * 8, "sampling_params": {"max_new_tokens": 200}, "return_logprob": True,
      "top_logprobs_num": 3}, "--max-reply-entries"),
])
def test_requests_that_would_amplify_into_a_huge_reply_are_refused_naming_the_limit(server, body, needle):
    status, reply = call(server, "/generate", {"input_ids": [5, 6, 7], **body})
    assert status == 400 and needle in reply["error"]["message"], reply


def test_a_reply_at_the_limit_is_served(server):
    # 2 x 10 tokens x (1 + 9) = 200 entries, well inside; the count is of what is asked, not of what stops early.
    status, reply = generate(server, sampling_params={"n": 2, "max_new_tokens": 10, "ignore_eos": True},
                             return_logprob=True, top_logprobs_num=9)
    assert status == 200 and len(reply) == 2 and len(reply[0]["meta_info"]["output_top_logprobs"][0]) == 9


def test_a_large_body_is_parsed_off_the_event_loop_so_info_and_health_answer_within_a_second(server):
    """10 MB of token ids (within the default 16 MB body limit; refused as too long for the context) while
    /model_info and /health are asked."""
    body = json.dumps({"input_ids": list(range(VOCAB)) * 4_000, "sampling_params": {"max_new_tokens": 1}}).encode()
    done = threading.Event()
    result = {}

    def send():
        result["big"] = call(server, "/generate", raw=body)
        done.set()

    thread = threading.Thread(target=send)
    thread.start()
    latencies = []
    while not done.is_set():
        for path, key in (("/model_info", API_KEY), ("/health", None)):
            start = time.monotonic()
            assert http_call(server.url, path, method="GET", key=key, timeout=10)[0] == 200
            latencies.append(time.monotonic() - start)
    thread.join(60)
    assert result["big"][0] == 400 and "context length" in result["big"][1]["error"]["message"]
    assert latencies and max(latencies) < 1.0, latencies


@pytest.mark.parametrize("raw, field", [
    (b'{"text": "abc\\ud83d"}', "text"),                                    # an escape: a lone high surrogate
    (b'{"text": ["ok", "x\xed\xb0\x80y"]}', "text[1]"),                     # raw bytes of a lone low surrogate
    (b'{"input_ids": [5], "sampling_params": {"stop": "\\udfff"}}', "sampling_params.stop"),
])
def test_text_that_is_no_unicode_is_400_naming_the_field(server, raw, field):
    status, reply = call(server, "/generate", raw=raw)
    assert status == 400 and f"{field}: not valid Unicode text" in reply["error"]["message"], reply


@pytest.mark.parametrize("world_size", [2 ** 40, 2 ** 31, (1 << 16) + 1])
def test_an_absurd_update_group_size_is_400_naming_it(server, world_size):
    status, reply = call(server, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": 29999, "rank_offset": 1, "world_size": world_size,
        "backend": "gloo"})
    assert status == 400 and "world_size" in reply["message"], reply


def _garbage_headers(root: Path) -> dict[str, Path]:
    """Checkpoint dirs whose one safetensors file has a header no reader can use."""
    cases = {
        "length beyond the file": struct.pack("<Q", 1 << 40) + b"{}",
        "not JSON": struct.pack("<Q", 8) + b"\x00\x01garbage",
        "truncated": b"\x10\x00",
    }
    dirs = {}
    for name, content in cases.items():
        target = root / name.replace(" ", "-")
        target.mkdir()
        (target / "model.safetensors").write_bytes(content)
        dirs[name] = target
    return dirs


def test_a_checkpoint_with_a_garbage_safetensors_header_is_400_naming_the_file(server, tmp_path):
    for name, path in _garbage_headers(tmp_path).items():
        status, reply = call(server, "/update_weights_from_disk", {"model_path": str(path), "flush_cache": False})
        assert status == 400 and "not a readable safetensors file" in reply["message"], (name, reply)
        assert str(path / "model.safetensors") in reply["message"]
    assert call(server, "/health", method="GET", key=None)[0] == 200


def _run_server(*args) -> subprocess.CompletedProcess:
    # Generous: importing torch alone takes most of a minute on a loaded 2-core machine.
    return subprocess.run([sys.executable, "-m", "megarl.rollout.cpu_engine", *args], capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("case", ["tokenizer", "safetensors", "model-config", "nan", "inf", "config-suffix",
                                  "config-missing", "config-list", "zero-sequences"])
def test_bad_start_up_arguments_are_one_line_exit_2(model_dir, tmp_path, case):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model_dir / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(struct.pack("<Q", 999) + b"[1, 2")
    (tmp_path / "unreadable").mkdir()
    (tmp_path / "unreadable" / "config.json").write_text("{not a config")
    (tmp_path / "list.yaml").write_text("- api-key\n- k\n")
    (tmp_path / "args.json").write_text("{}")
    model = ["--model-path", str(model_dir)]
    args, needle = {
        "tokenizer": (model + ["--tokenizer-path", str(tmp_path / "nope")], "--tokenizer-path: "),
        "safetensors": (["--model-path", str(broken)], "is not a readable safetensors file"),
        "model-config": (["--model-path", str(tmp_path / "unreadable")],
                         f"{tmp_path / 'unreadable' / 'config.json'} is not an HF model config (JSONDecodeError"),
        "nan": (model + ["--weight-update-group-timeout-s", "nan"], "must be a positive number of seconds (got nan)"),
        "inf": (model + ["--health-check-timeout-s", "inf"], "--health-check-timeout-s: must be a positive number"),
        "config-suffix": (model + ["--config", str(tmp_path / "args.json")], "is not a YAML file"),
        "config-missing": (model + ["--config", str(tmp_path / "none.yaml")], "--config: cannot read"),
        "config-list": (model + ["--config", str(tmp_path / "list.yaml")], "must hold a mapping of flag names"),
        "zero-sequences": (model + ["--max-sequences", "0"], "--max-sequences: must be >= 1"),
    }[case]
    result = _run_server(*args)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].count("error:") == 1


def test_the_key_travels_in_a_config_file_only_its_owner_reads_never_on_the_command_line(server):
    secrets = server.secrets_path
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o600
    assert API_KEY not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
    assert "--config" in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
    assert call(server, "/model_info", method="GET", key=None)[0] == 401
    assert call(server, "/model_info", method="GET", key=API_KEY)[0] == 200
