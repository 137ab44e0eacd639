"""Several senders into two strict CPU engines, which serve weight operations one at a time as SGLang does.

First the engines' strictness itself: two trainer groups whose joins reach the two
servers in crossed order deadlock (each server is inside one join, waiting for the
other server, which is inside the other join) — what happened to the distributed
transport with PP or EP >= 2 and two or more servers. Then the transports at PP2 and
at EP2 (MoE, each EP rank sending its own experts): the distributed transport's
senders take turns and load every tensor bit for bit into both servers, and so does
the tensor transport when it fans buckets out to every rank as it does on GPUs
(each rank standing on a faked device, each server TP rank on one of them).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _http import call as http_call, weight_checksums
import torch
from _engine_spawn import run_spawned
from _weightsync_ranks import API_KEY, MOE_CONFIG, moe_rank, moe_weights, reference_digests
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from megarl.ports import free_port
from megarl.rollout.weight_wire import new_update_group

pytestmark = pytest.mark.dist

GROUP_TIMEOUT_S = 10  # the servers' join/receive timeout: ends the crossed joins' deadlock


@pytest.fixture(scope="module")
def servers(tmp_path_factory, cpu_engine):
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG)).save_pretrained(root / "model")
    return [cpu_engine(root / "model", api_key=API_KEY, log_path=root / f"server{index}.log",
                       weight_update_group_timeout_s=GROUP_TIMEOUT_S) for index in range(2)]


def call(url: str, path: str, body=None, *, method: str | None = None) -> tuple[int, dict]:
    return http_call(url, path, body, method=method, key=API_KEY)


def digests_of(url: str) -> dict[str, str]:
    return weight_checksums(url, key=API_KEY)


def join(url: str, group: str, port: int, rank: int) -> tuple[int, dict]:
    return call(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                    "rank_offset": rank, "world_size": 3, "group_name": group,
                                                    "backend": "gloo"})


def host(group: str, port: int, timeout_s: float):
    return new_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=3, group_name=group,
                            backend="gloo", timeout_s=timeout_s)


def test_crossed_group_joins_deadlock_on_servers_that_serve_one_operation_at_a_time(servers):
    """Two groups of (trainer, X, Y); X is asked to join A then B, Y to join B then A. A server that joined
    groups concurrently (the lenient engine this replaced) completes both; SGLang, and this engine, hang
    until the joins time out."""
    x, y = (server.url for server in servers)
    port_a, port_b = free_port(), free_port()
    with ThreadPoolExecutor(6) as pool:
        first = [pool.submit(join, x, "A", port_a, 1), pool.submit(join, y, "B", port_b, 2)]
        for url in (x, y):  # both servers are inside their first join before the second calls arrive
            deadline = time.monotonic() + 30
            while call(url, "/server_info", method="GET")[1]["weight_op_in_progress"] != "init_weights_update_group":
                assert time.monotonic() < deadline, "the first join never started"
                time.sleep(0.05)
        second = [pool.submit(join, x, "B", port_b, 1), pool.submit(join, y, "A", port_a, 2)]
        hosts = [pool.submit(host, "A", port_a, 4.0), pool.submit(host, "B", port_b, 4.0)]
        for hosting in hosts:
            with pytest.raises(Exception):  # noqa: B017 - torch raises several types for a rendezvous timeout
                hosting.result(timeout=60)
        replies = [call.result(timeout=4 * GROUP_TIMEOUT_S + 30) for call in first + second]
    assert all(status == 400 and not reply["success"] for status, reply in replies), replies
    # Both servers got over it: a group joined in one order by both works.
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        joins = [pool.submit(join, x, "C", port, 1), pool.submit(join, y, "C", port, 2)]
        group = host("C", port, 30.0)
        assert all(done.result(timeout=60)[0] == 200 for done in joins)
    for url in (x, y):
        assert call(url, "/destroy_weights_update_group", {"group_name": "C"})[0] == 200
    torch.distributed.destroy_process_group(group)


@pytest.mark.parametrize("pp, ep, transport, fanout", [
    (2, 1, "distributed", False),
    (1, 2, "distributed", False),
    (2, 1, "tensor", True),
], ids=["pp2-distributed", "ep2-distributed", "pp2-tensor-fanout"])
def test_several_senders_load_two_servers_exactly(servers, tmp_path, pp, ep, transport, fanout):
    seed = 100 + 10 * pp + ep + (5 if fanout else 0)
    urls = [server.url for server in servers]
    devices = ["fake-gpu-0", "fake-gpu-1"] if fanout else None
    server_devices = [["fake-gpu-1"], ["fake-gpu-0"]] if fanout else None  # server 0 on rank 1's device
    results = run_spawned(moe_rank, world_size=2, layout=None, timeout_s=180, urls=urls, pp=pp, ep=ep,
                          transport=transport, seed=seed, devices=devices, server_devices=server_devices)
    # Two senders, in turn order (PP stage, EP rank).
    assert [(stage, expert) for stage, expert, _ in results[0]["senders"]] == [(s, e) for s in range(pp)
                                                                                for e in range(ep)]
    expected = reference_digests(moe_weights(seed))
    assert any(".experts.3." in name for name in expected)
    assert results[0]["stats"].checksums == expected and results[1]["stats"] is None
    for url in urls:
        held = digests_of(url)
        assert {name: held[name] for name in expected} == expected
        assert call(url, "/model_info", method="GET")[1]["weight_version"] == f"{transport}-{seed}"
