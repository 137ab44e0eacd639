"""The rollout fleet: SGLang command line, retrying dispatch, and two CPU engine servers as Ray actors.

The fleet tests check rows against independent references: the seed formula
sent straight to a server, and HF transformers' log-probs of the trained weights.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from _http import call as http_call
from _settings import sampling
from _tiny import served_model
import torch

from megarl.data.padding import left_pad, position_ids_from_mask
from megarl.errors import InputError
from megarl.oom import find_role_oom
from megarl.protocol import Batch
from megarl.rollout import FleetError, RolloutClient, RolloutFleet, ServerSpec, ServerStartError
from megarl.rollout.batching import prompt_groups, prompt_token_lists, rollout_batch
from megarl.rollout.client import RolloutError
from megarl.rollout.dispatch import generate_rows
from megarl.rollout.results import GenerationResult
from megarl.rollout.sampling import sample_seed
from megarl.rollout.sglang_launcher import sglang_server_argv
from megarl.models import arch_from_hf, hf_to_megatron
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, build_plan, make_transport

API_KEY = "fleet-test-key"
MAX_RESPONSE = 48
STOP_IDS = list(range(3, 512, 16))  # ~1 in 16 tokens stops a sample: both finish reasons occur
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17, 18], [19, 20], [21]]
N = 4
SAMPLING = sampling(MAX_RESPONSE, stop_token_ids=STOP_IDS)


# ---- the SGLang command line ------------------------------------------------------------------


def test_sglang_argv_is_megarls_arguments_then_the_passthrough_block():
    argv = sglang_server_argv(
        model_path="/ckpt/qwen", host="10.0.0.7", port=30001, tp_size=4, mem_fraction_static=0.85,
        config="/run/logs/rollout-0.secrets.yaml",
        weight_version="0", enable_memory_saver=True, deterministic=True, python="python",
        extra={"attention_backend": "fa3", "disable-radix-cache": True, "enable_metrics": False,
               "cuda_graph_bs": [1, 2, 4], "chunked_prefill_size": 8192, "json_model_override_args": {"b": 1, "a": 2},
               "log_level": None},
    )
    assert argv == [
        "python", "-m", "sglang.launch_server", "--model-path", "/ckpt/qwen", "--tp-size", "4",
        "--mem-fraction-static", "0.85", "--host", "10.0.0.7", "--port", "30001",
        "--config", "/run/logs/rollout-0.secrets.yaml",
        "--weight-version", "0", "--skip-tokenizer-init", "--enable-memory-saver", "--enable-deterministic-inference",
        "--attention-backend", "fa3", "--disable-radix-cache", "--cuda-graph-bs", "1", "2", "4",
        "--chunked-prefill-size", "8192", "--json-model-override-args", '{"a": 2, "b": 1}',
    ]


def test_sglang_passthrough_may_not_set_megarls_arguments():
    with pytest.raises(InputError) as error:
        sglang_server_argv(model_path="m", host="127.0.0.1", port=1, tp_size=1, mem_fraction_static=0.5,
                           config=None, extra={"tp_size": 2, "port": 5, "Bad Key": 1, "dtype": "bfloat16",
                                               "admin_api_key": "x", "config": "mine.yaml"})
    assert error.value.problems[:3] == [
        "rollout.sglang.tp_size: set by megarl; use rollout.tp",
        "rollout.sglang.port: set by megarl; use rollout.port",
        "rollout.sglang.Bad Key: not an SGLang argument name (lowercase words joined by _ or -)",
    ]
    # An admin key would make every weight and memory call answer 401; secrets travel in megarl's own file.
    assert error.value.problems[3].startswith("rollout.sglang.admin_api_key: set by megarl; use nothing (megarl's "
                                              "weight and memory calls carry the run's API key")
    assert error.value.problems[4].startswith("rollout.sglang.config: set by megarl")


# ---- dispatch against a fake fleet ------------------------------------------------------------


class FakeTargets:
    def __init__(self, urls):
        self.urls = collections.deque(urls)
        self.failures: list[str] = []

    async def acquire(self):
        self.urls.rotate()
        return type("T", (), {"url": self.urls[0]})()

    def release(self, target):
        pass

    async def report_failure(self, target, error):
        self.failures.append(target.url)


def fake_output(token: int, reason: str = "length") -> dict:
    return {"output_ids": [token], "meta_info": {"finish_reason": {"type": reason},
                                                 "output_token_logprobs": [[-1.0, token, None]]}}


def test_dispatch_retries_unreachable_and_aborted_samples_and_stores_each_row_once():
    sent: list[tuple[str, list[int]]] = []

    async def request(url, method, endpoint, body):
        params = body["sampling_params"]
        seeds = [item["sampling_seed"] for item in (params if isinstance(params, list) else [params])]
        sent.append((url, seeds))
        if url == "http://dead":
            raise RolloutError(url, endpoint, None, "connection refused")
        # The first time, a server aborts the second copy of a group (e.g. paused for a weight update).
        outputs = [fake_output(seed % 1000, "abort" if len(seeds) > 1 and i == 1 else "stop")
                   for i, seed in enumerate(seeds)]
        return outputs if isinstance(params, list) else outputs[0]

    targets = FakeTargets(["http://dead", "http://alive"])
    prompts = [[1], [1], [2], [2], [3]]
    reported: list[tuple[int, GenerationResult]] = []
    results = asyncio.run(generate_rows(prompts, [[0, 1], [2, 3], [4]], sampling=sampling(1), seed=7,
                                        targets=targets, request=request, max_attempts=4,
                                        on_rows=lambda rows, outputs: reported.extend(zip(rows, outputs))))
    assert [r.output_ids for r in results] == [[sample_seed(7, row) % 1000] for row in range(5)]
    # The reward loop hears about every row exactly once, with its final (never an aborted) result.
    assert sorted(reported, key=lambda item: item[0]) == list(enumerate(results))
    assert all(r.finish_reason == "stop" for r in results)
    # Aborted rows 1 and 3 went out again on their own, with their own seeds.
    assert ("http://alive", [sample_seed(7, 1)]) in sent and ("http://alive", [sample_seed(7, 3)]) in sent
    assert targets.failures and set(targets.failures) == {"http://dead"}


def test_dispatch_fails_at_once_on_a_bad_request_and_after_bounded_attempts():
    async def bad_request(url, method, endpoint, body):
        raise RolloutError(url, endpoint, 400, "input_ids: bad")

    async def unreachable(url, method, endpoint, body):
        raise RolloutError(url, endpoint, None, "connection refused")

    with pytest.raises(RolloutError, match="HTTP 400"):
        asyncio.run(generate_rows([[1]], [[0]], sampling=sampling(1), seed=0, targets=FakeTargets(["http://a"]),
                                  request=bad_request, max_attempts=4))
    targets = FakeTargets(["http://a", "http://b"])
    with pytest.raises(FleetError, match="failed 3 times"):
        asyncio.run(generate_rows([[1]], [[0]], sampling=sampling(1), seed=0, targets=targets, request=unreachable,
                                  max_attempts=3))
    assert len(targets.failures) == 2


def test_partial_rollouts_resend_prompt_plus_tokens_so_far_and_join_the_parts():
    """A weight update aborts each sample after 2 of its 5 tokens (version 1); the re-sent request carries the
    prompt plus those tokens and asks for the 3 left; the result is the joined sample, its tokens tagged 1 then 2."""
    bodies: list[dict] = []

    async def request(url, method, endpoint, body):
        bodies.append(body)
        prompt, budget = body["input_ids"], body["sampling_params"]["max_new_tokens"]
        if budget == 5:
            return {"output_ids": [70, 71], "meta_info": {"finish_reason": {"type": "abort", "message": "paused"},
                                                          "weight_version": "1",
                                                          "output_token_logprobs": [[-0.1, 70, None],
                                                                                    [-0.2, 71, None]]}}
        tokens = list(range(80, 80 + budget))
        return {"output_ids": tokens, "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "2",
                                                    "output_token_logprobs": [[-0.5, t, None] for t in tokens]}}

    (result,) = asyncio.run(generate_rows([[1, 2]], [[0]], sampling=sampling(5), seed=3, targets=FakeTargets(["u"]),
                                          request=request, max_attempts=2, partial=True))
    assert [body["input_ids"] for body in bodies] == [[1, 2], [1, 2, 70, 71]]
    assert bodies[1]["sampling_params"]["max_new_tokens"] == 3
    assert result.output_ids == [70, 71, 80, 81, 82] and result.finish_reason == "length"
    assert result.logprobs == [-0.1, -0.2, -0.5, -0.5, -0.5]
    assert result.token_versions == ["1", "1", "2", "2", "2"] and result.weight_version == "2"


# ---- a real fleet -----------------------------------------------------------------------------


def generation_batch(prompts: list[list[int]], n: int) -> Batch:
    """Left-padded prompts with a uid each, repeated n times interleaved (as the step loop does)."""
    ids, mask = left_pad(prompts, 0)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                             "uid": [f"uid-{row}" for row in range(len(prompts))]})
    return batch.repeat(n, interleave=True)


def call(url: str, path: str, body=None, *, key: str | None = API_KEY) -> tuple[int, object]:
    return http_call(url, path, body, key=key)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet_models")
    served_model(0).save_pretrained(root / "base")
    trained = served_model(1)
    return {"base": root / "base", "trained": trained}


@pytest.fixture(scope="module")
def fleet(ray_session, models, tmp_path_factory):
    spec = ServerSpec(backend="cpu", model_path=str(models["base"]), log_dir=str(tmp_path_factory.mktemp("logs")),
                      api_key=API_KEY, deterministic=True)
    with RolloutFleet(spec, num_servers=2, pad_token_id=0, seed=11, max_concurrency=1, use_ray=True) as started:
        yield started


@pytest.fixture(scope="module")
def pushes(fleet, models):
    """The trained weights as the fleet's weight source (one trainer rank, the tensor transport); records
    every push: its servers, its version and the thread that made it."""
    trained = models["trained"]
    arch = arch_from_hf(trained.config.to_dict())
    plan = build_plan(arch, TrainerLayout(), dtype=torch.float32, bucket_bytes=2**20)
    full = hf_to_megatron(dict(trained.state_dict()), arch, padded_vocab=plan.padded_vocab)
    local = {(0, name): tensor for name, tensor in full.items()}
    calls: list[tuple[list[str], object, threading.Thread]] = []

    def push(*, urls, version):
        calls.append((list(urls), version, threading.current_thread()))
        with RolloutClient(urls, api_key=API_KEY) as client:
            syncer = WeightSyncer(plan, make_transport("tensor", client, timeout_s=60),
                                  SyncGroups.build(RankCoords(), timeout_s=60), client=client)
            try:
                return syncer.push(local, weight_version=str(version))
            finally:
                syncer.close()

    fleet.set_weight_source(push)
    return calls


def expected_row(url: str, prompt: list[int], *, seed: int, row: int, temperature: float) -> dict:
    """Row `row` sent alone to one server with the seed formula (fleet seed 11, generate seed `seed`)."""
    params = {"max_new_tokens": MAX_RESPONSE, "temperature": temperature, "top_p": 1.0, "top_k": -1,
              "stop_token_ids": STOP_IDS, "sampling_seed": sample_seed(11 * 100_003 + seed, row)}
    status, reply = call(url, "/generate", {"input_ids": prompt, "sampling_params": params, "return_logprob": True})
    assert status == 200, reply
    return reply


def assert_every_uid_once(out: Batch, gen_batch: Batch) -> None:
    assert len(out) == len(gen_batch)
    assert list(out["uid"]) == list(gen_batch["uid"])
    assert collections.Counter(out["uid"]) == {f"uid-{row}": N for row in range(len(PROMPTS))}


@pytest.mark.dist
def test_generation_returns_every_row_once_with_its_seeded_sample(fleet):
    gen_batch = generation_batch(PROMPTS, N)
    out = fleet.generate(gen_batch, SAMPLING, seed=3)
    assert_every_uid_once(out, gen_batch)
    url = fleet.urls[1]
    lengths = out["attention_mask"][:, -MAX_RESPONSE:].sum(-1)
    for row in range(len(gen_batch)):
        expected = expected_row(url, PROMPTS[row // N], seed=3, row=row, temperature=1.0)
        length = len(expected["output_ids"])
        assert out["responses"][row, :length].tolist() == expected["output_ids"] and lengths[row] == length
        logprobs = [entry[0] for entry in expected["meta_info"]["output_token_logprobs"]]
        assert out["rollout_log_probs"][row, :length].tolist() == pytest.approx(logprobs, abs=1e-5)
        assert out["finish_reasons"][row] == expected["meta_info"]["finish_reason"]["type"]
    # finish reasons agree with the lengths: clip_ratio counts exactly the "length" rows.
    reasons = list(out["finish_reasons"])
    assert set(reasons) <= {"stop", "length"} and "stop" in reasons
    for row, reason in enumerate(reasons):
        last = out["responses"][row, lengths[row] - 1].item()
        assert (reason == "length") == (lengths[row] == MAX_RESPONSE and last not in STOP_IDS)


@pytest.mark.dist
def test_killed_servers_are_restarted_resynced_by_the_driver_and_no_row_is_lost(fleet, pushes, models):
    fleet.sync_weights(version=7)
    assert fleet.weight_version == "7"
    assert [call(url, "/model_info")[1]["weight_version"] for url in fleet.urls] == ["7", "7"]
    gen_batch = generation_batch(PROMPTS, N)
    reference = fleet.generate(gen_batch, SAMPLING, seed=5)

    def generate_while_killing(victims: list[dict]) -> tuple[Batch, threading.Thread]:
        """Generate on a thread of its own (the driver here) and SIGKILL `victims` once server 0 runs a request."""
        holder: dict = {}
        driver = threading.Thread(target=lambda: holder.update(out=fleet.generate(gen_batch, SAMPLING, seed=5)))
        driver.start()
        deadline = time.monotonic() + 30
        while call(fleet.status()[0]["url"], "/server_info")[1]["num_running_reqs"] < 1:
            assert time.monotonic() < deadline, "no request ever ran on server 0"
            time.sleep(0.002)
        for victim in victims:
            os.kill(victim["pid"], signal.SIGKILL)
        driver.join(timeout=180)
        assert not driver.is_alive(), "the generation hangs"
        return holder["out"], driver

    # One server dies: its rows go to the other, it comes back stale, and no weights reach it but from the
    # driver (a push from the fleet's own thread could meet the driver's calls on the actor group).
    victim = fleet.status()[0]
    pushed = len(pushes)
    out, _ = generate_while_killing([victim])
    assert_every_uid_once(out, gen_batch)
    assert torch.equal(out["responses"], reference["responses"])
    assert torch.allclose(out["rollout_log_probs"], reference["rollout_log_probs"], atol=1e-5)
    assert fleet.wait_for_restarts(120)
    restarted = fleet.status()[0]
    assert restarted["state"] == "stale" and restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
    assert len(pushes) == pushed and fleet.urls == [fleet.status()[1]["url"]]
    # The driver's next generation first brings it the current version (on the driver's thread), then uses it.
    again = fleet.generate(gen_batch, SAMPLING, seed=5)
    assert torch.equal(again["responses"], reference["responses"])
    assert pushes[-1] == ([restarted["url"]], 7, threading.current_thread())
    assert fleet.status()[0]["state"] == "up"
    assert call(restarted["url"], "/model_info")[1]["weight_version"] == "7"
    # The restarted server holds the trained weights: its seeded sample and log-probs equal the other
    # server's and HF transformers' on the trained model (not the base weights it loaded from disk).
    prompt = PROMPTS[1]
    mine = expected_row(restarted["url"], prompt, seed=0, row=0, temperature=1.0)
    other = expected_row(fleet.status()[1]["url"], prompt, seed=0, row=0, temperature=1.0)
    assert mine["output_ids"] == other["output_ids"]
    mine_lp = [entry[0] for entry in mine["meta_info"]["output_token_logprobs"]]
    assert mine_lp == pytest.approx([entry[0] for entry in other["meta_info"]["output_token_logprobs"]], abs=1e-5)
    with torch.no_grad():
        logits = models["trained"](torch.tensor([prompt + mine["output_ids"]])).logits[0]
    hf = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:-1].gather(-1, torch.tensor(mine["output_ids"])[:, None])
    assert mine_lp == pytest.approx(hf.squeeze(-1).tolist(), abs=1e-4)

    # Every server dies mid-generation (a one-server fleet's case): the stalled generation hands the re-sync
    # to the thread waiting in `generate`, then finishes every row once.
    out, driver = generate_while_killing(fleet.status())
    assert_every_uid_once(out, gen_batch)
    assert torch.equal(out["responses"], reference["responses"])
    urls, version, thread = pushes[-1]
    assert sorted(urls) == sorted(server["url"] for server in fleet.status()) and version == 7
    assert thread is driver
    assert [server["state"] for server in fleet.status()] == ["up", "up"]

def _wait_for_a_running_request(fleet) -> None:
    deadline = time.monotonic() + 60
    while not any(call(url, "/server_info")[1]["num_running_reqs"] for url in fleet.urls):
        assert time.monotonic() < deadline, "no request ever ran"
        time.sleep(0.002)


def _hold_a_request_in_flight(fleet) -> None:
    """Pause every server in place at a moment one of them is generating a request: a request the sync then
    meets for sure (a sync racing the requests could find them all finished on a slow machine). A request
    paused in the running batch has tokens already: the engine samples a forward pass's token before pausing."""
    deadline = time.monotonic() + 60
    while True:
        _wait_for_a_running_request(fleet)
        for url in fleet.urls:
            assert call(url, "/pause_generation", {"mode": "in_place"})[0] == 200
        if any(call(url, "/server_info")[1]["num_running_reqs"] for url in fleet.urls):
            return
        for url in fleet.urls:  # paused between two requests: let them go on and try again
            assert call(url, "/continue_generation", {})[0] == 200
        assert time.monotonic() < deadline, "never paused a request mid-generation"


