"""The resharding plan against a single-rank export: per-rank shards -> the plan's copy program -> HF tensors.

Shards come from `megarl.models.sharding.shard_for_rank` on a random HF state dict
(norms and biases randomised too, so a swapped tensor cannot hide); the plan's
`assemble_bucket` must rebuild every HF tensor bitwise, with each tensor sent
exactly once, by TP rank 0 / DP rank 0 of the stage that holds it, in buckets that
respect the cap. Runs are also checked against hand-computed slices.
"""

from __future__ import annotations

import math

import pytest
import torch

from megarl.models import arch_from_hf, hf_param_shapes, hf_to_megatron, random_hf_state_dict, shard_for_rank
from megarl.weightsync.plan import Run, TrainerLayout, assemble_bucket, build_plan

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2)
MOE = dict(model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
           norm_topk_prob=True, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),  # q/k/v biases, tied embeddings
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=32),  # q/k norms, head_dim != h/heads
}
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2), (4, 1, 1)]


def random_hf(arch, seed: int, dtype=torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=gen).to(dtype) for name, t in random_hf_state_dict(arch, seed=0).items()}


def rank_shards(hf, arch, layout: TrainerLayout, padded_vocab: int) -> dict[tuple[int, int, int], list[dict]]:
    """shards[(tp_rank, pp_rank, ep_rank)] = the VPP chunk state dicts that rank's model holds."""
    full = hf_to_megatron(hf, arch, padded_vocab=padded_vocab)
    return {
        (tp, pp, ep): shard_for_rank(full, num_layers=arch.num_layers, tie_word_embeddings=arch.tie_word_embeddings,
                                     tp_rank=tp, tp_size=layout.tp, pp_rank=pp, pp_size=layout.pp,
                                     vpp_size=layout.vpp, ep_rank=ep, ep_size=layout.ep)
        for tp in range(layout.tp) for pp in range(layout.pp) for ep in range(layout.ep)
    }


def export(plan, shards) -> dict[str, torch.Tensor]:
    """Run every bucket's copy program in-process, as the stage senders would after their TP gather."""
    out = {}
    for bucket in plan.buckets:
        def shard_of(param, tp_rank, pp=bucket.pp_rank):
            return shards[(tp_rank, pp, param.ep_rank)][param.vpp_rank][param.local_name]

        for name, tensor in assemble_bucket(bucket, shard_of):
            assert name not in out, f"{name} sent twice"
            out[name] = tensor.clone()
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("tp,pp,vpp", LAYOUTS)
def test_plan_reassembles_the_hf_state_dict_bitwise(family, tp, pp, vpp):
    arch = arch_from_hf({**BASE, **FAMILIES[family]})
    hf = random_hf(arch, seed=tp * 100 + pp * 10 + vpp)
    layout = TrainerLayout(tp=tp, pp=pp, vpp=vpp)
    plan = build_plan(arch, layout, dtype=torch.float32, bucket_bytes=30_000)
    got = export(plan, rank_shards(hf, arch, layout, plan.padded_vocab))
    assert sorted(got) == sorted(hf) == sorted(hf_param_shapes(arch))
    for name, tensor in hf.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("cap", [1, 20_000, 200_000, 10**9])
def test_buckets_respect_the_cap_and_each_tensor_has_one_sender(cap):
    arch = arch_from_hf({**BASE, **FAMILIES["qwen2"]})
    layout = TrainerLayout(tp=2, pp=2, vpp=1, dp=3)
    plan = build_plan(arch, layout, dtype=torch.bfloat16, bucket_bytes=cap)
    names = plan.hf_names()
    assert sorted(names) == sorted(hf_param_shapes(arch)) and len(names) == len(set(names))
    for bucket in plan.buckets:
        sizes = [2 * math.prod(t.shape) for t in bucket.tensors]  # bf16
        assert bucket.nbytes == sum(sizes)
        # Over the cap only when one parameter alone is larger than the cap.
        assert bucket.nbytes <= cap or len(bucket.params) == 1
        # TP rank 0 of DP replica 0 of the stage: rank = tp_rank + tp * (dp_rank + dp * pp_rank).
        assert bucket.sender_rank == 2 * 3 * bucket.pp_rank
        assert all(param.pp_rank == bucket.pp_rank for param in bucket.params)
        offsets = [t.offset for t in bucket.tensors]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]  # back to back, in order
    # Buckets are per stage, stage 0's first: the embedding (stage 0) is in the first bucket.
    assert [b.pp_rank for b in plan.buckets] == sorted(b.pp_rank for b in plan.buckets)
    assert "model.embed_tokens.weight" in [t.name for t in plan.buckets[0].tensors]
    if cap == 1:
        assert len(plan.buckets) == sum(1 for b in plan.buckets for _ in b.params)


