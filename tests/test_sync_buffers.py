"""The weight sync's buffers live for one sync where they take accelerator memory.

Two spawned bf16 trainer ranks (TP2) push twice into a CPU engine through the tensor
transport, assembling each bucket by point-to-point gather (as on GPUs: pack and
receive scratch) or in shared memory (the peer maps TP rank 0's buffer). With
`release_buffers=True` (what shards on a GPU get) every rank holds no bucket
buffer, no gather scratch and no mapping once a push has ended, and the next push
allocates them again and still loads the exact weights; by default on CPU the
buffers stay for the next sync. Whether a push frees them by default follows the
shards' device (checked without a GPU on a syncer whose shards say they are CUDA).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _engine_spawn import run_spawned
from _weightsync_ranks import API_KEY, ARCH, CONFIG, local_shards, reference_digests, server_digests
from _weightsync_ranks import trainer_weights
from megarl.rollout.client import RolloutClient
from megarl.weightsync import RankCoords, SyncGroups, TrainerLayout, WeightSyncer, build_plan, make_transport

BUCKET_BYTES = 40_000


def held(syncer: WeightSyncer) -> dict[str, int]:
    """What this rank keeps between pushes: ring buffers (bytes), gather scratch (bytes), mapped peer buffers."""
    return {"ring": sum(t.numel() for t in syncer.transport._ring._held.values()),
            "scratch": sum(t.numel() * t.element_size() for t in syncer._scratch.values()),
            "mappings": len(syncer._mappings._mapped)}


CASES = [(shared_memory, release) for shared_memory in (False, True) for release in (True, None)]


def tp2_rank(*, rank: int, world_size: int, port: int, url: str) -> dict:
    """Per (shared_memory, release) case: what this rank holds after each of two pushes, and (rank 0) the
    server's digests after each."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    coords = RankCoords(rank=rank, world_size=world_size, tp_rank=rank, tp_size=2)
    layout = TrainerLayout(tp=2)
    plan = build_plan(ARCH, layout, dtype=torch.bfloat16, bucket_bytes=BUCKET_BYTES)
    groups = SyncGroups.build(coords, timeout_s=60)
    same_host = groups.tp_same_host
    client = RolloutClient([url], api_key=API_KEY, timeout_s=60) if rank == 0 else None
    out = {}
    for shared_memory, release in CASES:
        groups.tp_same_host = same_host and shared_memory
        syncer = WeightSyncer(plan, make_transport("tensor", client, timeout_s=60), groups, client=client,
                              release_buffers=release)
        case = out[(shared_memory, release)] = {"held": [], "digests": []}
        for seed in (51, 52):
            local = local_shards(trainer_weights(seed, torch.bfloat16), layout, tp_rank=rank,
                                 padded_vocab=plan.padded_vocab)
            syncer.push(local, weight_version=f"v{seed}")
            case["held"].append(held(syncer))
            case["digests"].append(server_digests(client) if rank == 0 else None)
        syncer.close()
    if client is not None:
        client.close()
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, cpu_engine):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("sync-buffers")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(root / "model")
    return cpu_engine(root / "model", api_key=API_KEY, log_path=root / "server.log")


@pytest.fixture(scope="module")
def pushes(server):
    return run_spawned(tp2_rank, world_size=2, layout=None, timeout_s=300, url=server.url)


@pytest.mark.dist
@pytest.mark.parametrize("shared_memory, release", CASES,
                         ids=[f"{'shared-memory' if s else 'point-to-point-gather'}-{'released' if r else 'cpu-default'}"
                              for s, r in CASES])
def test_buffers_are_freed_after_each_push_when_released_and_kept_otherwise(pushes, shared_memory, release):
    case = [result[(shared_memory, release)] for result in pushes]
    for seed, digests in zip((51, 52), case[0]["digests"]):
        hf = trainer_weights(seed, torch.bfloat16)
        assert {key: digests[key] for key in hf} == reference_digests(hf)  # exact, also after re-allocating
    if release:
        assert [state for rank in case for state in rank["held"]] == [{"ring": 0, "scratch": 0, "mappings": 0}] * 4
    else:
        sender, peer = case[0]["held"][-1], case[1]["held"][-1]
        assert sender["ring"] > 0  # the sender's ring slots stay for the next sync
        assert (peer["mappings"] > 0) if shared_memory else (peer["scratch"] > 0)


class _Transport:
    def __init__(self):
        self.released = 0

    def release_buffers(self) -> None:
        self.released += 1


@pytest.mark.parametrize("is_cuda, released", [(True, 1), (False, 0)])
def test_by_default_a_push_frees_its_buffers_when_the_shards_are_on_a_gpu(monkeypatch, is_cuda, released):
    plan = build_plan(ARCH, TrainerLayout(), dtype=torch.float32, bucket_bytes=BUCKET_BYTES)
    transport = _Transport()
    syncer = WeightSyncer(plan, transport, SyncGroups.build(RankCoords(), timeout_s=10), client=None)
    monkeypatch.setattr(syncer, "_push", lambda local, weight_version: None)
    syncer.push({(0, "w"): SimpleNamespace(is_cuda=is_cuda)}, weight_version="v")
    assert transport.released == released
    monkeypatch.setattr(syncer, "_push", lambda local, weight_version: 1 / 0)
    with pytest.raises(ZeroDivisionError):  # a failed push frees them too
        syncer.push({(0, "w"): SimpleNamespace(is_cuda=is_cuda)}, weight_version="v")
    assert transport.released == 2 * released
