"""The CPU engine is as strict as SGLang 0.5.23, and each strictness catches the bug it exists for.

SGLang's behaviour, read from its source: `SafeUnpickler` (srt/utils/common.py), the
scheduler's `assert flush_cache_success` after an update and `assert self.is_fully_idle()`
before a memory release (srt/managers/scheduler_update_weights_mixin.py; unguarded, so
the scheduler and the server die), `UpdateWeightVersionReqInput.abort_all_requests = True`
(srt/managers/io_struct.py), `/health` running a one-token generation with a 20 s
timeout unless `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` is false (srt/entrypoints/http_server.py), and the tokenizer manager's model-update lock.
Failures that kill SGLang's server kill this one too: those tests use a server of their own.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _settings import sampling
from _server_fork import fork_server
from _tiny import greedy_continuation
from test_cpu_engine import (
    API_KEY,
    PROMPTS,
    call,
    generate,
    greedy_body,
    logprobs_of,
    reference_logprobs,
    start_long_request,
    wait_running,
)
from _http import weight_checksums
from test_weight_wire import FlattenedTensorMetadata
from starlette.requests import Request
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from megarl.models import arch_from_hf, hf_to_megatron
from megarl.rollout import RolloutClient, RolloutFleet, ServerSpec
from megarl.rollout.fleet_member import FleetMember
from megarl.rollout.cpu_engine.generate_routes import health
from megarl.rollout.server import start_cpu_engine
from megarl.rollout.server_host import ServerHost
from megarl.rollout.weight_wire import (
    deserialize_named_tensors,
    flatten_bucket,
    serialize_named_tensors,
    serialize_payload,
    tensor_checksum,
)
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, build_plan
from megarl.weightsync.tensor_transport import TensorTransport

pytestmark = pytest.mark.dist

HEALTH_TIMEOUT_S = 1.0
# Large enough that its weights dominate the server's memory (85 MB in float32), small enough to load in seconds.
CONFIG = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=1376, max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict_models")
    for seed, name in [(0, "base"), (1, "other")]:
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(root / name)
    return {"root": root, **{name: root / name for name in ("base", "other")}}


@pytest.fixture(scope="module")
def reference(models):
    return AutoModelForCausalLM.from_pretrained(str(models["base"]), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def other(models):
    return AutoModelForCausalLM.from_pretrained(str(models["other"]), attn_implementation="eager").eval()


def start(models, name: str, **options):
    return start_cpu_engine(models["base"], api_key=API_KEY, log_path=models["root"] / f"{name}.log",
                            weight_version="v0", health_check_timeout_s=HEALTH_TIMEOUT_S, spawn=fork_server,
                            **options)


@pytest.fixture(scope="module")
def server(models, cpu_engine):
    """The module's server: memory saver on, no host copy of the weights, 1 s health timeout."""
    return cpu_engine(models["base"], api_key=API_KEY, weight_version="v0", health_check_timeout_s=HEALTH_TIMEOUT_S,
                      enable_memory_saver=True)


def fatal(handle, status_reply, pattern: str) -> None:
    """The request was answered 500 naming the cause, and the server process exited, as SGLang's does."""
    status, reply = status_reply
    assert status == 500 and re.search(pattern, reply["message"]), (status, reply)
    handle.process.wait(timeout=30)
    assert handle.process.returncode == 1
    assert re.search(pattern, handle.log_tail())


def doomed_request(handle) -> threading.Thread:
    """A long request on a server about to die: its connection breaks, which is expected."""
    def run() -> None:
        try:
            call(handle, "/generate", greedy_body(PROMPTS[0], max_new_tokens=240))
        except OSError:
            pass

    thread = threading.Thread(target=run)
    thread.start()
    wait_running(handle)
    return thread


def restore(handle, models) -> None:
    status, reply = call(handle, "/update_weights_from_disk", {"model_path": str(models["base"]),
                                                               "weight_version": "v0"})
    assert status == 200 and reply["success"], reply


