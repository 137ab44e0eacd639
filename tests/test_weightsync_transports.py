"""Each transport against a real CPU engine server: bit-identical weights, plain-forward log-probs, named failures.

The trainer side is plain processes holding Megatron shards of an HF state dict
(`shard_for_rank`): one in-process rank for TP1/PP1, and four spawned gloo ranks
for TP2 x PP2 (bf16, two stages sending at once); one slow test drives
`MegatronWorker.push_weights` on real Megatron ranks. "Bit-identical" is checked
independently of the transport's own checksum mode: the server's
`/weights_checker` checksums against checksums of the trainer's HF tensors. Also:
a corrupted tensor, a peer that never joins, a server restarted behind the same
URL, and MoE experts (EP2) loading into the engine's fused expert tensors.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _engine_spawn import run_spawned
from _settings import sampling
from _server_fork import fork_server
from _weightsync_ranks import (
    API_KEY,
    ARCH,
    BUCKET_BYTES,
    CONFIG,
    PP_TRANSPORTS,
    SYNC_BUCKET_BYTES,
    local_shards,
    megatron_moe_ep_push,
    megatron_worker_pushes,
    reference_digests,
    server_digests,
    tp2_pp2_rank,
    trainer_weights,
)
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from megarl.config.settings import WeightSyncSettings
from megarl.engines.protocol import WeightShards
from megarl.models import arch_from_hf, hf_to_megatron, random_hf_state_dict, shard_for_rank
from megarl.rollout.client import RolloutClient
from megarl.rollout.weight_wire import held_checksum, tensor_checksum
from megarl.rollout.cpu_engine.weights import apply_named_tensors, checked_tensors
from megarl.ports import free_port
from megarl.rollout.server import start_cpu_engine
from megarl.rollout.weight_wire import deserialize_named_tensors
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncError, WeightSyncer, assemble_bucket
from megarl.weightsync import build_plan, make_transport
from megarl.weightsync.distributed_transport import DistributedTransport
from megarl.weightsync.engine_sync import EngineWeightSync
from megarl.weightsync.tensor_transport import TensorTransport

pytestmark = pytest.mark.dist

PROMPTS = [[1, 2, 3, 4, 5], [17, 42]]


@pytest.fixture(scope="module")
def server(tmp_path_factory, cpu_engine):
    root = tmp_path_factory.mktemp("weightsync")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(root / "model")
    return cpu_engine(root / "model", api_key=API_KEY, log_path=root / "server.log", weight_version="v0")


@pytest.fixture
def client(server):
    with RolloutClient([server.url], api_key=API_KEY, timeout_s=60) as client:
        yield client


def one_rank_syncer(client, transport, *, dtype=torch.float32, verify=True) -> WeightSyncer:
    plan = build_plan(ARCH, TrainerLayout(), dtype=dtype, bucket_bytes=BUCKET_BYTES)
    return WeightSyncer(plan, transport, SyncGroups.build(RankCoords(), timeout_s=30), client=client, verify=verify)


@pytest.mark.parametrize("name", ["tensor", "distributed", "disk"])
def test_transport_loads_the_trainer_weights_exactly(client, name, tmp_path):
    syncer = one_rank_syncer(client, make_transport(name, client, timeout_s=30, disk_dir=tmp_path / "sync"))
    try:
        for step, seed in enumerate([11, 12]):  # the second sync reuses buffers (and broadcast groups)
            hf = trainer_weights(seed)
            local = local_shards(hf, TrainerLayout(), padded_vocab=syncer.plan.padded_vocab)
            stats = syncer.push(local, weight_version=f"{name}-{step}")
            held = server_digests(client)
            assert {key: held[key] for key in hf} == reference_digests(hf)
            assert stats.num_bytes == sum(t.numel() * 4 for t in hf.values()) and stats.gbps > 0
            assert stats.checksums == reference_digests(hf)
    finally:
        syncer.close()
    assert client.model_info()[0]["weight_version"] == f"{name}-1"
    reference = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    reference.load_state_dict(hf)
    results = client.generate(PROMPTS, sampling(4, temperature=0.0, ignore_eos=True), return_logprob=True)
    for prompt, result in zip(PROMPTS, results):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + result.output_ids])).logits[0]
        expected = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1].gather(
            1, torch.tensor(result.output_ids)[:, None])[:, 0]
        assert result.output_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-5)
        assert result.weight_version == f"{name}-1"
    if name == "disk":
        assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["vdisk-1"]  # staging renamed, vdisk-0 removed


def test_shared_bucket_buffers_leave_nothing_in_dev_shm_once_trainer_and_server_are_done(server, tmp_path):
    """The colocated buffers are /dev/shm files that both sides map; each side's release at close (the
    trainer's `syncer.close`, the server's shutdown) must remove them, or every run leaks its buckets."""
    handle = start_cpu_engine(server.log_path.parent / "model", api_key=API_KEY, log_path=tmp_path / "server.log",
                              spawn=fork_server)
    before = set(Path("/dev/shm").iterdir())
    try:
        with RolloutClient([handle.url], api_key=API_KEY, timeout_s=60) as client:
            syncer = one_rank_syncer(client, TensorTransport(client), verify=False)
            hf = trainer_weights(5)
            syncer.push(local_shards(hf, TrainerLayout(), padded_vocab=syncer.plan.padded_vocab), weight_version="x")
            assert {key: server_digests(client)[key] for key in hf} == reference_digests(hf)
            assert len(set(Path("/dev/shm").iterdir()) - before) == 2  # the two ring buffers, mapped by the server
            syncer.close()
    finally:
        handle.stop()
    assert set(Path("/dev/shm").iterdir()) - before == set()


class CorruptingTransport(TensorTransport):
    """A faulty wire: flips the bits of one tensor after the sender digested it."""

    victim = "model.layers.1.mlp.up_proj.weight"

    def send(self, bucket, flat, *, last):
        for tensor in bucket.tensors:
            if tensor.name == self.victim:
                flat[tensor.offset : tensor.offset + 4].bitwise_not_()
        super().send(bucket, flat, last=last)


def test_checksum_mismatch_raises_naming_the_tensor_and_keeps_the_old_version(client):
    before = client.model_info()[0]["weight_version"]
    syncer = one_rank_syncer(client, CorruptingTransport(client))
    local = local_shards(trainer_weights(21), TrainerLayout(), padded_vocab=syncer.plan.padded_vocab)
    with pytest.raises(WeightSyncError, match=r"verification failed.*model\.layers\.1\.mlp\.up_proj\.weight"):
        syncer.push(local, weight_version="corrupt")
    # Not published, and the update session was closed (a new one opens fine).
    assert client.model_info()[0]["weight_version"] == before
    one_rank_syncer(client, TensorTransport(client)).push(local, weight_version="repaired")
    assert server_digests(client)[CorruptingTransport.victim] == held_checksum(
        trainer_weights(21)[CorruptingTransport.victim])


class _SilentPeer(BaseHTTPRequestHandler):
    """Answers every SGLang control call with success, but never joins a process group."""

    def do_GET(self):
        self._reply({"tp_size": 1})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply({"success": True, "message": "ok"})

    def _reply(self, payload):
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_peer_that_never_joins_times_out_with_a_named_error():
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _SilentPeer)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    try:
        with RolloutClient([url], timeout_s=2) as client:
            syncer = one_rank_syncer(client, DistributedTransport(client, timeout_s=2.0), verify=False)
            local = local_shards(trainer_weights(1), TrainerLayout(), padded_vocab=syncer.plan.padded_vocab)
            start = time.monotonic()
            with pytest.raises(WeightSyncError) as raised:
                syncer.push(local, weight_version="never")
            assert time.monotonic() - start < 20
    finally:
        stub.shutdown()
    message = str(raised.value)
    assert "init weight-update group" in message and "timed out after 2 s" in message
    assert f"rank 1 = {url}: answered success" in message


class _RecordingTp2Server(_SilentPeer):
    """Says it has two TP ranks; keeps what each TP rank's entry of every update holds, read on arrival
    (the trainer refills its buffers once the request is answered)."""

    updates: list[list[dict[str, torch.Tensor]]] = []

    def do_GET(self):
        self._reply({"tp_size": 2})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/update_weights_from_tensor":
            self.updates.append([
                {name: tensor.clone() for name, tensor in deserialize_named_tensors(entry, load_format="flattened_bucket")}
                for entry in body["serialized_named_tensors"]])
        self._reply({"success": True, "message": "ok"})


def test_tensor_transport_sends_one_entry_per_server_tp_rank():
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingTp2Server)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    hf = trainer_weights(3)
    try:
        with RolloutClient([f"http://127.0.0.1:{stub.server_address[1]}"], timeout_s=10) as client:
            syncer = one_rank_syncer(client, TensorTransport(client), verify=False)
            syncer.push(local_shards(hf, TrainerLayout(), padded_vocab=syncer.plan.padded_vocab), weight_version="t")
            syncer.close()
    finally:
        stub.shutdown()
    assert len(_RecordingTp2Server.updates) == len(syncer.plan.buckets) > 1
    for bucket, (rank0, rank1) in zip(syncer.plan.buckets, _RecordingTp2Server.updates):
        # Each TP rank gets the whole bucket.
        assert sorted(rank0) == sorted(rank1) == sorted(tensor.name for tensor in bucket.tensors)
        assert all(torch.equal(rank0[name], hf[name]) and torch.equal(rank1[name], hf[name]) for name in rank0)


# ---- TP2 x PP2: four spawned trainer ranks (`_weightsync_ranks.tp2_pp2_rank`), two stage senders at once ----

@pytest.mark.parametrize("shared_memory, transports", [(True, list(PP_TRANSPORTS)), (False, ["tensor"])],
                         ids=["shared-memory-assembly", "point-to-point-gather"])
def test_tp2_pp2_stage_senders_sync_in_parallel(server, client, tmp_path, shared_memory, transports):
    results = run_spawned(tp2_pp2_rank, world_size=4, layout=None, timeout_s=120, url=server.url,
                          disk_dir=str(tmp_path / "sync"), transports=transports, shared_memory=shared_memory)
    assert all(result["same_host"] for result in results)  # four local processes: one host
    for name in transports:
        seed = PP_TRANSPORTS[name]
        stats, digests = results[0][name]
        hf = trainer_weights(seed, torch.bfloat16)
        # bf16 trainer, float32 server: the widening cast is exact, so the digests agree.
        assert {key: digests[key] for key in hf} == reference_digests(hf), name
        assert stats.num_bytes == sum(t.numel() * 2 for t in hf.values())
        assert all(results[rank][name][0] is None for rank in range(1, 4))
    assert client.model_info()[0]["weight_version"] == f"pp-{transports[-1]}"


@pytest.mark.slow
def test_megatron_worker_pushes_through_every_path(server, tmp_path):
    """The controller's entry point on real Megatron ranks (TP2 x PP2): each transport, then the default."""
    hf = trainer_weights(41)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.load_state_dict(hf)
    model.save_pretrained(tmp_path / "trainer")
    results = run_spawned(megatron_worker_pushes, world_size=4, layout={"tp": 2, "pp": 2}, timeout_s=240,
                          checkpoint=str(tmp_path / "trainer"), url=server.url, disk_dir=str(tmp_path / "sync"))
    assert all(result == {} for result in results[1:])
    expected = reference_digests(hf)
    for version, (metrics, digests, reported) in results[0].items():
        assert {key: digests[key] for key in hf} == expected, version
        assert reported == str(version)
        assert metrics["perf/weight_sync_gbps"] > 0 and metrics["weight_sync/seconds"] > 0
    assert results[0][0][0]["weight_sync/bytes"] == sum(t.numel() * 4 for t in hf.values())


