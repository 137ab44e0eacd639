"""Sharded loading and Transformer Engine names, in one process (no megatron process groups).

Every rank's shard is cut from HF slices (`megatron_pieces`) and must equal what the
independent full-layout path cuts (`hf_to_megatron` then `shard_tensor`); a rank reads
only the slices it holds. Model chunks named as megatron's Transformer Engine spec
names them (fused norm weights inside linear_qkv / linear_fc1, `_extra_state` tensors
in every TE linear) load, sync and export like local-spec chunks.

The TE state-dict names cannot come from megatron's TE spec without transformer-engine;
they come from megatron's local spec, whose `sharded_state_dict_keys_map` renames its
norms to exactly TE's names (megatron-core gpt_layer_specs.py; TE's LayerNormLinear
registers `layer_norm_weight`, and `layer_norm_bias` only for LayerNorm, not RMSNorm).
In a MoE layer the TE spec keeps the pre-MLP norm as a module (`pre_mlp_layernorm`).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from megarl.engines import gpt, hf_reader, hf_weights
from megarl.engines.checkpoint import checkpoint_key
from megarl.models import (
    TE_FUSED_NORMS,
    arch_from_hf,
    canonical_name,
    fill_from_pieces,
    hf_param_shapes,
    hf_sources,
    hf_to_megatron,
    megatron_param_shapes,
    megatron_pieces,
    megatron_to_hf,
    padded_vocab_size,
    shard_for_rank,
    tp_split_dim,
)
from megarl.models.sharding import shard_tensor
from megarl.weightsync.plan import TrainerLayout, assemble_bucket, build_plan

DENSE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2)
CONFIGS = {
    "llama": {"model_type": "llama", **DENSE, "num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", **DENSE, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", **DENSE, "head_dim": 16, "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", **DENSE, "head_dim": 16, "tie_word_embeddings": False,
                  "num_experts": 4, "moe_intermediate_size": 32, "num_experts_per_tok": 2},
}
_TE_LINEARS = re.compile(r"(linear_qkv|linear_proj|linear_fc1|linear_fc2)$")


def _hf_weights(arch, seed: int = 0) -> dict[str, torch.Tensor]:
    """Distinct random values everywhere (norms and biases too), so a swapped slice cannot hide."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in hf_param_shapes(arch).items()}


def _megatron_te_keys_map() -> dict[str, str]:
    """Megatron's own renaming of the local spec's norms to TE's names (its dist-checkpoint key map)."""
    spec = gpt.gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return dict(spec.submodules.sharded_state_dict_keys_map)


def _te_name(local_name: str, arch) -> str:
    """The name megatron's TE spec gives a parameter the local spec calls `local_name`."""
    for local_prefix, te_prefix in _megatron_te_keys_map().items():
        if arch.is_moe and local_prefix == "pre_mlp_layernorm.":
            continue  # TE's MoE layer keeps a pre-MLP norm module of its own
        local_prefix, te_prefix = "." + local_prefix, "." + te_prefix
        if local_prefix in local_name:
            return local_name.replace(local_prefix, te_prefix)
    return local_name


class _TELinear(torch.nn.Module):
    """Stands in for a TE linear module: its state dict carries an `_extra_state` tensor (FP8 metadata)."""

    def get_extra_state(self):
        return torch.zeros(5, dtype=torch.uint8)

    def set_extra_state(self, state):
        pass


def _te_chunk(local_shapes: dict[str, tuple[int, ...]], arch) -> torch.nn.Module:
    """A module tree with the TE spec's parameter names (garbage values) for a chunk of these local shards."""
    root = torch.nn.Module()
    for local_name, shape in local_shapes.items():
        *path, leaf = _te_name(local_name, arch).split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, _TELinear() if _TE_LINEARS.search(part) else torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, 7.0)))
    return root


def test_te_fused_norm_names_are_megatrons_own_mapping():
    keys_map = _megatron_te_keys_map()
    assert {te + "weight": local + "weight" for local, te in keys_map.items()} == TE_FUSED_NORMS
    assert canonical_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    for same in ("decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
                 "decoder.layers.1.self_attention.q_layernorm.weight", "output_layer.weight"):
        assert canonical_name(same) == same
    # Fused norms are replicated over TP, the linear layer they live in is column-parallel.
    assert tp_split_dim("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") is None
    assert tp_split_dim("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") is None
    assert tp_split_dim("decoder.layers.0.mlp.linear_fc1.weight") == 0


