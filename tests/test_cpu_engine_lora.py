"""LoRA serving in the CPU engine against peft, and SGLang 0.5.23's rules for adapters.

One server (`--enable-lora --max-lora-rank 8 --lora-target-modules all`) on a tiny Llama
serves the module. The reference is the HF model wrapped by peft with the same adapter:
greedy continuations (a plain argmax loop, full forward per token) and token log-probs.
The refusals are SGLang's, with its messages: an adapter not loaded, a name loaded twice,
a rank above `--max-lora-rank` (or a target outside `--lora-target-modules`), an unload of
an unknown name, a checksum that does not match, and the start-up checks of the LoRA flags
(a server without `--enable-lora` refusing adapters: test_lora_weight_sync).
"""

from __future__ import annotations

import copy

import pytest
import torch

from _http import call
from _tiny import greedy_continuation, served_model
from megarl.rollout.cpu_engine.args import parse_args
from megarl.rollout.weight_wire import entries_for_tp_ranks, tensor_checksum

pytestmark = pytest.mark.dist
peft = pytest.importorskip("peft")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [100, 200, 300, 11]]
STEPS = 6


def _adapted(model, *, rank: int, targets: list[str], seed: int):
    """A peft-wrapped copy of `model` with random A and B (so the adapter changes the outputs)."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0)
    wrapped = peft.get_peft_model(copy.deepcopy(model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return wrapped.eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cpu_engine):
    root = tmp_path_factory.mktemp("cpu-engine-lora")
    model = served_model(0)  # the rollout tests' served Llama
    model.save_pretrained(root / "base")
    adapted = _adapted(model, rank=4, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], seed=1)
    adapted.save_pretrained(root / "adapter")
    too_wide = _adapted(model, rank=16, targets=["q_proj"], seed=2)
    too_wide.save_pretrained(root / "rank16")
    server = cpu_engine(root / "base", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"],
                        log_path=root / "server.log")
    return {"root": root, "model": model, "adapted": adapted, "url": server.url}


def _generate(url: str, prompts: list[list[int]], lora_path, *, logprobs: bool = False):
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0},
            "return_logprob": logprobs, "lora_path": lora_path}
    return call(url, "/generate", body)


def _load(url: str, name: str, path) -> tuple[int, dict]:
    return call(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def test_adapter_from_a_dir_generates_as_peft_and_mixes_with_the_base_in_one_batch(setup):
    url, root = setup["url"], setup["root"]
    status, reply = _load(url, "a", root / "adapter")
    assert (status, reply) == (200, {"success": True, "error_message": None,
                                     "loaded_adapters": {"a": str(root / "adapter")}})
    expected = [greedy_continuation(setup["adapted"], prompt, STEPS) for prompt in PROMPTS]
    base = [greedy_continuation(setup["model"], prompt, STEPS) for prompt in PROMPTS]
    assert expected != base  # the adapter changes what the model says
    status, outputs = _generate(url, PROMPTS, "a", logprobs=True)
    assert status == 200 and [out["output_ids"] for out in outputs] == expected
    # Log-probs: one full forward of the peft model over prompt + output, float32 noise only.
    with torch.no_grad():
        for prompt, out in zip(PROMPTS, outputs):
            ids = prompt + out["output_ids"]
            logits = setup["adapted"](torch.tensor([ids])).logits[0]
            reference = torch.log_softmax(logits, -1)[len(prompt) - 1: -1].gather(
                -1, torch.tensor(out["output_ids"]).unsqueeze(-1)).squeeze(-1)
            got = torch.tensor([entry[0] for entry in out["meta_info"]["output_token_logprobs"]])
            assert torch.allclose(got, reference, atol=1e-4)
    # Rows of one batch on different adapters: each gets its own (None = the base model).
    status, outputs = _generate(url, PROMPTS, ["a", None, "a"])
    assert [out["output_ids"] for out in outputs] == [expected[0], base[1], expected[2]]


def test_adapter_from_tensors_with_checksums(setup):
    url, root = setup["url"], setup["root"]
    tensors = list(peft.get_peft_model_state_dict(setup["adapted"]).items())
    config = setup["adapted"].peft_config["default"].to_dict()
    config["target_modules"] = sorted(config["target_modules"])
    checksums = {name: tensor_checksum(tensor) for name, tensor in tensors}
    body = {"lora_name": "t", "config_dict": config, "serialized_named_tensors": entries_for_tp_ranks(tensors, 1),
            "expected_checksums": checksums}
    status, reply = call(url, "/load_lora_adapter_from_tensors", body)
    assert status == 200 and reply["loaded_adapters"]["t"] == "__tensor__", reply
    status, outputs = _generate(url, PROMPTS, "t")
    assert [out["output_ids"] for out in outputs] == [greedy_continuation(setup["adapted"], p, STEPS)
                                                      for p in PROMPTS]
    wrong = {**checksums, tensors[0][0]: "0" * 16}
    body = {**body, "lora_name": "t2", "serialized_named_tensors": entries_for_tp_ranks(tensors, 1),
            "expected_checksums": wrong}
    status, reply = call(url, "/load_lora_adapter_from_tensors", body)
    assert status == 400 and not reply["success"] and "checksum mismatch" in reply["error_message"]
    assert "t2" not in call(url, "/unload_lora_adapter", {"lora_name": "t"})[1]["loaded_adapters"]


@pytest.mark.robust
def test_sglangs_refusals(setup):
    url, root = setup["url"], setup["root"]
    _load(url, "r", root / "adapter")
    status, reply = _generate(url, PROMPTS[:1], "missing")
    assert status == 400 and reply["error"]["message"].startswith(
        "The following requested LoRA adapters are not loaded: missing\nLoaded adapters: ")
    status, reply = _load(url, "r", root / "adapter")
    assert status == 400 and reply["error_message"].startswith("LoRA with name r already exists.")
    status, reply = _load(url, "wide", root / "rank16")
    assert status == 400 and reply["error_message"] == (
        "LoRA adapter wide with rank 16 is incompatible with the current LoRA memory pool configuration. Please "
        "ensure that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the target "
        "modules are included in `--lora-target-modules`.")
    status, reply = call(url, "/unload_lora_adapter", {"lora_name": "r"})
    assert status == 200 and "r" not in reply["loaded_adapters"]
    status, reply = call(url, "/unload_lora_adapter", {"lora_name": "r"})
    assert status == 400 and reply["error_message"].startswith("LoRA with name r does not exist.")
    assert _generate(url, PROMPTS[:1], "r")[0] == 400  # unloaded: new requests naming it are refused
    status, reply = _generate(url, PROMPTS, ["a", None])
    assert status == 400 and reply["error"]["message"] == "lora_path: has 2 entries for 3 prompts"


@pytest.mark.robust
def test_lora_flags_are_checked_at_start_up(setup, capsys):
    # The server's own argument parsing (`python -m megarl.rollout.cpu_engine` runs it first), in this process:
    # a fresh interpreter would spend its seconds importing torch before the same check.
    with pytest.raises(SystemExit) as exited:
        parse_args(["--model-path", str(setup["root"] / "base"), "--enable-lora"])
    assert exited.value.code == 2 and "When no initial --lora-paths is provided, you need to specify both " \
        "--max-lora-rank and --lora-target-modules for LoRA initialization." in capsys.readouterr().err


def test_adapter_sync_to_a_server_restarted_at_its_url(setup, monkeypatch, tmp_path):
    """The fleet restarts a dead server on its port and syncs it with the others' next version: the adapter-only
    sync loads that version there too, and the previous one, which the restarted server never held, is simply
    not there to unload (SGLang refuses the unload of an unknown name)."""
    from megarl.config.settings import LoraSettings, WeightSyncSettings
    from megarl.engines.protocol import AdapterShards
    from megarl.models import arch_from_hf
    from megarl.models.lora import TARGETS, initial_adapters
    from megarl.rollout.weight_wire import lora_adapter_name
    from megarl.weightsync.groups import RankCoords
    from megarl.weightsync.lora_sync import AdapterSync

    arch = arch_from_hf(setup["model"].config.to_dict())
    lora = LoraSettings(rank=4, alpha=8.0, dropout=0.0, targets=tuple(TARGETS), init="kaiming", seed=0)
    adapters = AdapterShards({(0, name): t for name, t in initial_adapters(arch, rank=4, targets=TARGETS,
                                                                           init="kaiming", seed=0).items()},
                             tp_rank=0, arch=arch, settings=lora)
    settings = WeightSyncSettings(transport="tensor", bucket_bytes=1 << 20, verify="none", timeout_s=60,
                                  disk_dir=str(tmp_path), lora="adapter")
    # One trainer rank: the gather over the engine's group is this rank's own shards.
    monkeypatch.setattr(torch.distributed, "all_gather_object", lambda out, obj: out.__setitem__(0, obj))
    url, sync = setup["url"], AdapterSync()
    sync.push(adapters, coords=RankCoords(), urls=[url], api_key=None, version=1, settings=settings)
    assert call(url, "/unload_lora_adapter", {"lora_name": lora_adapter_name(1)})[0] == 200  # "restarted"
    metrics = sync.push(adapters, coords=RankCoords(), urls=[url], api_key=None, version=2, settings=settings)
    assert metrics["weight_sync/tensors"] == 2 * 7 * arch.num_layers
    assert _generate(url, PROMPTS[:1], lora_adapter_name(2))[0] == 200
    status, reply = call(url, "/unload_lora_adapter", {"lora_name": lora_adapter_name(2)})
    assert status == 200 and lora_adapter_name(2) not in reply["loaded_adapters"]