@pytest.mark.dist
def test_an_in_flight_update_pauses_requests_in_place_and_their_tokens_carry_both_versions(fleet, pushes):
    """The sync pauses generation in place (SGLang's pause_generation mode in_place), updates, continues: the
    paused requests complete, and the streamed events tag each token with the version that generated it."""
    fleet.sync_weights(version=20)
    gen_batch = generation_batch(PROMPTS * 8, N)  # 64 requests, one at a time per server: the sync meets some
    results: dict[int, GenerationResult] = {}
    future = fleet.start_generation(gen_batch, sampling(MAX_RESPONSE, ignore_eos=True), seed=9,
                                    on_rows=lambda rows, outs: results.update(zip(rows, outs)),
                                    per_token_versions=True)
    _hold_a_request_in_flight(fleet)
    fleet.sync_weights(version=21)  # pauses in place again (a no-op here), updates, continues
    future.result(timeout=300)
    assert sorted(results) == list(range(len(gen_batch)))
    assert all(r.finish_reason == "length" and len(r.output_ids) == MAX_RESPONSE for r in results.values())
    tags = [r.token_versions for r in results.values()]
    assert all(len(t) == MAX_RESPONSE and t == sorted(t, key=int) for t in tags)  # old tokens first, then new
    straddling = [t for t in tags if set(t) == {"20", "21"}]
    assert straddling, "no request was running through the update"
    assert all(r.weight_version == r.token_versions[-1] for r in results.values())


