"""RolloutClient against two CPU engine servers, and against a fake server that counts requests in flight."""

from __future__ import annotations

import asyncio
import threading

import pytest
from _http import call as http_call
from _settings import sampling
from _tiny import served_model
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from megarl.rollout import GenerationResult, RolloutClient, RolloutError, results_to_tensors
from megarl.rollout.sampling import SEED_STRIDE
from megarl.ports import free_port

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [16, 17, 18]]
NUCLEUS = sampling(8, temperature=0.9, top_p=0.95, ignore_eos=True)



@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("client_models")
    served_model(0).save_pretrained(root / "base")
    served_model(1).save_pretrained(root / "other")
    return {"base": root / "base", "other": root / "other"}


@pytest.fixture(scope="module")
def servers(model_dirs, cpu_engine):
    return [cpu_engine(model_dirs["base"], seed=index, deterministic=True) for index in range(2)]


@pytest.fixture(scope="module")
def client(servers):
    with RolloutClient([server.url for server in servers], max_concurrency=4) as rollout_client:
        yield rollout_client


def direct_generate(url: str, body: dict) -> dict:
    return http_call(url, "/generate", body)[1]


@pytest.mark.dist
def test_n_samples_are_prompt_major_with_derived_seeds(client, servers):
    seed, n = 5, 3
    results = client.generate(PROMPTS, sampling(6, ignore_eos=True), n=n, seed=seed)
    assert len(results) == len(PROMPTS) * n
    for prompt_index, prompt in enumerate(PROMPTS):
        for sample in range(n):
            result = results[prompt_index * n + sample]
            # Any server gives the same tokens for the same derived seed.
            url = servers[(prompt_index + sample) % 2].url
            params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True,
                      "sampling_seed": seed * SEED_STRIDE + prompt_index * n + sample}
            expected = direct_generate(url, {"input_ids": prompt, "sampling_params": params, "return_logprob": True})
            assert result.output_ids == expected["output_ids"]
            expected_logprobs = [entry[0] for entry in expected["meta_info"]["output_token_logprobs"]]
            assert result.logprobs == pytest.approx(expected_logprobs, abs=1e-5)
            assert result.finish_reason == "length" and result.weight_version == "default"


@pytest.mark.dist
def test_fixed_seed_is_deterministic_whatever_the_concurrency(servers):
    urls = [server.url for server in servers]
    runs = []
    for urls_used, concurrency in [(urls, 4), (urls, 1), (urls[::-1], 256), (urls[:1], 2)]:
        with RolloutClient(urls_used, max_concurrency=concurrency) as rollout_client:
            runs.append(rollout_client.generate(PROMPTS * 3, NUCLEUS, n=2, seed=17))
    assert all([r.output_ids for r in run] == [r.output_ids for r in runs[0]] for run in runs[1:])
    with RolloutClient(urls) as rollout_client:
        other_seed = rollout_client.generate(PROMPTS * 3, NUCLEUS, n=2, seed=18)
    assert [r.output_ids for r in other_seed] != [r.output_ids for r in runs[0]]


@pytest.mark.dist
def test_greedy_results_match_a_plain_argmax_loop(client, model_dirs):
    reference = AutoModelForCausalLM.from_pretrained(str(model_dirs["base"])).eval()
    results = client.generate(PROMPTS, sampling(5, temperature=0.0, ignore_eos=True))
    for prompt, result in zip(PROMPTS, results):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(5):
                ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
        assert result.output_ids == ids[len(prompt):]


@pytest.mark.dist
def test_errors_name_the_server_and_endpoint(client, servers):
    with pytest.raises(RolloutError) as error:
        client.generate([[1, 2], [1, 100000]], sampling(2))
    assert error.value.endpoint == "/generate" and error.value.status == 400
    assert error.value.url in {server.url for server in servers}
    assert error.value.url in str(error.value) and "input_ids" in str(error.value)

    with pytest.raises(RolloutError) as error:
        client.update_weights_from_tensor([("model.norm.weight", torch.ones(64))], weight_version="x")
    assert "/update_weights_from_tensor" in str(error.value) and "begin_weight_update" in str(error.value)

    dead_url = f"http://127.0.0.1:{free_port()}"
    with RolloutClient([dead_url], timeout_s=5) as dead:
        assert dead.health() == [False]
        with pytest.raises(RolloutError) as error:
            dead.generate([[1]], sampling(1))
    assert error.value.url == dead_url and error.value.status is None and "/generate" in str(error.value)


