"""Weight-sync transports on CUDA: CUDA IPC through the tensor transport, NCCL through the distributed one.

The trainer side is one rank in this process holding its shards on the GPU. CUDA IPC:
the tensor transport is built as a colocated trainer rank builds it on GPUs (fan-out,
with the server TP rank's GPU named by UUID in `server_devices`, here this rank's own
GPU); megarl's CPU engine server maps the bucket buffers (torch's CUDA IPC reductions)
and loads them; bit-identical weights are checked against digests of the trainer's HF
tensors. The same one-rank fan-out path runs on CPU too (shared memory, a made-up
device name on both sides), so its set-up is checked where there is no GPU. Where
SGLang is importable, SGLang 0.5.23's own deserializer (`sglang.srt.utils`, with the
reductions `sglang.srt.utils.patch_torch` patches) must also read the payload the
transport sends. NCCL refuses two ranks of one communicator on one GPU, so the
broadcast test needs a second GPU for the server.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from _weightsync_ranks import API_KEY, ARCH, BUCKET_BYTES, CONFIG, local_shards, reference_digests, server_digests
from _weightsync_ranks import trainer_weights
from transformers import LlamaConfig, LlamaForCausalLM

from megarl.rollout.client import RolloutClient
from megarl.rollout.server import start_cpu_engine
from megarl.rollout.weight_wire import device_uuid
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, assemble_bucket, build_plan
from megarl.weightsync.distributed_transport import DistributedTransport
from megarl.weightsync.tensor_transport import TensorTransport

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-sync")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(root / "model")
    return root / "model"


def _push(model_dir, tmp_path, transport_of, *, env=None, seed: int, device: str = "cuda",
          device_id: str | None = None) -> None:
    """One sync of seeded weights on `device` through `transport_of(client)` into a fresh CPU engine; asserts
    bit-identity. `device_id`: this rank's device name for the sync groups (default: its GPU's UUID)."""
    server = start_cpu_engine(model_dir, api_key=API_KEY, log_path=tmp_path / "server.log", env=env)
    try:
        with RolloutClient([server.url], api_key=API_KEY, timeout_s=120) as client:
            plan = build_plan(ARCH, TrainerLayout(), dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
            groups = SyncGroups.build(RankCoords(), timeout_s=120, device=device_id)
            syncer = WeightSyncer(plan, transport_of(client), groups, client=client, verify=True)
            try:
                hf = trainer_weights(seed)
                local = {key: tensor.to(device) for key, tensor in
                         local_shards(hf, TrainerLayout(), padded_vocab=plan.padded_vocab).items()}
                stats = syncer.push(local, weight_version=f"{device}-{seed}")
            finally:
                syncer.close()
            held = server_digests(client)
            assert {name: held[name] for name in hf} == reference_digests(hf)
            assert stats.checksums == reference_digests(hf)
    finally:
        server.stop()


def colocated_tensor_transport(client: RolloutClient, device: torch.device, device_id: str) -> TensorTransport:
    """The tensor transport of a one-rank colocated trainer: fan-out to the server's one TP rank, which runs on
    this rank's device `device_id` (a GPU's UUID, as the fleet reports it)."""
    return TensorTransport(client, device=device, server_devices=[[device_id]], fanout=True)


@pytest.mark.gpu
def test_cuda_ipc_buckets_load_into_the_engine(model_dir, tmp_path):
    gpu = device_uuid(torch.cuda.current_device())
    _push(model_dir, tmp_path, lambda client: colocated_tensor_transport(client, torch.device("cuda", 0), gpu),
          seed=41)


@pytest.mark.dist
def test_the_one_rank_fanout_path_of_the_cuda_ipc_test_loads_the_engine_on_cpu(model_dir, tmp_path):
    _push(model_dir, tmp_path, lambda client: colocated_tensor_transport(client, torch.device("cpu"), "fake-gpu-0"),
          seed=44, device="cpu", device_id="fake-gpu-0")


class _Recorder(BaseHTTPRequestHandler):
    """Records the body of each POST and answers `{"success": true}` (the reply SGLang gives an applied update)."""

    bodies: list = []

    def do_POST(self):
        length = int(self.headers["Content-Length"])
        self.bodies.append((self.path, json.loads(self.rfile.read(length))))
        reply = json.dumps({"success": True, "message": ""}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def _sglang_reads(entry: str, expected: dict) -> dict:
    """In a fresh process set up as an SGLang scheduler is (its patched torch reductions, which resolve a CUDA
    IPC handle's device by UUID): SGLang's own deserializer on one `serialized_named_tensors` entry."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    payload = MultiprocessingSerializer.deserialize(entry)
    flat = payload["flattened_tensor"]
    return {meta.name: bool(torch.equal(flat[meta.start_idx:meta.end_idx].cpu(), expected[meta.name]))
            for meta in payload["metadata"]}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_SGLANG, reason="needs sglang (not installed here)")
def test_sglang_deserializes_the_tensor_transport_payload():
    recorder = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=recorder.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{recorder.server_address[1]}"
        plan = build_plan(ARCH, TrainerLayout(), dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
        hf = trainer_weights(43)
        local = {key: t.cuda() for key, t in local_shards(hf, TrainerLayout(), padded_vocab=plan.padded_vocab).items()}
        bucket = plan.buckets[0]
        with RolloutClient([url], api_key=API_KEY, timeout_s=60) as client:
            transport = colocated_tensor_transport(client, torch.device("cuda", 0),
                                                   device_uuid(torch.cuda.current_device()))
            flat = transport.buffer(0, bucket.nbytes)
            named = assemble_bucket(bucket, lambda param, tp_rank: local[(param.vpp_rank, param.local_name)], out=flat)
            # The fan-out path's two halves on one rank: this rank's entry for server 0's TP rank 0, then the post.
            transport.post(bucket, transport.handles(bucket, flat, mine=[(0, 0)]))
            [(path, body)] = [(p, b) for p, b in _Recorder.bodies if p == "/update_weights_from_tensor"]
            expected = {name: tensor.cpu().view(-1).view(torch.uint8).clone() for name, tensor in named}
            ctx = torch.multiprocessing.get_context("spawn")
            with ctx.Pool(1) as pool:  # the sender keeps `flat` alive while SGLang maps it
                read = pool.apply(_sglang_reads, (body["serialized_named_tensors"][0], expected))
            transport.close()
        assert read == {name: True for name in expected}
    finally:
        recorder.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="NCCL refuses two ranks of one communicator on one GPU: needs 2 GPUs")
def test_nccl_broadcast_loads_into_an_engine_on_another_gpu(model_dir, tmp_path):
    _push(model_dir, tmp_path, lambda client: DistributedTransport(client, backend="nccl", timeout_s=120),
          env={"CUDA_VISIBLE_DEVICES": "1"}, seed=42)
