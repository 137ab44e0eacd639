"""HF <-> Megatron layout maps and TP/PP/VPP/EP sharding: exact round trips, hand-checked packing."""

from __future__ import annotations

import itertools

import pytest
import torch
from _tiny import FAMILIES, TINY, tiny_model

from megarl.errors import InputError
from megarl.models import (
    arch_from_hf,
    global_layer_index,
    hf_param_shapes,
    is_expert,
    hf_to_megatron,
    megatron_to_hf,
    merge_shards,
    padded_vocab_size,
    random_hf_state_dict,
    shard_for_rank,
    tp_split_dim,
    transformer_kwargs,
)

def _hf_model(family: str, **overrides):
    model = tiny_model(family, seed=0, randomise_norms=True, initializer_range=0.02, **overrides)
    return model.config.to_dict(), model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_megatron_round_trip_is_exact(family):
    hf_config, model = _hf_model(family)
    arch = arch_from_hf(hf_config)
    hf_sd = model.state_dict()
    assert set(hf_param_shapes(arch)) <= set(hf_sd)
    meg = hf_to_megatron(hf_sd, arch, padded_vocab=padded_vocab_size(arch.vocab_size))
    back = megatron_to_hf(meg, arch)
    assert set(back) == set(hf_param_shapes(arch))
    for name, tensor in back.items():
        assert torch.equal(tensor, hf_sd[name]), name