def test_tied_output_copy_of_the_last_stage_is_not_sent():
    arch = arch_from_hf({**BASE, **FAMILIES["qwen2"]})
    plan = build_plan(arch, TrainerLayout(pp=2), dtype=torch.float32, bucket_bytes=10**9)
    local_names = [p.local_name for b in plan.buckets for p in b.params]
    assert "output_layer.weight" not in local_names
    [embedding] = [p for b in plan.buckets for p in b.params if p.local_name == "embedding.word_embeddings.weight"]
    assert embedding.pp_rank == 0 and [t.name for t in embedding.outputs] == ["model.embed_tokens.weight"]


def test_runs_are_the_hand_computed_slices():
    """TP2, 4 heads in 2 query groups of head_dim 16, ffn 96, vocab 300 padded to 512."""
    arch = arch_from_hf({**BASE, **FAMILIES["llama"]})
    plan = build_plan(arch, TrainerLayout(tp=2, pp=2), dtype=torch.float32, bucket_bytes=10**9)
    params = {p.name: p for b in plan.buckets for p in b.params}
    outputs = {t.name: t for p in params.values() for t in p.outputs}
    # Each TP rank holds one query group: [q heads (2 x 16 rows), k (16), v (16)].
    assert outputs["model.layers.0.self_attn.q_proj.weight"].runs == (Run(0, 0, 0, 32), Run(1, 0, 32, 32))
    assert outputs["model.layers.0.self_attn.k_proj.weight"].runs == (Run(0, 32, 0, 16), Run(1, 32, 16, 16))
    assert outputs["model.layers.0.self_attn.v_proj.weight"].runs == (Run(0, 48, 0, 16), Run(1, 48, 16, 16))
    # fc1 shard r = [gate_r; up_r], 48 rows each half.
    assert outputs["model.layers.3.mlp.gate_proj.weight"].runs == (Run(0, 0, 0, 48), Run(1, 0, 48, 48))
    assert outputs["model.layers.3.mlp.up_proj.weight"].runs == (Run(0, 48, 0, 48), Run(1, 48, 48, 48))
    # Row-parallel: columns of each rank, along dim 1.
    down = outputs["model.layers.2.mlp.down_proj.weight"]
    assert down.dim == 1 and down.runs == (Run(0, 0, 0, 48), Run(1, 0, 48, 48))
    # Vocab rows 0..255 on rank 0, 256..299 of rank 1's 256 (the rest is padding, not sent).
    assert plan.padded_vocab == 512
    assert outputs["lm_head.weight"].runs == (Run(0, 0, 0, 256), Run(1, 0, 256, 44))
    # Replicated norms come from TP rank 0 only; layers 2-3 live on PP stage 1 as local layers 0-1.
    assert outputs["model.layers.2.input_layernorm.weight"].runs == (Run(0, 0, 0, 64),)
    layer2 = params["decoder.layers.2.input_layernorm.weight"]
    assert (layer2.pp_rank, layer2.local_name) == (1, "decoder.layers.0.input_layernorm.weight")


def test_vpp_places_global_layers_by_interleaved_chunks():
    arch = arch_from_hf({**BASE, **FAMILIES["llama"]})
    plan = build_plan(arch, TrainerLayout(pp=2, vpp=2), dtype=torch.float32, bucket_bytes=10**9)
    where = {p.name: (p.pp_rank, p.vpp_rank, p.local_name) for b in plan.buckets for p in b.params}
    # 4 layers, 1 per chunk: chunk v of rank p holds global layer v * 2 + p.
    assert where["decoder.layers.1.mlp.linear_fc2.weight"] == (1, 0, "decoder.layers.0.mlp.linear_fc2.weight")
    assert where["decoder.layers.2.mlp.linear_fc2.weight"] == (0, 1, "decoder.layers.0.mlp.linear_fc2.weight")