def test_own_metadata_class_is_refused_by_name_and_the_memory_saver_needs_its_flag(models):
    """megarl's old tensor transport pickled its own metadata class: SGLang's allow-list of exact globals
    refuses it, in SGLang's words, and nothing is loaded. Also: without --enable-memory-saver a release is
    refused (SGLang would answer success and free nothing, leaving the trainer without memory)."""
    handle = start(models, "own-class")
    try:
        status, reply = call(handle, "/release_memory_occupation", {"tags": ["weights"]})
        assert status == 400 and "--enable-memory-saver" in reply["message"]
        named = [("model.norm.weight", torch.ones(512))]
        flat = flatten_bucket(named)
        own = [FlattenedTensorMetadata(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel)
               for m in flat["metadata"]]
        entry = serialize_payload({"flattened_tensor": flat["flattened_tensor"], "metadata": own})
        assert call(handle, "/begin_weight_update", {})[0] == 200
        status, reply = call(handle, "/update_weights_from_tensor",
                             {"serialized_named_tensors": [entry], "load_format": "flattened_bucket"})
        assert status == 400 and reply["message"].endswith(
            "Blocked unsafe global (test_weight_wire.FlattenedTensorMetadata) during pickle deserialization")
        assert call(handle, "/health", method="GET", key=None)[0] == 200
    finally:
        handle.stop()


