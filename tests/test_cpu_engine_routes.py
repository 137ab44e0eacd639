"""The CPU engine serves only routes SGLang 0.5.23 has, each with SGLang's methods, and its weight checker
computes what SGLang's does.

`SGLANG_ROUTES` holds the routes of SGLang's HTTP server (`srt/entrypoints/http_server.py`, its route
decorators) that megarl can use, with their methods; a route the CPU engine adds beyond them (as
`/weights_checksum` once was) would make a CPU test pass where a cluster fails.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
from fastapi.routing import APIRoute
from _tiny import tiny_model

from megarl.rollout.cpu_engine.engine import EngineArgs
from megarl.rollout.cpu_engine.http_server import ROUTERS, build_app
from megarl.rollout.cpu_engine.weight_checker import WeightChecker

SGLANG_ROUTES = {
    "/health": {"GET"},
    "/health_generate": {"GET"},
    "/model_info": {"GET"},
    "/get_model_info": {"GET"},
    "/server_info": {"GET"},
    "/get_server_info": {"GET"},
    "/generate": {"POST", "PUT"},
    "/flush_cache": {"GET", "POST"},
    "/abort_request": {"POST"},
    "/pause_generation": {"POST"},
    "/continue_generation": {"POST"},
    "/begin_weight_update": {"POST"},
    "/end_weight_update": {"POST"},
    "/update_weights_from_disk": {"POST"},
    "/init_weights_update_group": {"POST"},
    "/destroy_weights_update_group": {"POST"},
    "/update_weights_from_tensor": {"POST"},
    "/update_weights_from_distributed": {"POST"},
    "/update_weight_version": {"POST"},
    "/release_memory_occupation": {"GET", "POST"},
    "/resume_memory_occupation": {"GET", "POST"},
    "/weights_checker": {"GET", "POST"},
    "/load_lora_adapter": {"POST"},
    "/load_lora_adapter_from_tensors": {"POST"},
    "/unload_lora_adapter": {"POST"},
}


def test_every_route_is_one_of_sglangs_with_its_methods():
    app = build_app(EngineArgs(model_path="unused"))
    # The app's own routes, and those of the routers it includes (held as one entry each by FastAPI).
    routes = [route for route in app.routes if isinstance(route, APIRoute)]
    routes += [route for router in ROUTERS for route in router.routes]
    assert len(app.routes) == len([r for r in app.routes if isinstance(r, APIRoute)]) + len(ROUTERS)
    served = {route.path: set(route.methods) for route in routes}
    assert served, "the app serves nothing"
    extra = sorted(set(served) - set(SGLANG_ROUTES))
    assert not extra, f"routes SGLang does not have: {extra}"
    assert {path: methods for path, methods in served.items() if methods != SGLANG_ROUTES[path]} == {}
    assert "/weights_checker" in served and "/weights_checksum" not in served


def _sglang_checksum(tensor: torch.Tensor) -> str:
    """SGLang's per-tensor checksum written out: the first 8 bytes of the SHA-256 of the raw bytes, as hex."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{int.from_bytes(hashlib.sha256(raw).digest()[:8], 'big'):016x}"


def test_the_weight_checker_computes_sglangs_checksums_and_compares_snapshots():
    model = tiny_model("qwen2", seed=3)  # tied embeddings: one tensor, named once by the state dict's both names
    checker = WeightChecker(model)
    ok, _, reply = checker.handle("checksum")
    (rank,) = reply["ranks"]
    state = model.state_dict()
    assert ok and rank["checksums"] == {name: _sglang_checksum(tensor) for name, tensor in state.items()}
    assert not any("inv_freq" in name for name in rank["checksums"])  # non-persistent buffers are left out
    per_gpu = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        per_gpu.update(name.encode())
        per_gpu.update(rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == per_gpu.hexdigest()
    assert reply["per_engine_checksum"] == hashlib.sha256(per_gpu.hexdigest().encode()).hexdigest()
    assert rank["parallelism_info"]["tp_size"] == 1

    assert checker.handle("compare")[0] is False  # no snapshot yet
    assert checker.handle("snapshot")[0]
    assert checker.handle("compare") == (True, "Success", {})
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    ok, message, _ = checker.handle("compare")
    assert not ok and message == "check tensor equality failed: model.norm.weight"
    assert checker.handle("checksum")[2]["per_engine_checksum"] != reply["per_engine_checksum"]
    assert checker.handle("reset_tensors")[0] and not checker.handle("compare")[0]
    assert checker.handle("explode") == (False, "Unsupported action='explode' (one of ['checksum', 'snapshot', "
                                                 "'compare', 'reset_tensors'])", {})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_trainer_checksum_of_a_widened_bf16_tensor_equals_the_servers(dtype):
    from megarl.rollout.weight_wire import held_checksum, tensor_checksum

    trainer = torch.randn(4, 5).to(torch.bfloat16)
    assert held_checksum(trainer, dtype) == tensor_checksum(trainer.to(dtype))


def test_the_checker_walks_parameters_and_buffers_and_skips_by_sglangs_rule():
    """SGLang's `weight_checker.py` rule: every parameter and buffer (persistent or not) except names holding
    one of `_NON_PERSISTENT_BUFFER_PATTERNS`, tensors marked `_skip_weight_check`, and the request's
    `skip_tensor_list`; `_weight_fp32` is no pattern of SGLang's."""
    model = tiny_model("llama", seed=4)
    patterns = ("cos_sin_cache", "cos_cache", "sin_cache", "inv_freq", "freqs_cis", "expert_mask_gpu")
    layer = model.model.layers[0]
    for pattern in patterns:
        layer.register_buffer(pattern, torch.ones(2))  # persistent: in the state dict, skipped by SGLang
    layer.register_buffer("scale_table", torch.arange(3.0), persistent=False)  # no pattern: SGLang hashes it
    model.model.norm.register_buffer("_weight_fp32", torch.zeros(64))
    layer.mlp.up_proj.weight._skip_weight_check = True
    expected = {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                if not any(pattern in name for pattern in patterns) and name != "model.layers.0.mlp.up_proj.weight"}
    checksums = WeightChecker(model).handle("checksum")[2]["ranks"][0]["checksums"]
    assert checksums == {name: _sglang_checksum(tensor) for name, tensor in expected.items()}
    assert "model.layers.0.scale_table" in checksums and "model.norm._weight_fp32" in checksums

    checker = WeightChecker(model)
    skipped = checker.handle("checksum", ["self_attn", "lm_head"])[2]["ranks"][0]["checksums"]
    assert set(skipped) == {name for name in expected if "self_attn" not in name and "lm_head" not in name}
    assert checker.handle("snapshot")[0]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.add_(1.0)
    assert checker.handle("compare", ["self_attn"]) == (True, "Success", {})
    assert checker.handle("compare")[1] == "check tensor equality failed: model.layers.0.self_attn.q_proj.weight"