def test_checkpoints_store_the_moe_pre_mlp_norm_under_the_local_specs_key():
    # Megatron's local spec stores the pre-MLP norm as `mlp.linear_fc1.layer_norm_weight` in every layer
    # (its keys map above); TE's MoE layer would store `pre_mlp_layernorm.weight` unless aliased.
    assert checkpoint_key("decoder.layers.pre_mlp_layernorm.weight") == \
        "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    for same in ("decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.router.weight",
                 "embedding.word_embeddings.weight"):
        assert checkpoint_key(same) == same


# TP sizes that divide each family's query groups (2, or 4 for llama).
_TP_CASES = [(family, tp) for family in sorted(CONFIGS) for tp in (1, 2, 4)
             if arch_from_hf(CONFIGS[family]).num_query_groups % tp == 0]


@pytest.mark.parametrize("family,tp", _TP_CASES)
def test_pieces_cut_the_shards_that_shard_tensor_cuts(family, tp):
    arch = arch_from_hf(CONFIGS[family])
    padded = padded_vocab_size(arch.vocab_size, tp_size=tp)
    hf = _hf_weights(arch)
    full = hf_to_megatron(hf, arch, padded_vocab=padded)
    assert {name: tuple(t.shape) for name, t in full.items()} == megatron_param_shapes(arch, padded_vocab=padded)
    for name, tensor in full.items():
        for tp_rank in range(tp):
            expected = shard_tensor(name, tensor, tp_rank, tp)
            pieces = megatron_pieces(name, arch, padded_vocab=padded, tp_rank=tp_rank, tp_size=tp)
            shard = fill_from_pieces(torch.full(expected.shape, float("nan")), pieces,
                                     lambda view, p: view.copy_(hf[p.hf_name].narrow(p.dim, p.src_start, p.length)))
            assert torch.equal(shard, expected), (name, tp_rank)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_sources_rebuild_every_hf_tensor(family):
    arch = arch_from_hf(CONFIGS[family])
    full = hf_to_megatron(_hf_weights(arch), arch, padded_vocab=384)
    expected = megatron_to_hf(full, arch)
    sources = hf_sources(arch, padded_vocab=384)
    assert set(sources) == set(expected)
    for name, shape in hf_param_shapes(arch).items():
        rebuilt = torch.full(shape, float("nan"))
        for param, piece in sources[name]:
            rebuilt.narrow(piece.dim, piece.src_start, piece.length).copy_(
                full[param].narrow(piece.dim, piece.dst_start, piece.length))
        assert torch.equal(rebuilt, expected[name]), name


class _CountingSlices(hf_reader.CheckpointSlices):
    """Counts the elements every slice read returns."""

    read_elements = 0

    def copy_into(self, target, piece):
        self.read_elements += target.numel()
        super().copy_into(target, piece)


