"""`megarl plan`'s weight, gradient and optimizer bytes per rank against what the engines allocate.

One spawned job of two ranks builds engines at every layout below (TP1 x DP2, TP2,
PP2 with a tied embedding, PP2 x VPP2, EP2 of an MoE model, a value model, bf16 with float32
master weights, and megatron's distributed optimizer in float32 and bf16) and counts
their tensors (`_plan_ranks`); the plan predicts the same from the HF config alone.
Weights are exact (every parameter counted); gradients and optimizer state may differ
from the prediction by megatron's bucket padding (to a multiple of 128 x DP elements per
bucket with the distributed optimizer, which also moves a shard boundary between ranks),
at most 0.5% at these tiny sizes (0.26% measured) and far less at real ones. Megatron's local layer spec
(the CPU engines') builds its RMSNorm weights in float32 whatever the model dtype, where
Transformer Engine's (on GPUs, which the plan describes) uses the model dtype: in bf16
the prediction moves those few weights from the master copies to the weights
(`_local_spec_norms`).
"""

from __future__ import annotations

import pytest

from _engine_spawn import run_spawned
from _plan_ranks import allocated_bytes
from _tiny import TINY
from megarl.models.spec import arch_from_hf
from megarl.plan.memory import Layout, state_bytes
from megarl.plan.params import stage_params

WORLD = 2
DENSE = {**TINY, "model_type": "llama", "tie_word_embeddings": False}
TIED = {**TINY, "model_type": "qwen2", "tie_word_embeddings": True}
QWEN3 = {**TINY, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": False}
MOE = {**QWEN3, "model_type": "qwen3_moe", "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
CASES = {
    "tp1-dp2": dict(hf_config=DENSE, tp=1, pp=1, dtype="float32", head="lm"),
    "tp2": dict(hf_config=QWEN3, tp=2, pp=1, dtype="float32", head="lm"),
    "pp2-tied": dict(hf_config=TIED, tp=1, pp=2, dtype="float32", head="lm"),
    "pp2-vpp2": dict(hf_config={**DENSE, "num_hidden_layers": 4}, tp=1, pp=2, vpp=2, dtype="float32", head="lm"),
    "ep2": dict(hf_config=MOE, tp=1, pp=1, ep=2, dtype="float32", head="lm"),
    "tp2-value": dict(hf_config=TIED, tp=2, pp=1, dtype="float32", head="value"),
    "tp2-bf16": dict(hf_config=QWEN3, tp=2, pp=1, dtype="bfloat16", head="lm"),
    "distopt-dp2": dict(hf_config=DENSE, tp=1, pp=1, dtype="float32", head="lm", distributed_optimizer=True),
    "distopt-bf16-ep2": dict(hf_config=MOE, tp=1, pp=1, ep=2, dtype="bfloat16", head="lm",
                             distributed_optimizer=True),
}
PADDING = 0.005


def _predicted(case: dict, rank: int) -> dict[str, int]:
    arch = arch_from_hf(case["hf_config"])
    tp, pp, ep = case["tp"], case["pp"], case.get("ep", 1)
    layout = Layout(tp=tp, pp=pp, dp=WORLD // (tp * pp), ep=ep)
    params = stage_params(arch, tp=tp, pp=pp, ep=ep, pp_rank=rank // (WORLD // pp), value_head=case["head"] == "value")
    weights, gradients, optimizer = state_bytes(params, dtype=case["dtype"], trainable=True, layout=layout,
                                                distributed_optimizer=case.get("distributed_optimizer", False))
    if case["dtype"] != "float32":
        norms = _local_spec_norms(arch, pp=pp, pp_rank=rank // (WORLD // pp))
        weights, optimizer = weights + 2 * norms, optimizer - 4 * norms
    return {"weights": weights, "gradients": gradients, "optimizer": optimizer}


def _local_spec_norms(arch, *, pp: int, pp_rank: int) -> int:
    per_layer = 2 * arch.hidden_size + (2 * arch.head_dim if arch.qk_layernorm else 0)
    return arch.num_layers // pp * per_layer + (arch.hidden_size if pp_rank == pp - 1 else 0)


@pytest.fixture(scope="module")
def allocated() -> list[list[dict]]:
    return run_spawned(allocated_bytes, world_size=WORLD, cases=list(CASES.values()))


@pytest.mark.dist
@pytest.mark.parametrize("index, name", list(enumerate(CASES)))
def test_predicted_bytes_match_the_allocated_tensors(allocated, index, name):
    case = CASES[name]
    for rank in range(WORLD):
        counted, predicted = allocated[rank][index], _predicted(case, rank)
        assert counted["weights"] == predicted["weights"], (name, rank, counted, predicted)
        for kind in ("gradients", "optimizer"):
            assert abs(counted[kind] - predicted[kind]) <= PADDING * predicted[kind], (name, rank, kind, counted,
                                                                                        predicted)