def test_family_features_land_in_the_megatron_names():
    shapes = {}
    for family in FAMILIES:
        hf_config, model = _hf_model(family)
        arch = arch_from_hf(hf_config)
        shapes[family] = hf_to_megatron(model.state_dict(), arch, padded_vocab=384)
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in shapes["qwen2"]
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in shapes["llama"]
    assert shapes["qwen3"]["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (16,)
    assert "decoder.layers.0.self_attention.q_layernorm.weight" not in shapes["qwen2"]
    assert "output_layer.weight" not in shapes["qwen2"]  # tied
    assert shapes["llama"]["output_layer.weight"].shape == (384, 64)


def test_qkv_packed_per_query_group_and_fc1_is_gate_then_up():
    hf_config, model = _hf_model("qwen2")
    arch = arch_from_hf(hf_config)
    hf_sd = model.state_dict()
    meg = hf_to_megatron(hf_sd, arch, padded_vocab=384)
    d, hpg = 16, 2  # head_dim = 64 / 4; 4 heads in 2 groups
    attn = "model.layers.1.self_attn."
    for param in ("weight", "bias"):
        q, k, v = (hf_sd[f"{attn}{p}_proj.{param}"] for p in "qkv")
        packed = meg[f"decoder.layers.1.self_attention.linear_qkv.{param}"]
        rows = []
        for g in range(2):
            rows += [q[(g * hpg + j) * d : (g * hpg + j + 1) * d] for j in range(hpg)]
            rows += [k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
        assert torch.equal(packed, torch.cat(rows))
    fc1 = meg["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf_sd["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf_sd["model.layers.0.mlp.up_proj.weight"])


def test_vocab_padding_is_zero_and_dropped_on_export():
    assert padded_vocab_size(300) == 384
    assert padded_vocab_size(300, tp_size=2) == 512
    assert padded_vocab_size(512, tp_size=2) == 512
    hf_config, model = _hf_model("llama")
    arch = arch_from_hf(hf_config)
    meg = hf_to_megatron(model.state_dict(), arch, padded_vocab=512)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert meg[name].shape == (512, 64)
        assert torch.count_nonzero(meg[name][300:]) == 0
    back = megatron_to_hf(meg, arch)
    assert back["model.embed_tokens.weight"].shape == (300, 64)
    assert back["lm_head.weight"].shape == (300, 64)


@pytest.mark.parametrize("tied", [False, True])
def test_shard_merge_round_trip_tp2_pp2_vpp2(tied):
    arch = arch_from_hf({"model_type": "qwen2", **TINY, "num_hidden_layers": 8, "tie_word_embeddings": tied})
    full = hf_to_megatron(random_hf_state_dict(arch, seed=3), arch, padded_vocab=padded_vocab_size(300, tp_size=2))
    layout = dict(num_layers=8, tie_word_embeddings=tied, tp_size=2, pp_size=2, vpp_size=2)
    shards = {}
    for tp_rank in range(2):
        for pp_rank in range(2):
            chunks = shard_for_rank(full, tp_rank=tp_rank, pp_rank=pp_rank, **layout)
            assert len(chunks) == 2
            for vpp_rank, chunk in enumerate(chunks):
                shards[(tp_rank, pp_rank, vpp_rank)] = chunk
    merged = merge_shards(shards, **layout)
    assert set(merged) == set(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name

    # Interleaved placement: chunk 1 of PP rank 0 holds global layers 4 and 5.
    assert global_layer_index(0, num_layers=8, pp_rank=0, pp_size=2, vpp_rank=1, vpp_size=2) == 4
    chunk = shards[(1, 0, 1)]
    assert sorted({n.split(".")[2] for n in chunk if n.startswith("decoder.layers.")}) == ["0", "1"]
    # TP rank 1 gets the second query group whole, and [gate_1; up_1] for fc1.
    qkv_full = full["decoder.layers.5.self_attention.linear_qkv.weight"]
    assert torch.equal(chunk["decoder.layers.1.self_attention.linear_qkv.weight"], qkv_full[64:])
    fc1_full = full["decoder.layers.5.mlp.linear_fc1.weight"]
    expected_fc1 = torch.cat([fc1_full[48:96], fc1_full[144:192]])
    assert torch.equal(chunk["decoder.layers.1.mlp.linear_fc1.weight"], expected_fc1)
    proj_full = full["decoder.layers.5.self_attention.linear_proj.weight"]
    assert torch.equal(chunk["decoder.layers.1.self_attention.linear_proj.weight"], proj_full[:, 32:])
    # Embedding only on the first chunk, final norm + output on the last one.
    assert "embedding.word_embeddings.weight" in shards[(0, 0, 0)]
    assert "embedding.word_embeddings.weight" not in shards[(0, 1, 0)]
    last = shards[(1, 1, 1)]
    assert "decoder.final_layernorm.weight" in last
    source = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert torch.equal(last["output_layer.weight"], full[source][256:])


def test_transformer_kwargs_and_rope_variants():
    kwargs = transformer_kwargs(
        {"model_type": "qwen3", **TINY, "head_dim": 16, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}}
    )
    assert kwargs["kv_channels"] == 16 and kwargs["qk_layernorm"] and not kwargs["add_qkv_bias"]
    assert kwargs["num_query_groups"] == 2 and kwargs["rotary_base"] == 5e5 and kwargs["rope_scaling_factor"] is None
    old_style = transformer_kwargs({"model_type": "qwen2", **TINY, "rope_theta": 1e6})
    assert old_style["rotary_base"] == 1e6 and old_style["add_qkv_bias"] and old_style["kv_channels"] == 16
    llama3 = transformer_kwargs(
        {
            "model_type": "llama",
            **TINY,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        }
    )
    assert llama3["rope_scaling_factor"] == 32.0


def test_bad_configs_raise_input_error_naming_the_value():
    with pytest.raises(InputError, match="model_type='mistral'.*llama, qwen2, qwen3"):
        arch_from_hf({"model_type": "mistral", **TINY})
    with pytest.raises(InputError) as info:
        arch_from_hf({"model_type": "llama", "vocab_size": 10, "hidden_act": "gelu"})
    text = str(info.value)
    assert "num_hidden_layers: required key missing" in text and "hidden_size: required key missing" in text
    with pytest.raises(InputError, match="hidden_act: is not supported \\(only 'silu'\\) \\(got 'gelu'\\)"):
        arch_from_hf({"model_type": "llama", **TINY, "hidden_act": "gelu"})
    with pytest.raises(InputError, match="model_type=None is not supported"):
        arch_from_hf(dict(TINY))


def test_a_family_is_one_registry_entry():
    from megarl.models.spec import ModelSpec
    from megarl.registry import MODEL_SPECS

    # A family that differs from Llama only in its name: registering its spec is all it takes.
    MODEL_SPECS.add("tinyllama_test", ModelSpec("tinyllama_test", always_qkv_bias=True, qk_layernorm=False))
    try:
        arch = arch_from_hf({"model_type": "tinyllama_test", **TINY})
        assert arch.model_type == "tinyllama_test" and arch.qkv_bias
    finally:
        MODEL_SPECS.remove("tinyllama_test")
    assert MODEL_SPECS.names() == ["llama", "qwen2", "qwen3", "qwen3_moe"]


MOE = dict(
    TINY,
    head_dim=16,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def test_qwen3_moe_round_trip_matches_the_hf_checkpoint_format(tmp_path):
    from safetensors.torch import load_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE))
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))  # one tensor per expert and projection
    arch = arch_from_hf(model.config.to_dict())
    assert (arch.num_experts, arch.moe_ffn_hidden_size, arch.moe_router_topk) == (4, 32, 2)
    assert arch.moe_norm_topk_prob is True
    assert set(hf_param_shapes(arch)) == set(on_disk)
    # In memory, transformers 5 fuses the experts; both forms convert to the same Megatron tensors.
    from_memory = hf_to_megatron(model.state_dict(), arch, padded_vocab=384)
    from_disk = hf_to_megatron(on_disk, arch, padded_vocab=384)
    assert set(from_memory) == set(from_disk)
    for name, tensor in from_disk.items():
        assert torch.equal(from_memory[name], tensor), name
    expert = "decoder.layers.1.mlp.experts.local_experts.3."
    hf_expert = "model.layers.1.mlp.experts.3."
    assert torch.equal(from_disk[expert + "linear_fc1.weight"][:32], on_disk[hf_expert + "gate_proj.weight"])
    assert torch.equal(from_disk[expert + "linear_fc2.weight"], on_disk[hf_expert + "down_proj.weight"])
    assert torch.equal(from_disk["decoder.layers.0.mlp.router.weight"], on_disk["model.layers.0.mlp.gate.weight"])
    back = megatron_to_hf(from_disk, arch)
    assert set(back) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(back[name], tensor), name


