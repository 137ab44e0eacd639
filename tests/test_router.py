"""sglang-router (0.3.2, the real Rust gateway) in front of two CPU engine servers, through the fleet.

The fleet runs with `routing="router"` on local hosts; the router's process
and the servers are stopped by PID when the fleet shuts down.
"""

from __future__ import annotations

import collections
from pathlib import Path
import os
import signal

import pytest
from _http import call as http_call
from _settings import sampling
from _tiny import greedy_continuation, served_model
import torch

from megarl.data.padding import left_pad, position_ids_from_mask
from megarl.protocol import Batch
from megarl.rollout import RolloutFleet, ServerSpec
from megarl.rollout.router import router_argv
from megarl.rollout.sampling import sample_seed

API_KEY = "router-test-key"
PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
N = 3
MAX_RESPONSE = 12

pytestmark = pytest.mark.dist



def call(url: str, path: str, body=None, *, key: str | None = API_KEY) -> tuple[int, object]:
    return http_call(url, path, body, key=key)


def greedy(url: str, prompt: list[int]) -> list[int]:
    status, reply = call(url, "/generate", {"input_ids": prompt,
                                            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
    assert status == 200, reply
    return reply["output_ids"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("router_models")
    served_model(0).save_pretrained(root / "base")
    other = served_model(1)
    other.save_pretrained(root / "other")
    return {"base": root / "base", "other": root / "other", "other_model": other}


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    spec = ServerSpec(backend="cpu", model_path=str(models["base"]), log_dir=str(tmp_path_factory.mktemp("logs")),
                      api_key=API_KEY, deterministic=True)
    with RolloutFleet(spec, num_servers=2, pad_token_id=0, seed=2,
                      max_concurrency=2, routing="router", router_policy="round_robin", use_ray=False) as started:
        yield started


def generation_batch(n: int) -> Batch:
    ids, mask = left_pad(PROMPTS, 0)
    batch = Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
                             "uid": [f"p{row}" for row in range(len(PROMPTS))]})
    return batch.repeat(n, interleave=True)


def test_router_command_line_holds_no_key_and_no_health_checks():
    argv = router_argv(["http://a:1", "http://b:2"], policy="cache_aware", host="127.0.0.1", port=9)
    assert argv[1:] == ["-m", "megarl.rollout.router_main", "--worker-urls", "http://a:1", "http://b:2",
                        "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "9", "--log-level", "warn",
                        "--disable-health-check"]
    with pytest.raises(ValueError, match="policy"):
        router_argv([], policy="fastest", host="127.0.0.1", port=9)


def test_fleet_generation_through_the_router_survives_a_dead_server(fleet):
    router = fleet.router
    assert sorted(router.worker_urls()) == sorted(fleet.urls)
    # The key reached the router through its environment, not its command line.
    assert call(router.url, "/generate", {"input_ids": [1]}, key=None)[0] == 401
    assert fleet.spec.api_key not in Path(f"/proc/{router.pid}/cmdline").read_text()
    gen_batch = generation_batch(N)
    out = fleet.generate(gen_batch, sampling(MAX_RESPONSE), seed=4)
    assert list(out["uid"]) == list(gen_batch["uid"])
    assert collections.Counter(out["uid"]) == {f"p{row}": N for row in range(len(PROMPTS))}
    for row in range(len(gen_batch)):
        params = {"max_new_tokens": MAX_RESPONSE, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                  "sampling_seed": sample_seed(2 * 100_003 + 4, row)}
        status, expected = call(fleet.urls[0], "/generate", {"input_ids": PROMPTS[row // N],
                                                            "sampling_params": params, "return_logprob": True})
        length = len(expected["output_ids"])
        assert status == 200 and out["responses"][row, :length].tolist() == expected["output_ids"]
        assert out["attention_mask"][row, -MAX_RESPONSE:].sum() == length

    victim = fleet.status()[0]
    os.kill(victim["pid"], signal.SIGKILL)
    again = fleet.generate(gen_batch, sampling(MAX_RESPONSE), seed=4)
    assert torch.equal(again["responses"], out["responses"]) and list(again["uid"]) == list(gen_batch["uid"])
    assert fleet.wait_for_restarts(120)
    restarted = fleet.status()[0]
    assert restarted["state"] == "up" and restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
    assert restarted["url"] in router.worker_urls() and len(router.workers()) == 2


def test_router_spreads_requests_and_follows_worker_changes(fleet, models):
    router = fleet.router
    first, second = fleet.urls
    # Different weights on the second server tell the servers apart by their greedy outputs.
    assert call(second, "/update_weights_from_disk", {"model_path": str(models["other"])})[0] == 200
    try:
        outputs = {url: greedy(url, PROMPTS[0]) for url in (first, second)}
        assert outputs[first] != outputs[second]
        served_by = {url: 0 for url in outputs}
        for _ in range(6):
            output = greedy(router.url, PROMPTS[0])
            served_by[next(url for url, expected in outputs.items() if expected == output)] += 1
        assert served_by == {first: 3, second: 3}  # round robin over both

        router.remove_worker(first)
        assert router.worker_urls() == [second]
        assert all(greedy(router.url, PROMPTS[0]) == outputs[second] for _ in range(3))
        router.add_worker(first)
        assert sorted(router.worker_urls()) == sorted([first, second])
        assert {tuple(greedy(router.url, PROMPTS[0])) for _ in range(4)} == {tuple(o) for o in outputs.values()}
    finally:
        assert call(second, "/update_weights_from_disk", {"model_path": str(models["base"])})[0] == 200


def test_weight_sync_goes_to_every_server_directly(fleet, models):
    fleet.set_weight_source(str(models["other"]))
    try:
        fleet.sync_weights(version="other-1")
        assert fleet.weight_version == "other-1"
        assert [call(url, "/model_info")[1]["weight_version"] for url in fleet.urls] == ["other-1"] * 2
        expected = greedy_continuation(models["other_model"], PROMPTS[1], 6)
        assert [greedy(fleet.router.url, PROMPTS[1]) for _ in range(2)] == [expected, expected]
    finally:
        fleet.set_weight_source(str(models["base"]))
        fleet.sync_weights(version="base-2")