@pytest.mark.dist
def test_weight_update_round_trip_through_the_client(client, model_dirs):
    other = AutoModelForCausalLM.from_pretrained(str(model_dirs["other"])).eval()
    named = [(name, tensor.detach().clone()) for name, tensor in other.state_dict().items()]
    try:
        client.begin_weight_update()
        client.update_weights_from_tensor(named, weight_version="step-1", load_format="flattened_bucket")
        client.end_weight_update()
        results = client.generate(PROMPTS, sampling(4, temperature=0.8, ignore_eos=True), seed=3)
        for prompt, result in zip(PROMPTS, results):
            with torch.no_grad():
                logits = other(torch.tensor([prompt + result.output_ids])).logits[0]
            logprobs = torch.log_softmax(logits / 0.8, -1)
            expected = [logprobs[len(prompt) - 1 + i, token].item() for i, token in enumerate(result.output_ids)]
            assert result.logprobs == pytest.approx(expected, abs=1e-5)
            assert result.weight_version == "step-1"
        assert [info["weight_version"] for info in client.model_info()] == ["step-1", "step-1"]
    finally:
        client.update_weights_from_disk(str(model_dirs["base"]), weight_version="default")
    client.update_weight_version("default")
    client.flush_cache()
    assert client.health() == [True, True]


class CountingServer:
    """A fake SGLang `/generate` endpoint that records the most requests it ever had in flight."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(self.delay_s)
        self.in_flight -= 1
        prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        outputs = [{"text": "", "output_ids": [len(p)],
                    "meta_info": {"finish_reason": {"type": "length", "length": 1}, "weight_version": "fake",
                                  "output_token_logprobs": [[-0.5, len(p), None]]}} for p in prompts]
        return web.json_response(outputs if len(outputs) > 1 else outputs[0])

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> CountingServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc_info) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_concurrency_is_bounded_per_server_and_load_is_spread():
    with CountingServer(0.03) as first, CountingServer(0.03) as second:
        with RolloutClient([first.url, second.url], max_concurrency=3) as rollout_client:
            prompts = [[1] * (i + 1) for i in range(24)]
            results = rollout_client.generate(prompts, sampling(1), n=2)
    assert (first.max_in_flight, second.max_in_flight) == (3, 3)
    assert (first.requests, second.requests) == (12, 12)
    assert [r.output_ids for r in results] == [[len(p)] for p in prompts for _ in range(2)]
    assert all(r.logprobs == [-0.5] and r.weight_version == "fake" for r in results)


def test_results_to_tensors_pads_and_masks():
    results = [
        GenerationResult([5, 6, 7], [-0.1, -0.2, -0.3], "stop", "v1"),
        GenerationResult([8], [-1.5], "length", "v1"),
        GenerationResult([], [], "abort", "v1"),
    ]
    packed = results_to_tensors(results, pad_id=0, max_response_length=4)
    assert packed["responses"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [0, 0, 0, 0]]
    assert packed["response_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert packed["response_lengths"].tolist() == [3, 1, 0]
    assert packed["rollout_log_probs"].dtype == torch.float32
    assert torch.allclose(packed["rollout_log_probs"],
                          torch.tensor([[-0.1, -0.2, -0.3, 0], [-1.5, 0, 0, 0], [0, 0, 0, 0]]))
    assert packed["finish_reasons"] == ["stop", "length", "abort"]
    no_logprobs = results_to_tensors([GenerationResult([1], None, "length", None)], pad_id=9, max_response_length=2)
    assert "rollout_log_probs" not in no_logprobs and no_logprobs["responses"].tolist() == [[1, 9]]
    with pytest.raises(ValueError, match="max_response_length"):
        results_to_tensors(results, pad_id=0, max_response_length=2)


def test_idle_connections_are_dropped_before_the_servers_drop_them():
    """A server closing an idle keep-alive connection while the client reuses it resets the request (a weight
    sync's /pause_generation failed so, 5.0 s after its previous call): the client lets go first, below uvicorn's
    keep-alive, which SGLang's server and the CPU engine run with."""
    import uvicorn

    from megarl.rollout.client import IDLE_CONNECTION_S

    server_keep_alive = uvicorn.Config(app=None).timeout_keep_alive
    assert IDLE_CONNECTION_S < server_keep_alive == 5
    client = RolloutClient(["http://127.0.0.1:9"])
    try:
        assert client.run(_keepalive(client)) == IDLE_CONNECTION_S
    finally:
        client.close()


async def _keepalive(client) -> float:
    return client._ensure_session().connector._keepalive_timeout