def test_expert_parallel_shards_hold_contiguous_expert_blocks():
    arch = arch_from_hf({"model_type": "qwen3_moe", **MOE})
    full = hf_to_megatron(random_hf_state_dict(arch, seed=2), arch, padded_vocab=512)
    layout = dict(num_layers=2, tie_word_embeddings=False, tp_size=2, pp_size=2)
    shards = {}
    for tp_rank, pp_rank, ep_rank in itertools.product(range(2), range(2), range(2)):
        (chunk,) = shard_for_rank(full, tp_rank=tp_rank, pp_rank=pp_rank, ep_rank=ep_rank, ep_size=2, **layout)
        shards[(tp_rank, pp_rank, 0, ep_rank)] = chunk
    # EP rank 1 of PP stage 1 holds global experts 2 and 3 of layer 1 as local 0 and 1, unsplit by TP.
    chunk = shards[(1, 1, 0, 1)]
    local = sorted({n.split(".")[6] for n in chunk if is_expert(n)})
    assert local == ["0", "1"]
    for e in (0, 1):
        name = f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"
        assert tp_split_dim(name) is None
        assert torch.equal(chunk[name], full[f"decoder.layers.1.mlp.experts.local_experts.{e + 2}.linear_fc1.weight"])
    assert torch.equal(chunk["decoder.layers.0.mlp.router.weight"], full["decoder.layers.1.mlp.router.weight"])
    merged = merge_shards(shards, ep_size=2, **layout)
    assert set(merged) == set(full)
    for name, tensor in full.items():
        assert torch.equal(merged[name], tensor), name


def test_moe_configs_outside_the_mapped_subset_are_input_errors():
    with pytest.raises(InputError, match=r"decoder_sparse_step: .* \(got 2\)"):
        arch_from_hf({"model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 2})
    with pytest.raises(InputError, match=r"mlp_only_layers: .* \(got \[0\]\)"):
        arch_from_hf({"model_type": "qwen3_moe", **MOE, "mlp_only_layers": [0]})
    with pytest.raises(InputError, match=r"num_experts_per_tok: must be in 1..num_experts = 4 \(got 5\)"):
        arch_from_hf({"model_type": "qwen3_moe", **MOE, "num_experts_per_tok": 5})
    missing = {k: v for k, v in MOE.items() if k != "moe_intermediate_size"}
    with pytest.raises(InputError, match="moe_intermediate_size: required key missing"):
        arch_from_hf({"model_type": "qwen3_moe", **missing})