class _PromptLoader:
    """PROMPTS as prompt batches of 4, in order, forever (the loader's position is its state)."""

    def __init__(self):
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def __next__(self) -> dict:
        rows = [PROMPTS[(self.position + i) % len(PROMPTS)] for i in range(4)]
        self.position += 4
        ids, mask = left_pad(rows, 0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


@pytest.mark.dist
def test_async_rollout_through_a_killed_server_trains_every_uid_once(fleet, pushes):
    """Asynchronous RL (k = 1, in-flight updates) while a server is killed: its requests are re-sent to the other,
    the server is restarted and re-synced, and every uid reaches the trainer exactly once, within the bound."""
    from megarl.controller.rollout_ahead import AsyncRollout

    fleet.sync_weights(version=30)
    ahead = AsyncRollout(fleet, _PromptLoader(), sampling=sampling(MAX_RESPONSE, ignore_eos=True), rollout_n=N,
                         batch_size=4, max_staleness=1, total_steps=4, in_flight_updates=True)
    trained, victim = [], fleet.status()[1]
    for step in range(4):
        ahead.admit_until(step)
        if step == 1:
            _wait_for_a_running_request(fleet)
            os.kill(victim["pid"], signal.SIGKILL)
        version = int(fleet.weight_version)
        groups, metrics = ahead.take(version=version, stop_requested=lambda: False)
        assert metrics["async/staleness/max"] <= 1
        assert all(version - int(v) <= 1 for g in groups for tokens in g.token_versions for v in tokens)
        trained += [g.uid for g in groups]
        fleet.sync_weights(version=version + 1)
        ahead.commit(groups)
        ahead.admit_until(step + 1)
    ahead.close()
    assert collections.Counter(trained) == {f"b{b}-p{p}": 1 for b in range(4) for p in range(4)}
    assert fleet.wait_for_restarts(120)
    fleet.sync_weights(version=40)  # a restarted server serves again from the next sync on
    assert fleet.status()[1]["restarts"] == victim["restarts"] + 1 and fleet.status()[1]["state"] == "up"


@pytest.mark.dist
def test_update_and_generate_endpoints_refuse_requests_without_the_key(fleet):
    url = fleet.urls[0]
    for path, body in [("/update_weights_from_disk", {"model_path": "/nonexistent"}),
                       ("/update_weight_version", {"new_version": "evil"}), ("/pause_generation", {}),
                       ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})]:
        assert call(url, path, body, key=None)[0] == 401
        assert call(url, path, body, key="wrong-key")[0] == 401
    assert call(url, "/model_info")[1]["weight_version"] != "evil"
    assert urllib.request.urlopen(f"{url}/health", timeout=10).status == 200


