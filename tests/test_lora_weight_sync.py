"""The two LoRA weight syncs into CPU engines, from a TP2 LoRA actor behind its `MegatronWorker`.

Merged (`weight_sync.lora: merged`, tensor transport): W + (alpha/r) B A of the adapted linears only, through
the resharding plan, into a server without LoRA (which refuses adapters, as SGLang does without
`--enable-lora`). Adapter-only (`adapter`), into a server started with `--enable-lora`: version 1 through
`/load_lora_adapter_from_tensors` (tensor transport), version 2 from a directory through `/load_lora_adapter`
(disk), which replaces version 1: the server unloads it. A generation names the version's adapter. The
reference is the HF model wrapped by peft with each version's adapters: right after each sync both servers
must generate its greedy continuations and its log-probs (`rollout/logprob_diff` ~ 0, float32 noise of 1e-4
at most).
"""

from __future__ import annotations

import pytest
import torch

from _engine_spawn import run_spawned
from _http import call
from _lora_workers import lora_sync_pushes
from _tiny import greedy_continuation, tiny_model
from megarl.config.settings import LoraSettings
from megarl.models import arch_from_hf
from megarl.models.lora import TARGETS, initial_adapters
from megarl.rollout.weight_wire import lora_adapter_name
from test_lora_engine import peft_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]

API_KEY = "lora-sync-key"
SETTINGS = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=tuple(TARGETS), init="kaiming", seed=3)
PROMPTS = [[1, 2, 3, 4, 5], [17, 42], [200, 7, 9]]
STEPS = 6


def _version(arch, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) * 0.2 if name.endswith("lora_B") else t
            for name, t in initial_adapters(arch, rank=4, targets=TARGETS, init="kaiming", seed=seed).items()}


@pytest.fixture(scope="module")
def synced(tmp_path_factory, cpu_engine):
    root = tmp_path_factory.mktemp("lora-sync")
    model = tiny_model("llama", seed=6, attn_implementation="eager")
    model.save_pretrained(root / "hf")
    arch = arch_from_hf(model.config.to_dict())
    handles = {
        "merged": cpu_engine(root / "hf", api_key=API_KEY, log_path=root / "merged.log"),
        "adapter": cpu_engine(root / "hf", api_key=API_KEY, log_path=root / "adapter.log", enable_lora=True,
                                    max_lora_rank=4, lora_target_modules=["all"]),
    }
    urls = {name: handle.url for name, handle in handles.items()}
    adapters = {1: _version(arch, 1), 2: _version(arch, 2)}
    versions = {version: (adapters[version], {"merged": (urls["merged"], "merged", "tensor"),
                                              "adapter": (urls["adapter"], "adapter", transport)})
                for version, transport in ((1, "tensor"), (2, "disk"))}
    out = run_spawned(lora_sync_pushes, world_size=2, layout={"tp": 2, "pp": 1}, timeout_s=300,
                      checkpoint=str(root / "hf"), settings=SETTINGS, versions=versions, api_key=API_KEY,
                      disk_dir=str(root / "sync"), prompts=PROMPTS, steps=STEPS)[0]
    return {"root": root, "model": model, "arch": arch, "adapters": adapters, "urls": urls, **out}


@pytest.mark.parametrize("version", [1, 2])
def test_both_sync_modes_serve_the_adapted_policy(synced, version):
    reference = peft_model(synced["model"], synced["adapters"][version], synced["arch"])
    expected = [greedy_continuation(reference, prompt, STEPS) for prompt in PROMPTS]
    assert expected != [greedy_continuation(synced["model"], prompt, STEPS) for prompt in PROMPTS]
    for server in ("merged", "adapter"):
        outputs = synced["outputs"][(version, server)]
        assert [out["output_ids"] for out in outputs] == expected, server
        with torch.no_grad():
            for prompt, out in zip(PROMPTS, outputs):
                logits = reference(torch.tensor([prompt + out["output_ids"]])).logits[0]
                want = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(
                    -1, torch.tensor(out["output_ids"]).unsqueeze(-1)).squeeze(-1)
                got = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
                assert (got - want).abs().max() < 1e-4, server  # rollout/logprob_diff ~ 0
                assert out["meta_info"]["weight_version"] == str(version)


def _generate(url: str, lora_path: str):
    body = {"input_ids": PROMPTS, "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0},
            "lora_path": lora_path}
    return call(url, "/generate", body, key=API_KEY)


@pytest.mark.robust
def test_the_replaced_adapter_is_unloaded_and_a_server_without_lora_refuses_adapters(synced):
    status, reply = _generate(synced["urls"]["adapter"], lora_adapter_name(1))
    assert status == 400 and "are not loaded: megarl-v1" in reply["error"]["message"]
    assert sorted(p.name for p in (synced["root"] / "sync").iterdir()) == [lora_adapter_name(2)]
    status, reply = call(synced["urls"]["merged"], "/load_lora_adapter",
                         {"lora_name": "x", "lora_path": str(synced["root"] / "sync" / lora_adapter_name(2))},
                         key=API_KEY)
    assert status == 400 and reply["error_message"] == "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
    assert _generate(synced["urls"]["merged"], lora_adapter_name(2))[0] == 400


def test_adapter_sync_moves_the_adapters_and_merged_sync_the_adapted_weights_only(synced):
    arch, metrics = synced["arch"], synced["metrics"]
    peft_tensors = 2 * 7 * arch.num_layers  # A and B of q, k, v, o, gate, up, down per layer
    rank, h, ffn = SETTINGS.rank, arch.hidden_size, arch.ffn_hidden_size
    q_out = arch.num_attention_heads * arch.head_dim
    qkv = q_out + 2 * arch.num_query_groups * arch.head_dim
    # Per layer: A of q, k, v, gate, up [r, h], of o [r, q_out], of down [r, ffn]; B of q, k, v [qkv rows, r]
    # together, of o and down [h, r], of gate and up [ffn, r].
    peft_numel = arch.num_layers * rank * ((5 * h + q_out + ffn) + (qkv + 2 * h + 2 * ffn))
    merged_numel = arch.num_layers * (h * qkv + h * q_out + 3 * h * ffn)
    for version in (1, 2):
        assert metrics[(version, "adapter")]["weight_sync/tensors"] == peft_tensors
        assert metrics[(version, "adapter")]["weight_sync/bytes"] == 4 * peft_numel
        merged = metrics[(version, "merged")]
        assert merged["weight_sync/tensors"] == 7 * arch.num_layers  # no embeddings, norms or LM head
        assert merged["weight_sync/bytes"] == 4 * merged_numel