def test_bf16_buckets_write_into_a_given_buffer():
    arch = arch_from_hf({**BASE, **FAMILIES["qwen3"]})
    hf = random_hf(arch, seed=5, dtype=torch.bfloat16)
    layout = TrainerLayout(tp=2)
    plan = build_plan(arch, layout, dtype=torch.bfloat16, bucket_bytes=50_000)
    shards = rank_shards(hf, arch, layout, plan.padded_vocab)
    bucket = plan.buckets[1]
    out = torch.full((bucket.nbytes + 10,), 7, dtype=torch.uint8)
    named = assemble_bucket(bucket, lambda param, r: shards[(r, 0, 0)][param.vpp_rank][param.local_name], out=out)
    for name, view in named:
        assert view.data_ptr() >= out.data_ptr() and torch.equal(view, hf[name]), name
    assert torch.equal(out[bucket.nbytes:], torch.full((10,), 7, dtype=torch.uint8))  # nothing past the bucket


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 4)])
def test_moe_experts_are_sent_by_the_ep_rank_that_holds_them(tp, pp, ep):
    arch = arch_from_hf({**BASE, **MOE})
    hf = random_hf(arch, seed=ep)
    layout = TrainerLayout(tp=tp, pp=pp, dp=ep, ep=ep)
    plan = build_plan(arch, layout, dtype=torch.float32, bucket_bytes=20_000)
    got = export(plan, rank_shards(hf, arch, layout, plan.padded_vocab))
    assert sorted(got) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(got[name], tensor), name
    per_rank = 4 // ep
    for bucket in plan.buckets:
        # DP rank r < ep holds EP rank r's experts (Megatron's default rank order).
        assert bucket.sender_rank == layout.global_rank(tp_rank=0, pp_rank=bucket.pp_rank, dp_rank=bucket.ep_rank)
        for param in bucket.params:
            for out in param.outputs:
                if ".mlp.experts." in out.name:
                    expert = int(out.name.split(".mlp.experts.")[1].split(".")[0])
                    assert param.ep_rank == bucket.ep_rank == expert // per_rank, out.name
                    # Local names count experts from 0 on every EP rank.
                    assert f"local_experts.{expert % per_rank}." in param.local_name
                else:
                    assert bucket.ep_rank == 0, out.name  # dense tensors: EP rank 0 sends them


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_writes_only_its_own_runs_and_together_they_make_the_bucket(tp):
    """The shared-memory assembly: every TP rank writes its part of one buffer; no byte is written twice."""
    arch = arch_from_hf({**BASE, **FAMILIES["qwen2"]})  # biases and tied embeddings: replicated and split params
    hf = random_hf(arch, seed=tp, dtype=torch.bfloat16)
    layout = TrainerLayout(tp=tp)
    plan = build_plan(arch, layout, dtype=torch.bfloat16, bucket_bytes=60_000)
    shards = rank_shards(hf, arch, layout, plan.padded_vocab)
    for bucket in plan.buckets:
        out = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        written = torch.zeros(bucket.nbytes // 2, dtype=torch.int64)  # bf16 elements written, per position
        for tp_rank in range(tp):
            part = torch.full((bucket.nbytes,), 0xFF, dtype=torch.uint8)  # bf16 NaN pattern: untouched
            assemble_bucket(bucket, lambda param, r: shards[(r, 0, 0)][param.vpp_rank][param.local_name], out=part,
                            only_tp_rank=tp_rank)
            touched = part.view(torch.int16) != -1
            written += touched
            out.view(torch.int16)[touched] = part.view(torch.int16)[touched]
            if tp_rank > 0:  # replicated parameters (norms) are TP rank 0's alone
                for param in bucket.params:
                    if param.split_dim is None:
                        for hf_tensor in param.outputs:
                            assert not touched[hf_tensor.offset // 2 : (hf_tensor.offset + hf_tensor.nbytes) // 2].any()
        assert torch.equal(written, torch.ones_like(written)), f"bucket {bucket.index}"
        for tensor in bucket.tensors:
            got = out[tensor.offset : tensor.offset + tensor.nbytes].view(torch.bfloat16).view(tensor.shape)
            assert torch.equal(got, hf[tensor.name]), tensor.name