@pytest.mark.dist
def test_server_that_never_becomes_healthy_fails_with_its_log_tail(tmp_path):
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    spec = ServerSpec(backend="cpu", model_path=str(broken), log_dir=str(tmp_path / "logs"), api_key=API_KEY)
    with pytest.raises(ServerStartError) as error:
        RolloutFleet(spec, num_servers=1, pad_token_id=0, use_ray=False, startup_timeout_s=60)
    message = str(error.value)
    assert "rollout server 0" in message and "exited with status" in message
    assert "no-such-architecture" in message  # from the server's own log
    assert API_KEY not in (tmp_path / "logs" / "rollout-0.log").read_text()


@pytest.mark.dist
def test_error_names_every_server_when_all_are_dead(models, tmp_path):
    spec = ServerSpec(backend="cpu", model_path=str(models["base"]), log_dir=str(tmp_path), api_key=API_KEY)
    with RolloutFleet(spec, num_servers=2, pad_token_id=0, use_ray=False,
                      max_restarts=0) as doomed:
        servers = doomed.status()
        for server in servers:
            os.kill(server["pid"], signal.SIGKILL)
        with pytest.raises(FleetError) as error:
            doomed.generate(generation_batch(PROMPTS[:2], 1), sampling(8), seed=0)
    message = str(error.value)
    for server in servers:
        assert f"server {server['index']} at {server['url']}: dead" in message
    assert "rollout server" in message  # each server's log tail
    # Killed by SIGKILL while serving, as the kernel's OOM killer does: the CLI's one line names the first server.
    assert str(find_role_oom(error.value)).startswith("out of memory: rollout server 0 was killed by SIGKILL")


def test_prompt_groups_are_runs_of_one_prompt_and_rows_keep_their_columns():
    gen_batch = generation_batch([[5, 6], [7], [5, 6]], 2)
    assert prompt_groups(prompt_token_lists(gen_batch)) == [[0, 1], [2, 3], [4, 5]]
    results = [GenerationResult([row + 1, 2], [-0.5, -0.25], "stop", "v") for row in range(6)]
    out = rollout_batch(gen_batch, results, pad_id=0, max_response_length=3)
    assert out["responses"][:, :2].tolist() == [[row + 1, 2] for row in range(6)]
    assert list(out["uid"]) == list(gen_batch["uid"]) and list(out["finish_reasons"]) == ["stop"] * 6
    with pytest.raises(ValueError, match="5 results for a batch of 6"):
        rollout_batch(gen_batch, results[:5], pad_id=0, max_response_length=3)