def _write_sharded_checkpoint(hf: dict, path) -> None:
    """An HF checkpoint split over two files with an index, as large checkpoints are."""
    path.mkdir()
    names = sorted(hf)
    weight_map = {}
    for index, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{index + 1}-of-00002.safetensors"
        save_file({name: hf[name].to(torch.bfloat16) for name in part}, str(path / file))
        weight_map.update({name: file for name in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("family,tp,pp,ep", [("qwen2", 2, 2, 1), ("qwen3", 2, 2, 1), ("llama", 4, 1, 1),
                                             ("qwen3_moe", 1, 2, 2)])
def test_each_rank_reads_only_its_slices_into_te_named_chunks(family, tp, pp, ep, tmp_path, monkeypatch):
    arch = arch_from_hf(CONFIGS[family])
    padded = padded_vocab_size(arch.vocab_size, tp_size=tp)
    hf = {name: t.to(torch.bfloat16) for name, t in _hf_weights(arch, seed=3).items()}
    _write_sharded_checkpoint(hf, tmp_path / "hf")
    # Blocks of a few rows: every large slice is read in several pieces.
    monkeypatch.setattr(hf_reader, "READ_BLOCK_BYTES", 4 * 64 * 5)
    full = hf_to_megatron(hf, arch, padded_vocab=padded)
    for tp_rank in range(tp):
        for pp_rank in range(pp):
            for ep_rank in range(ep):
                coords = dict(tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, ep_rank=ep_rank, ep_size=ep)
                expected = shard_for_rank(full, num_layers=arch.num_layers,
                                          tie_word_embeddings=arch.tie_word_embeddings, vpp_size=1, **coords)[0]
                chunk = _te_chunk({name: tuple(t.shape) for name, t in expected.items()}, arch)
                assert any(name.endswith("._extra_state") for name in chunk.state_dict())
                source = _CountingSlices(tmp_path / "hf")
                hf_weights.check_source(source.shapes, arch, backbone_only=False, where="test")
                hf_weights.load_into_chunks([chunk], arch, source, padded_vocab=padded, backbone_only=False, **coords)
                loaded = gpt.chunk_weights(chunk)
                assert set(loaded) == set(expected)
                for name, tensor in expected.items():
                    assert torch.equal(loaded[name], tensor), (name, coords)
                # Only this rank's slices were read: its shard, less the vocab padding rows (zeros, never read).
                padding = sum(int((t == 0).all(dim=-1).sum()) * t.shape[-1] for name, t in expected.items()
                              if name in ("embedding.word_embeddings.weight", "output_layer.weight"))
                assert source.read_elements == sum(t.numel() for t in expected.values()) - padding


def test_a_value_model_keeps_its_head_and_a_bad_checkpoint_is_named(tmp_path):
    arch = arch_from_hf(CONFIGS["qwen3"])
    hf = _hf_weights(arch, seed=4)
    save_file({k: v for k, v in hf.items() if k != "lm_head.weight"}, str((tmp_path / "model.safetensors")))
    source = hf_reader.CheckpointSlices(tmp_path)
    hf_weights.check_source(source.shapes, arch, backbone_only=True, where="test")  # no LM head needed
    with pytest.raises(ValueError, match=r"HF checkpoint x does not match the model config: lm_head.weight: missing"):
        hf_weights.check_source(source.shapes, arch, backbone_only=False, where="HF checkpoint x")
    full = hf_to_megatron({**hf}, arch, padded_vocab=384)
    shards = shard_for_rank(full, num_layers=4, tie_word_embeddings=False, tp_rank=0, tp_size=1, pp_rank=0,
                            pp_size=1)[0]
    shapes = {name: tuple(t.shape) for name, t in shards.items()}
    shapes["output_layer.weight"], shapes["output_layer.bias"] = (1, 64), (1,)  # a value head instead
    chunk = _te_chunk(shapes, arch)
    hf_weights.load_into_chunks([chunk], arch, source, padded_vocab=384, backbone_only=True, tp_rank=0, tp_size=1,
                                pp_rank=0, pp_size=1)
    loaded = gpt.chunk_weights(chunk)
    assert torch.equal(loaded["output_layer.weight"], torch.full((1, 64), 7.0))  # untouched
    assert torch.equal(loaded["decoder.layers.2.input_layernorm.weight"], hf["model.layers.2.input_layernorm.weight"])


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_te_named_shards_go_through_the_weight_sync_plan(family):
    """The engine hands the sync `chunk_weights` of its chunks: under TE names they assemble the same HF tensors."""
    arch = arch_from_hf(CONFIGS[family])
    hf = _hf_weights(arch, seed=5)
    layout = TrainerLayout(tp=2, pp=2) if not arch.is_moe else TrainerLayout(pp=2, dp=2, ep=2)
    plan = build_plan(arch, layout, dtype=torch.float32, bucket_bytes=1 << 14)
    full = hf_to_megatron(hf, arch, padded_vocab=plan.padded_vocab)
    weights = {}
    for tp_rank in range(layout.tp):
        for pp_rank in range(layout.pp):
            for ep_rank in range(layout.ep):
                shard = shard_for_rank(full, num_layers=arch.num_layers, tie_word_embeddings=arch.tie_word_embeddings,
                                       tp_rank=tp_rank, tp_size=layout.tp, pp_rank=pp_rank, pp_size=layout.pp,
                                       ep_rank=ep_rank, ep_size=layout.ep)[0]
                chunk = _te_chunk({name: tuple(t.shape) for name, t in shard.items()}, arch)
                for name, param in chunk.named_parameters():
                    param.data.copy_(shard[canonical_name(name)])
                weights[(tp_rank, pp_rank, ep_rank)] = gpt.chunk_weights(chunk)
    sent = {}
    for bucket in plan.buckets:
        named = assemble_bucket(bucket, lambda param, tp_rank: weights[(tp_rank, param.pp_rank, param.ep_rank)][
            param.local_name])
        sent.update({name: tensor.clone() for name, tensor in named})
    assert set(sent) == set(hf)
    for name, tensor in hf.items():
        assert torch.equal(sent[name], tensor), name