def test_flushing_the_cache_while_paused_requests_run_kills_the_server_and_megarls_sync_does_not(
        server, models, other):
    """SGLang asserts that the cache flush after an update succeeds; it fails while requests paused in place
    still run. megarl's session pauses in place, so its transports send flush_cache: false and it publishes
    the version without aborting: the in-flight request survives and finishes on the new weights."""
    thread, holder = start_long_request(server, greedy_body(PROMPTS[0], max_new_tokens=200))
    wait_running(server)
    assert call(server, "/pause_generation", {"mode": "in_place"})[0] == 200  # held in flight through the sync
    plan = build_plan(arch_from_hf(other.config.to_dict()), TrainerLayout(), dtype=torch.float32,
                      bucket_bytes=8 * 2**20)
    full = hf_to_megatron(dict(other.state_dict()), arch_from_hf(other.config.to_dict()),
                          padded_vocab=plan.padded_vocab)
    try:
        with RolloutClient([server.url], api_key=API_KEY, timeout_s=120) as client:
            syncer = WeightSyncer(plan, TensorTransport(client), SyncGroups.build(RankCoords(), timeout_s=60),
                                  client=client, verify=True)
            syncer.push({(0, name): tensor for name, tensor in full.items()}, weight_version="synced")
            syncer.close()
        thread.join(timeout=120)
        meta = holder["reply"]["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 200} and meta["weight_version"] == "synced"
    finally:
        restore(server, models)

    handle = start(models, "flush")
    try:
        thread = doomed_request(handle)
        assert call(handle, "/pause_generation", {"mode": "in_place"})[0] == 200
        assert call(handle, "/begin_weight_update", {})[0] == 200
        entry = serialize_named_tensors([("model.norm.weight", torch.ones(512))])
        fatal(handle, call(handle, "/update_weights_from_tensor", {"serialized_named_tensors": [entry]}),
              r"Cache flush failed after updating weights: flush_cache is true while 1 requests run")
        thread.join(timeout=30)
    finally:
        handle.stop()


def test_releasing_memory_while_requests_run_kills_the_server(models):
    handle = start(models, "busy-release", enable_memory_saver=True)
    try:
        thread = doomed_request(handle)
        fatal(handle, call(handle, "/release_memory_occupation", {}),
              r"release_memory_occupation should be called only when server is idle \(1 requests run")
        thread.join(timeout=30)
    finally:
        handle.stop()


def test_publishing_a_version_aborts_requests_unless_told_not_to(server):
    thread, holder = start_long_request(server, greedy_body(PROMPTS[1], max_new_tokens=240))
    wait_running(server)
    assert call(server, "/update_weight_version", {"new_version": "kept", "abort_all_requests": False})[0] == 200
    time.sleep(0.2)
    assert thread.is_alive()
    assert call(server, "/update_weight_version", {"new_version": "v0"})[0] == 200  # SGLang's default: abort all
    thread.join(timeout=30)
    assert holder["reply"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_health_blocks_then_fails_while_paused_so_the_fleet_probes_liveness_elsewhere(server):
    """`/health` runs a one-token generation: during a weight update (generation paused) it answers 503 after
    its timeout. A fleet that took that for death would restart every server on every sync."""
    assert call(server, "/health", method="GET", key=None)[0] == 200
    member = FleetMember(0, _RunningHost(), api_key=API_KEY, url=server.url)
    assert call(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        started = time.monotonic()
        assert call(server, "/health", method="GET", key=None)[0] == 503
        assert call(server, "/health_generate", method="GET", key=None)[0] == 503
        assert time.monotonic() - started >= 2 * HEALTH_TIMEOUT_S
        assert member.alive()
    finally:
        assert call(server, "/continue_generation", {})[0] == 200
    assert call(server, "/health", method="GET", key=None)[0] == 200


def test_an_update_made_without_pausing_waits_for_running_requests(server, models, reference, other):
    """SGLang's model-update lock: an update sent while generation runs waits for the running requests (which
    finish on the old weights) and holds new ones back, rather than changing weights under them."""
    thread, holder = start_long_request(server, greedy_body(PROMPTS[1], max_new_tokens=240))
    wait_running(server)
    try:
        status, reply = call(server, "/update_weights_from_disk", {"model_path": str(models["other"]),
                                                                   "weight_version": "other"})
        assert status == 200 and reply["success"], reply
        assert not thread.is_alive()  # the update was applied only after the request had finished
        # Every token came from the old weights: none changed under the running request.
        assert holder["reply"]["meta_info"]["weight_version"] == "v0"
        assert holder["reply"]["output_ids"] == greedy_continuation(reference, PROMPTS[1], 240)
        after = generate(server, greedy_body(PROMPTS[2], max_new_tokens=4))
        assert after["output_ids"] == greedy_continuation(other, PROMPTS[2], 4)
    finally:
        restore(server, models)


class _RunningHost:
    """A server host whose process is running (the fleet asks it for the exit code)."""

    def call(self, method, *args):
        assert method is ServerHost.exit_code
        return None


def health_status(path: str, engine) -> int:
    """The status `path` answers, asked of the route's handler in this process."""
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(engine=engine)))
    request = Request({"type": "http", "method": "GET", "path": path, "headers": [], "query_string": b"", "app": app})
    return asyncio.run(health(request)).status_code


@pytest.mark.parametrize("value, generates", [(None, True), ("0", False), ("false", False), ("No", False),
                                              ("1", True), ("YES", True)])
def test_health_generates_unless_its_environment_turns_health_generation_off(monkeypatch, value, generates):
    """SGLang's `/health` (http_server.py): with `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION` false it answers
    200 without generating; `/health_generate` always generates. On released memory a generation is the
    loud 500, and the stub engine has no scheduler to generate with: a 200 generated nothing."""
    if value is None:
        monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", raising=False)
    else:
        monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", value)
    released = SimpleNamespace(memory=SimpleNamespace(released={"weights": 1}))
    assert health_status("/health", released) == (500 if generates else 200)
    assert health_status("/health_generate", released) == 500
    assert health_status("/health", None) == 503  # still starting, as on SGLang whatever the switch


def test_an_invalid_health_generation_switch_warns_and_keeps_sglangs_default(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "off")
    released = SimpleNamespace(memory=SimpleNamespace(released={"weights": 1}))
    with pytest.warns(UserWarning, match=r'Invalid value for SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION: "off" is '
                                         r'not a valid boolean value, using default "True"'):
        assert health_status("/health", released) == 500


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_release_really_frees_the_weights_refuses_work_and_resume_needs_a_push(server, models, reference, other):
    weight_bytes = sum(t.numel() * 4 for t in reference.state_dict().values())
    before_digests = weight_checksums(server.url, key=API_KEY)
    resident = rss_bytes(server.pid)
    assert call(server, "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})[0] == 200
    # The weights' memory went back to the OS (independent of the server's own account).
    assert resident - rss_bytes(server.pid) > 0.8 * weight_bytes
    # Generating on released memory is SGLang running a forward pass on freed GPU memory: a loud error,
    # for /health_generate's one-token generation too, so a test catches any prober.
    status, reply = call(server, "/generate", greedy_body(PROMPTS[0], max_new_tokens=2))
    assert status == 500 and "released memory" in reply["error"]["message"]
    assert call(server, "/health_generate", method="GET", key=None)[0] == 500
    assert "/health_generate ran a generation on released memory" in server.log_tail()
    assert call(server, "/begin_weight_update", {})[0] == 200
    status, reply = call(server, "/update_weights_from_tensor",
                         {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", torch.ones(512))])]})
    assert status == 400 and "tags ['weights']" in reply["message"]
    assert call(server, "/end_weight_update", {})[0] == 200
    status, reply = call(server, "/release_memory_occupation", {"tags": ["cpu_ram"]})
    assert status == 400 and "cpu_ram" in reply["message"]

    # Weights first (verl's and slime's order): without a host copy they come back undefined (NaN here).
    assert call(server, "/resume_memory_occupation", {"tags": ["weights"]})[0] == 200
    undefined = weight_checksums(server.url, key=API_KEY)
    assert undefined["model.norm.weight"] == tensor_checksum(torch.full((512,), float("nan")))
    assert call(server, "/generate", greedy_body(PROMPTS[0], max_new_tokens=2))[0] == 500  # kv_cache still released
    try:
        # The fleet's cycle: push the trainer's weights into the resumed memory, then resume the KV cache.
        with RolloutClient([server.url], api_key=API_KEY, timeout_s=120) as client:
            client.begin_weight_update()
            client.update_weights_from_tensor(list(other.state_dict().items()), load_format="flattened_bucket",
                                              flush_cache=False, weight_version="pushed")
            client.end_weight_update()
            client.resume_memory_occupation(["kv_cache"])
        output = generate(server, greedy_body(PROMPTS[2], max_new_tokens=5))
        assert output["output_ids"] == greedy_continuation(other, PROMPTS[2], 5)
        assert logprobs_of(output) == pytest.approx(reference_logprobs(other, PROMPTS[2], output["output_ids"], 0.0),
                                                    abs=1e-5)
    finally:
        call(server, "/resume_memory_occupation", {})
        restore(server, models)
    assert weight_checksums(server.url, key=API_KEY) == before_digests


def test_with_a_host_copy_resumed_weights_are_the_released_ones(models, reference):
    handle = start(models, "backup", enable_memory_saver=True, enable_weights_cpu_backup=True)
    try:
        before = weight_checksums(handle.url, key=API_KEY)
        assert call(handle, "/release_memory_occupation", {})[0] == 200
        assert call(handle, "/resume_memory_occupation", {})[0] == 200
        assert weight_checksums(handle.url, key=API_KEY) == before
        assert generate(handle, greedy_body(PROMPTS[0], max_new_tokens=4))["output_ids"] == greedy_continuation(
            reference, PROMPTS[0], 4)
    finally:
        handle.stop()


def test_fleet_releases_and_resumes_its_servers_memory_around_a_sync(models, other, tmp_path):
    """What the controller does on colocated GPUs: release before training, resume weights, sync, resume the
    KV cache, generate. The fleet starts its servers with the memory saver when the spec says so."""
    spec = ServerSpec(backend="cpu", model_path=str(models["base"]), log_dir=str(tmp_path), api_key=API_KEY,
                      enable_memory_saver=True)
    with RolloutFleet(spec, num_servers=1, pad_token_id=0, use_ray=False,
                      startup_timeout_s=120) as fleet:
        fleet.set_weight_source(str(models["other"]))
        fleet.release_memory()
        status, reply = call(SimpleNamespace(url=fleet.urls[0]), "/generate", greedy_body(PROMPTS[0], max_new_tokens=2))
        assert status == 500 and "released memory" in reply["error"]["message"]
        fleet.resume_memory(["weights"])
        fleet.sync_weights(version=7)
        fleet.resume_memory(["kv_cache", "cuda_graph"])
        with RolloutClient(fleet.urls, api_key=API_KEY) as client:
            result = client.generate([PROMPTS[2]], sampling(4, temperature=0.0, ignore_eos=True))[0]
        assert result.output_ids == greedy_continuation(other, PROMPTS[2], 4) and result.weight_version == "7"
        assert fleet.weight_version == "7"


def test_client_sends_one_pickle_per_tp_rank_of_each_server(servers_tp):
    """SGLang's TP rank r reads serialized_named_tensors[r]: a TP2 server given one entry would die."""
    stub, received = servers_tp
    named = [("model.norm.weight", torch.arange(4.0)), ("lm_head.weight", torch.ones(2, 2))]
    with RolloutClient([stub], timeout_s=30) as client:
        client.update_weights_from_tensor(named, load_format="flattened_bucket", weight_version="t")
    (body,) = received
    assert len(body["serialized_named_tensors"]) == 2  # two pickles, each holding its own buffer reference
    for entry in body["serialized_named_tensors"]:
        back = deserialize_named_tensors(entry, load_format="flattened_bucket")
        assert [(n, t.tolist()) for n, t in back] == [(n, t.tolist()) for n, t in named]


@pytest.fixture
def servers_tp():
    """A stub SGLang server with TP size 2 that records each `/update_weights_from_tensor` body."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    received: list[dict] = []

    class Tp2(BaseHTTPRequestHandler):
        def do_GET(self):
            self._reply({"tp_size": 2})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/update_weights_from_tensor":
                received.append(body)
            ok = len(body.get("serialized_named_tensors", [])) == 2
            self._reply({"success": ok, "message": "ok" if ok else "IndexError"}, 200 if ok else 500)

        def _reply(self, payload, status=200):
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    stub = ThreadingHTTPServer(("127.0.0.1", 0), Tp2)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{stub.server_address[1]}", received
    stub.shutdown()