def test_distributed_groups_are_rebuilt_after_a_server_restarts_at_the_same_url(tmp_path):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(tmp_path / "model")
    port = free_port()
    plan = build_plan(ARCH, TrainerLayout(), dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
    sync = EngineWeightSync()
    for seed in (51, 52):  # the second push finds a new server process behind the same URL
        handle = start_cpu_engine(tmp_path / "model", port=port, api_key=API_KEY, log_path=tmp_path / f"{seed}.log",
                                  spawn=fork_server)
        try:
            hf = trainer_weights(seed)
            local = local_shards(hf, TrainerLayout(), padded_vocab=plan.padded_vocab)
            shards = WeightShards(local, num_chunks=1, arch=ARCH, padded_vocab=plan.padded_vocab)
            settings = WeightSyncSettings(transport="distributed", bucket_bytes=SYNC_BUCKET_BYTES, verify="checksum",
                                          timeout_s=30, disk_dir=str(tmp_path / "unused"), lora="merged")
            metrics = sync.push(shards, coords=RankCoords(), urls=[handle.url], api_key=API_KEY, version=seed,
                                settings=settings)
            assert metrics["weight_sync/bytes"] == plan.nbytes
            with RolloutClient([handle.url], api_key=API_KEY) as client:
                assert {key: server_digests(client)[key] for key in hf} == reference_digests(hf)
        finally:
            handle.stop()
    sync.close()


def test_moe_ep2_buckets_load_into_the_cpu_engine_model():
    """Experts leave the trainer with checkpoint names; the CPU engine's transformers model fuses them."""
    config = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                  norm_topk_prob=True, tie_word_embeddings=False)
    arch = arch_from_hf({"model_type": "qwen3_moe", **config})
    gen = torch.Generator().manual_seed(7)
    hf = {name: torch.randn(t.shape, generator=gen) for name, t in random_hf_state_dict(arch, seed=0).items()}
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in hf
    layout = TrainerLayout(dp=2, ep=2)
    plan = build_plan(arch, layout, dtype=torch.float32, bucket_bytes=20_000)
    full = hf_to_megatron(hf, arch, padded_vocab=plan.padded_vocab)
    shards = {ep: shard_for_rank(full, num_layers=2, tie_word_embeddings=False, tp_rank=0, tp_size=1, pp_rank=0,
                                 pp_size=1, ep_rank=ep, ep_size=2)[0] for ep in range(2)}
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).eval()
    for bucket in plan.buckets:  # what EP rank 0 and EP rank 1 send, bucket by bucket
        named = assemble_bucket(bucket, lambda param, tp_rank: shards[param.ep_rank][param.local_name])
        apply_named_tensors(model, named)
    held = {name: tensor_checksum(tensor) for name, tensor in checked_tensors(model).items()}
    assert {name: held[name] for name in hf} == reference_digests(hf)


@pytest.mark.slow
def test_megatron_moe_ep2_push_loads_every_expert_into_the_server(tmp_path):
    """Real Megatron ranks holding half the experts each (EP2): each EP rank sends its own experts under
    their global index, and the CPU engine ends up with the checkpoint's weights bit for bit."""
    config = Qwen3MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=False)
    for seed, name in [(0, "served"), (1, "trainer")]:
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.1)  # HF leaves experts and router uninitialised
        model.save_pretrained(tmp_path / name)
    handle = start_cpu_engine(tmp_path / "served", api_key=API_KEY, log_path=tmp_path / "server.log", spawn=fork_server)
    try:
        results = run_spawned(megatron_moe_ep_push, world_size=2, layout={"tp": 1, "pp": 1, "ep": 2}, timeout_s=240,
                              checkpoint=str(tmp_path / "trainer"), url=handle.url)
    finally:
        handle.stop()
    assert results[1]["metrics"] is None
    expected = {name: held_checksum(tensor) for name, tensor in model.state_dict().items()}
    held = results[0]["digests"]
    assert any(".experts." in name for name in expected)
    assert {name: held[name] for name in expected} == expected
