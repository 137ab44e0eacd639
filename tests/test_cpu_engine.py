"""The CPU engine server against independent references: a plain HF forward and argmax loop.

One server (with an API key) serves the whole module; it is started as a
subprocess on a tiny random Llama and stopped by PID. Tests that change its
weights put the original weights back before they end.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from _http import call as http_call, weight_checksums
from _tiny import greedy_continuation, served_model
from _server_fork import fork_server
from megarl.ports import free_port
from megarl.rollout.server import ServerStartError, start_cpu_engine
from megarl.rollout.weight_wire import new_update_group, serialize_named_tensors

# Every test talks to a server subprocess.
pytestmark = pytest.mark.dist

API_KEY = "test-key"
VOCAB = 512
EOS_PROMPT = [5, 17, 42]
EOS_STEP = 3
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [100, 200, 300, 400, 500, 11, 12], [3]]


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token from one full forward over prompt + output."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
    return [logprobs[position, token].item() for position, token in zip(positions, output)]


def word_tokenizer(eos: int) -> PreTrainedTokenizerFast:
    """Token i is the word "t<i>"; text is the words joined by spaces."""
    tokenizer = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=f"t{eos}", unk_token="t0")


def words(token_ids: list[int]) -> str:
    return " ".join(f"t{token}" for token in token_ids)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The served model + tokenizer (EOS chosen so greedy decoding of EOS_PROMPT hits it at EOS_STEP), and a
    second model with other weights."""
    root = tmp_path_factory.mktemp("cpu_engine_models")
    model = served_model(0)
    continuation = greedy_continuation(model, EOS_PROMPT, EOS_STEP + 1)
    eos = continuation[EOS_STEP]
    assert eos not in continuation[:EOS_STEP], "pick another EOS_STEP: the EOS token would appear earlier"
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = eos
    model.save_pretrained(root / "base")
    word_tokenizer(eos).save_pretrained(root / "base")
    other = served_model(1)
    other.config.eos_token_id = eos
    other.generation_config.eos_token_id = eos
    other.save_pretrained(root / "other")
    return {"base": root / "base", "other": root / "other", "eos": eos}


@pytest.fixture(scope="module")
def reference(model_dirs):
    return AutoModelForCausalLM.from_pretrained(str(model_dirs["base"]), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def other_reference(model_dirs):
    return AutoModelForCausalLM.from_pretrained(str(model_dirs["other"]), attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def server(model_dirs, cpu_engine):
    return cpu_engine(model_dirs["base"], api_key=API_KEY, weight_version="v0", seed=123, deterministic=True)


def call(server, path: str, body=None, *, method: str = "POST", key: str | None = API_KEY, raw: bytes | None = None):
    """(status, parsed JSON or text) of one HTTP call to the module's server (POST and the API key by default)."""
    return http_call(server.url, path, body, method=method, key=key, raw=raw)


def generate(server, body) -> dict | list:
    status, reply = call(server, "/generate", body)
    assert status == 200, reply
    return reply


def logprobs_of(output: dict) -> list[float]:
    entries = output["meta_info"]["output_token_logprobs"]
    assert [entry[1] for entry in entries] == output["output_ids"]
    return [entry[0] for entry in entries]


def greedy_body(prompts, max_new_tokens=8, **extra):
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"input_ids": prompts, "sampling_params": params, "return_logprob": True, **extra}


def test_greedy_batch_matches_argmax_loop_and_full_forward_logprobs(server, reference):
    outputs = generate(server, greedy_body(PROMPTS))
    assert isinstance(outputs, list) and len(outputs) == len(PROMPTS)
    for prompt, output in zip(PROMPTS, outputs):
        assert output["output_ids"] == greedy_continuation(reference, prompt, 8)
        expected = reference_logprobs(reference, prompt, output["output_ids"], 0.0)
        assert logprobs_of(output) == pytest.approx(expected, abs=1e-5)
        meta = output["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 8}
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (len(prompt), 8, "v0")


def test_sampled_logprobs_are_temperature_scaled_full_forward(server, reference):
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9, "top_k": 50,
                            "ignore_eos": True, "sampling_seed": 11},
        "return_logprob": True,
    }
    for prompt, output in zip(PROMPTS, generate(server, body)):
        expected = reference_logprobs(reference, prompt, output["output_ids"], 0.7)
        # Log-probs ignore top-p/top-k: exactly what the trainer recomputes.
        assert logprobs_of(output) == pytest.approx(expected, abs=1e-5)


def test_top_k_one_is_greedy_and_prompt_logprobs(server, reference):
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_k": 1, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    output = generate(server, body)
    assert output["output_ids"] == greedy_continuation(reference, PROMPTS[0], 4)
    prompt_entries = output["meta_info"]["input_token_logprobs"]
    assert [entry[1] for entry in prompt_entries] == PROMPTS[0]
    assert prompt_entries[0][0] is None
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPTS[0]])).logits[0]
    expected = torch.log_softmax(logits, -1)[torch.arange(4), torch.tensor(PROMPTS[0][1:])].tolist()
    assert [entry[0] for entry in prompt_entries[1:]] == pytest.approx(expected, abs=1e-5)
    first_top = output["meta_info"]["output_top_logprobs"][0]
    assert len(first_top) == 3 and first_top[0][1] == output["output_ids"][0]
    assert first_top[0][0] >= first_top[1][0] >= first_top[2][0]


def test_seeded_request_does_not_depend_on_its_batch(server):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 7}
    alone = generate(server, {"input_ids": PROMPTS[2], "sampling_params": params, "return_logprob": True})
    batched = generate(
        server,
        {
            "input_ids": [PROMPTS[0], PROMPTS[2], PROMPTS[3]],
            "sampling_params": [{**params, "sampling_seed": 1}, params, {**params, "sampling_seed": None}],
            "return_logprob": True,
        },
    )[1]
    assert batched["output_ids"] == alone["output_ids"]
    assert logprobs_of(batched) == pytest.approx(logprobs_of(alone), abs=1e-5)
    # Concurrent requests from other clients are batched together with it.
    noise = {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(generate, server, {"input_ids": p, "sampling_params": noise}) for p in PROMPTS * 2]
        again = pool.submit(generate, server, {"input_ids": PROMPTS[2], "sampling_params": params})
        assert again.result()["output_ids"] == alone["output_ids"]
        assert all(len(other.result()["output_ids"]) == 20 for other in others)


def test_n_samples_are_consecutive_distinct_and_seeded(server):
    params = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 40, "n": 3}
    outputs = generate(server, {"input_ids": [PROMPTS[0], PROMPTS[1]], "sampling_params": params})
    assert len(outputs) == 6
    for prompt_index, prompt in enumerate([PROMPTS[0], PROMPTS[1]]):
        samples = outputs[3 * prompt_index : 3 * prompt_index + 3]
        assert all(sample["meta_info"]["prompt_tokens"] == len(prompt) for sample in samples)
        assert len({tuple(sample["output_ids"]) for sample in samples}) == 3
        # Sample j is seeded with sampling_seed + j (documented in generate_io).
        for sample_index, sample in enumerate(samples):
            single = {**params, "n": 1, "sampling_seed": 40 + sample_index}
            assert generate(server, {"input_ids": prompt, "sampling_params": single})["output_ids"] == sample[
                "output_ids"
            ]
    single_prompt = generate(server, {"input_ids": PROMPTS[0], "sampling_params": params})
    assert isinstance(single_prompt, list) and len(single_prompt) == 3


def test_finish_reasons_eos_stop_token_and_length(server, reference, model_dirs):
    eos = model_dirs["eos"]
    params = {"max_new_tokens": 10, "temperature": 0.0}
    stopped = generate(server, {"input_ids": EOS_PROMPT, "sampling_params": params})
    # The EOS token is kept in output_ids, as SGLang does.
    assert stopped["output_ids"] == greedy_continuation(reference, EOS_PROMPT, EOS_STEP + 1)
    assert stopped["output_ids"][-1] == eos
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    ignored = generate(server, {"input_ids": EOS_PROMPT, "sampling_params": {**params, "ignore_eos": True}})
    assert len(ignored["output_ids"]) == 10
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    # SGLang checks the length limit first: an EOS drawn as the last allowed token ends by length.
    at_limit = generate(server, {"input_ids": EOS_PROMPT, "sampling_params": {**params,
                                                                           "max_new_tokens": EOS_STEP + 1}})
    assert at_limit["output_ids"] == stopped["output_ids"]
    assert at_limit["meta_info"]["finish_reason"] == {"type": "length", "length": EOS_STEP + 1}

    continuation = greedy_continuation(reference, PROMPTS[0], 10)
    stop_token = continuation[2]
    first = continuation.index(stop_token)
    assert eos not in continuation
    body = {"input_ids": PROMPTS[0], "sampling_params": {**params, "stop_token_ids": [stop_token]}}
    output = generate(server, body)
    assert output["output_ids"] == continuation[: first + 1]
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_token}
    # As in SGLang, ignore_eos also ignores stop_token_ids (only stop strings still end a sequence).
    output = generate(server, {**body, "sampling_params": {**body["sampling_params"], "ignore_eos": True}})
    assert output["output_ids"] == continuation
    assert output["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    empty = generate(server, {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 0}})
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_text_input_stop_strings_and_trimming(server, reference, model_dirs):
    params = {"max_new_tokens": 10, "temperature": 0.0}
    by_text = generate(server, {"text": words(EOS_PROMPT), "sampling_params": params})
    assert by_text["output_ids"] == greedy_continuation(reference, EOS_PROMPT, EOS_STEP + 1)
    # The matched EOS is trimmed from the text unless no_stop_trim.
    assert by_text["text"] == words(by_text["output_ids"][:-1])
    untrimmed = generate(server, {"text": words(EOS_PROMPT), "sampling_params": {**params, "no_stop_trim": True,
                                                                                "skip_special_tokens": False}})
    assert untrimmed["text"] == words(untrimmed["output_ids"])

    continuation = greedy_continuation(reference, PROMPTS[0], 6)
    stop = f"t{continuation[2]}"
    first = continuation.index(continuation[2])
    body = {"input_ids": PROMPTS[0], "sampling_params": {**params, "ignore_eos": True, "stop": [stop, "never"]}}
    output = generate(server, body)
    assert output["output_ids"] == continuation[: first + 1]
    assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert output["text"] == words(continuation[:first]) + (" " if first else "")
    batch = generate(server, {"text": [words(PROMPTS[0]), words(PROMPTS[1])],
                              "sampling_params": {**params, "max_new_tokens": 3, "ignore_eos": True}})
    assert [item["output_ids"] for item in batch] == [greedy_continuation(reference, p, 3) for p in PROMPTS[:2]]


def stream_chunks(text: str) -> list[dict]:
    """The JSON chunks of a streamed /generate reply (server-sent events ending with `data: [DONE]`)."""
    events = [line for line in text.split("\n\n") if line]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(event[len("data: ") :]) for event in events[:-1]]


def test_streaming_sends_cumulative_chunks_then_done(server):
    body = greedy_body(PROMPTS[1], max_new_tokens=5, stream=True)
    status, text = call(server, "/generate", body)
    assert status == 200
    chunks = stream_chunks(text)
    lengths = [len(chunk["output_ids"]) for chunk in chunks]
    assert lengths == list(range(1, 6))
    for earlier, later in zip(chunks, chunks[1:]):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
    assert [chunk["meta_info"]["finish_reason"] for chunk in chunks[:-1]] == [None] * 4
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    final = generate(server, greedy_body(PROMPTS[1], max_new_tokens=5))
    assert chunks[-1]["output_ids"] == final["output_ids"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"sampling_params": {"max_new_tokens": 4}}, "input_ids"),
        ({"input_ids": "hello"}, "input_ids"),
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
        ({"input_ids": [1, VOCAB]}, "input_ids"),
        ({"input_ids": [1, -3]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1, 2], "sampling_params": {"tempreature": 0.5}}, "tempreature"),
        ({"input_ids": [1, 2], "unknown_field": 1}, "unknown_field"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}, {}, {}]}, "sampling_params"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300}}, "max_new_tokens"),
        ({"text": "t1 t2", "input_ids": [1, 2]}, "text"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": 5}}, "stop"),
        ([1, 2, 3], "body"),
    ],
)
def test_malformed_generate_is_400_naming_the_field(server, body, field):
    status, reply = call(server, "/generate", body)
    assert status == 400, reply
    assert field in reply["error"]["message"]


def test_server_keeps_serving_after_bad_requests(server):
    status, reply = call(server, "/generate", raw=b"{not json")
    assert status == 400 and "invalid JSON" in reply["error"]["message"]
    assert call(server, "/health", method="GET")[0] == 200
    assert call(server, "/health_generate", method="GET")[0] == 200
    assert len(generate(server, greedy_body(PROMPTS[0], max_new_tokens=2))["output_ids"]) == 2


@pytest.mark.parametrize("path", ["/update_weights_from_tensor", "/begin_weight_update", "/generate", "/flush_cache"])
def test_api_key_is_required_except_for_health(server, path):
    assert call(server, path, {}, key=None)[0] == 401
    assert call(server, path, {}, key="wrong")[0] == 401
    assert call(server, "/health", method="GET", key=None)[0] == 200


def test_info_endpoints_and_flush_cache(server, model_dirs):
    for path in ("/model_info", "/get_model_info"):
        status, info = call(server, path, method="GET")
        assert status == 200
        assert info["model_path"] == str(model_dirs["base"]) and info["is_generation"] is True
    status, info = call(server, "/get_server_info", method="GET")
    assert status == 200 and info["max_batch"] == 256 and info["tp_size"] == 1 and "api_key" not in info
    assert call(server, "/flush_cache", method="GET")[0] == 200
    assert call(server, "/flush_cache")[0] == 200


def state_dict_of(model) -> list[tuple[str, torch.Tensor]]:
    return [(name, tensor.detach().clone()) for name, tensor in model.state_dict().items()]


def restore(server, model_dirs) -> None:
    status, reply = call(server, "/update_weights_from_disk", {"model_path": str(model_dirs["base"]),
                                                               "weight_version": "v0"})
    assert status == 200 and reply["success"], reply


def test_update_weights_from_tensor(server, reference, other_reference, model_dirs):
    named = state_dict_of(other_reference)
    body = {"serialized_named_tensors": [serialize_named_tensors(named)], "weight_version": "v1"}
    status, reply = call(server, "/update_weights_from_tensor", body)
    assert status == 400 and "begin_weight_update" in reply["message"]
    before = generate(server, greedy_body(PROMPTS[:2], max_new_tokens=6))
    try:
        assert call(server, "/begin_weight_update", {"selector": "all"})[1]["success"]
        assert call(server, "/begin_weight_update", {})[0] == 400  # a session is already open

        wrong_name = [("model.layers.0.self_attn.q_proj.weight", named[1][1]), ("model.layers.9.mlp.up_proj.weight",
                                                                                 torch.zeros(128, 64))]
        bad_shape = [("model.norm.weight", torch.ones(65))]
        bad_dtype = [("model.norm.weight", torch.ones(64, dtype=torch.float64))]
        for tensors, name in [(wrong_name, "model.layers.9.mlp.up_proj.weight"), (bad_shape, "model.norm.weight"),
                              (bad_dtype, "model.norm.weight")]:
            body = {"serialized_named_tensors": [serialize_named_tensors(tensors)], "weight_version": "bad"}
            status, reply = call(server, "/update_weights_from_tensor", body)
            assert status == 400 and not reply["success"] and name in reply["message"], reply
        unchanged = generate(server, greedy_body(PROMPTS[:2], max_new_tokens=6))
        assert [o["output_ids"] for o in unchanged] == [o["output_ids"] for o in before]
        assert [logprobs_of(o) for o in unchanged] == [logprobs_of(o) for o in before]
        assert unchanged[0]["meta_info"]["weight_version"] == "v0"

        # Two buckets, the second in the flattened format.
        half = len(named) // 2
        for part, load_format, version in [(named[:half], None, None), (named[half:], "flattened_bucket", "v1")]:
            body = {"serialized_named_tensors": [serialize_named_tensors(part, load_format=load_format)],
                    "load_format": load_format, "weight_version": version}
            status, reply = call(server, "/update_weights_from_tensor", body)
            assert status == 200 and reply["success"], reply
        assert call(server, "/end_weight_update", {})[1]["success"]
        assert call(server, "/end_weight_update", {})[0] == 400

        outputs = generate(server, greedy_body(PROMPTS[:2], max_new_tokens=6))
        for prompt, output in zip(PROMPTS, outputs):
            assert output["output_ids"] == greedy_continuation(other_reference, prompt, 6)
            expected = reference_logprobs(other_reference, prompt, output["output_ids"], 0.0)
            assert logprobs_of(output) == pytest.approx(expected, abs=1e-5)
            assert output["meta_info"]["weight_version"] == "v1"
        assert call(server, "/model_info", method="GET")[1]["weight_version"] == "v1"
    finally:
        call(server, "/end_weight_update", {})
        restore(server, model_dirs)
    assert generate(server, greedy_body(PROMPTS[0], max_new_tokens=6))["output_ids"] == greedy_continuation(
        reference, PROMPTS[0], 6
    )


def test_update_weights_from_disk(server, other_reference, model_dirs, tmp_path):
    status, reply = call(server, "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert status == 400 and not reply["success"] and "missing" in reply["message"]
    try:
        body = {"model_path": str(model_dirs["other"]), "weight_version": "disk-1"}
        status, reply = call(server, "/update_weights_from_disk", body)
        assert status == 200 and reply == {"success": True, "message": reply["message"], "num_paused_requests": 0}
        output = generate(server, greedy_body(PROMPTS[2], max_new_tokens=5))
        assert output["output_ids"] == greedy_continuation(other_reference, PROMPTS[2], 5)
        expected = reference_logprobs(other_reference, PROMPTS[2], output["output_ids"], 0.0)
        assert logprobs_of(output) == pytest.approx(expected, abs=1e-5)
        assert output["meta_info"]["weight_version"] == "disk-1"
        status, reply = call(server, "/update_weight_version", {"new_version": "renamed"})
        assert status == 200 and reply["success"]
        assert generate(server, greedy_body(PROMPTS[2], max_new_tokens=1))["meta_info"]["weight_version"] == "renamed"
    finally:
        restore(server, model_dirs)


def trainer_group(port: int, world_size: int, group_name: str):
    """The trainer's side of SGLang's weight-update group (rank 0, hosts the store)."""
    return new_update_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=world_size,
                            group_name=group_name, backend="gloo", timeout_s=60)


def broadcast_update(server, group, named, **fields):
    """POST the metadata and broadcast the tensors, as a trainer does; returns (status, reply)."""
    body = {"names": [name for name, _ in named], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": "test_group", **fields}
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(call, server, "/update_weights_from_distributed", body)
        for _, tensor in named:
            group.broadcast(tensor, 0).wait()
        return reply.result()


def test_update_weights_from_distributed(server, reference, other_reference, model_dirs):
    init = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "test_group"}
    status, reply = call(server, "/init_weights_update_group", {**init, "backend": "nccl"})
    assert status == 400 and "backend" in reply["message"]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(call, server, "/init_weights_update_group", {**init, "backend": "gloo"})
        group = trainer_group(init["master_port"], 2, "test_group")
        assert joined.result()[0] == 200
    named = state_dict_of(other_reference)
    try:
        assert call(server, "/begin_weight_update", {})[0] == 200
        wrong = [("model.norm.weight", torch.ones(64)), ("lm_head.weight", torch.zeros(VOCAB, 65))]
        status, reply = broadcast_update(server, group, wrong)
        assert status == 400 and "lm_head.weight" in reply["message"]
        assert generate(server, greedy_body(PROMPTS[0], max_new_tokens=5))["output_ids"] == greedy_continuation(
            reference, PROMPTS[0], 5)
        status, reply = broadcast_update(server, group, named, weight_version="dist-1")
        assert status == 200 and reply["success"], reply
        assert call(server, "/end_weight_update", {})[0] == 200
        output = generate(server, greedy_body(PROMPTS[2], max_new_tokens=5))
        assert output["output_ids"] == greedy_continuation(other_reference, PROMPTS[2], 5)
        assert logprobs_of(output) == pytest.approx(
            reference_logprobs(other_reference, PROMPTS[2], output["output_ids"], 0.0), abs=1e-5)
        assert output["meta_info"]["weight_version"] == "dist-1"
    finally:
        call(server, "/end_weight_update", {})
        assert call(server, "/destroy_weights_update_group", {"group_name": "test_group"})[0] == 200
        torch.distributed.destroy_process_group(group)
        restore(server, model_dirs)
    assert call(server, "/destroy_weights_update_group", {"group_name": "test_group"})[0] == 400


def start_long_request(server, body) -> tuple[threading.Thread, dict]:
    holder: dict = {}
    thread = threading.Thread(target=lambda: holder.update(reply=generate(server, body)))
    thread.start()
    return thread, holder


def wait_running(server, count: int = 1) -> None:
    deadline = time.monotonic() + 20
    while call(server, "/server_info", method="GET")[1]["num_running_reqs"] < count:
        assert time.monotonic() < deadline, "request never started running"
        time.sleep(0.01)


def test_requests_join_a_running_batch_exactly(server, reference):
    long_thread, _ = start_long_request(server, greedy_body(PROMPTS[0], max_new_tokens=240))
    wait_running(server)
    joined = generate(server, greedy_body([PROMPTS[2], PROMPTS[3]], max_new_tokens=8))
    sampled = generate(server, {"input_ids": PROMPTS[1], "return_logprob": True,
                                "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 5}})
    # Both finished while the long request still ran: they joined its batch.
    assert long_thread.is_alive()
    for prompt, output in zip([PROMPTS[2], PROMPTS[3]], joined):
        assert output["output_ids"] == greedy_continuation(reference, prompt, 8)
        assert logprobs_of(output) == pytest.approx(reference_logprobs(reference, prompt, output["output_ids"], 0.0),
                                                    abs=1e-5)
    long_thread.join(timeout=60)
    alone = generate(server, {"input_ids": PROMPTS[1], "return_logprob": True,
                              "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 5}})
    assert sampled["output_ids"] == alone["output_ids"]
    assert logprobs_of(sampled) == pytest.approx(logprobs_of(alone), abs=1e-5)


def test_abort_request_and_flush_cache_while_running(server):
    body = greedy_body(PROMPTS[0], max_new_tokens=240, rid="long-one")
    thread, holder = start_long_request(server, body)
    wait_running(server)
    assert call(server, "/flush_cache")[0] == 400
    assert call(server, "/abort_request", {"rid": "long-one"})[0] == 200
    thread.join(timeout=30)
    meta = holder["reply"]["meta_info"]
    assert meta["id"] == "long-one" and meta["finish_reason"]["type"] == "abort"
    assert len(holder["reply"]["output_ids"]) < 240
    assert call(server, "/flush_cache")[0] == 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_keep_greedy_output_exact(server, reference, mode):
    body = greedy_body(PROMPTS[1], max_new_tokens=240)
    thread, holder = start_long_request(server, body)
    wait_running(server)
    status, reply = call(server, "/pause_generation", {"mode": mode})
    assert status == 200 and reply["success"]
    time.sleep(0.1)
    running = call(server, "/server_info", method="GET")[1]
    assert (running["num_running_reqs"], running["num_waiting_reqs"]) == ((0, 1) if mode == "retract" else (1, 0))
    assert thread.is_alive()
    assert call(server, "/continue_generation", {})[0] == 200
    thread.join(timeout=60)
    output = holder["reply"]
    assert output["output_ids"] == greedy_continuation(reference, PROMPTS[1], 240)
    assert logprobs_of(output) == pytest.approx(
        reference_logprobs(reference, PROMPTS[1], output["output_ids"], 0.0), abs=1e-5
    )


def test_pause_abort_mode_aborts_running_requests(server):
    thread, holder = start_long_request(server, greedy_body(PROMPTS[0], max_new_tokens=240))
    wait_running(server)
    assert call(server, "/pause_generation", {"mode": "abort"})[0] == 200
    thread.join(timeout=30)
    assert holder["reply"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert call(server, "/continue_generation", {})[0] == 200
    assert len(generate(server, greedy_body(PROMPTS[0], max_new_tokens=3))["output_ids"]) == 3


def continuation_over_a_cache(cache_model, model, prompt: list[int], prefix: list[int],
                              steps: int) -> tuple[list[int], list[float]]:
    """`model`'s greedy tokens and their log-probs after prompt + prefix, decoding over the KV cache that
    `cache_model` computed for prompt + prefix[:-1]: what a request paused in place holds when its weights
    change under it (SGLang keeps the paused batch's cache across the update)."""
    with torch.no_grad():
        past = cache_model(torch.tensor([prompt + prefix[:-1]]), use_cache=True).past_key_values
        token, tokens, logprobs = prefix[-1], [], []
        for _ in range(steps):
            out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            row = torch.log_softmax(out.logits[0, -1].float(), -1)
            token = int(row.argmax())
            tokens.append(token)
            logprobs.append(float(row[token]))
            past = out.past_key_values
    return tokens, logprobs


def test_a_request_paused_in_place_goes_on_with_new_weights_and_each_token_carries_its_version(
        server, reference, other_reference, model_dirs):
    """Paused mid-request, updated, continued: the tokens streamed before the update are the old model's, every
    token after it the new model's (over the old cache), log-probs too. A forward pass and the sampling of its
    token are one step, as in SGLang: no token is sampled from the old weights' logits and reported under the
    new version."""
    total = 240
    holder: dict = {}
    body = greedy_body(PROMPTS[1], max_new_tokens=total, stream=True)
    thread = threading.Thread(target=lambda: holder.update(reply=call(server, "/generate", body)))
    thread.start()
    try:
        wait_running(server)
        assert call(server, "/pause_generation", {"mode": "in_place"})[0] == 200
        status, reply = call(server, "/update_weights_from_disk", {"model_path": str(model_dirs["other"]),
                                                                   "weight_version": "v1", "flush_cache": False})
        assert status == 200 and reply["success"], reply
        assert call(server, "/continue_generation", {})[0] == 200
        thread.join(timeout=60)
    finally:
        restore(server, model_dirs)
    status, text = holder["reply"]
    assert status == 200
    chunks = stream_chunks(text)
    versions: list[str] = []
    for chunk in chunks:  # each token's version: that of the chunk that first carried it
        versions += [chunk["meta_info"]["weight_version"]] * (len(chunk["output_ids"]) - len(versions))
    old = versions.count("v0")
    assert 0 < old < total and versions == ["v0"] * old + ["v1"] * (total - old)
    # Greedy tokens and float32 log-probs against an eager-attention reference: their difference is float noise
    # of the attention kernels (~1e-6), the gap between the two models' log-probs is ~0.1 and more.
    ids, logprobs = chunks[-1]["output_ids"], logprobs_of(chunks[-1])
    assert ids[:old] == greedy_continuation(reference, PROMPTS[1], old)
    assert logprobs[:old] == pytest.approx(reference_logprobs(reference, PROMPTS[1], ids[:old], 0.0), abs=1e-5)
    new_ids, new_logprobs = continuation_over_a_cache(reference, other_reference, PROMPTS[1], ids[:old], total - old)
    assert ids[old:] == new_ids
    assert logprobs[old:] == pytest.approx(new_logprobs, abs=1e-5)


def test_launcher_reports_a_server_that_cannot_start(tmp_path):
    (tmp_path / "config.json").write_text("{not a config")
    with pytest.raises(ServerStartError) as error:
        start_cpu_engine(tmp_path, log_path=tmp_path / "log.txt", startup_timeout_s=60)
    message = str(error.value)
    assert "exited with status" in message and "config" in message.lower()


def test_dtype_serves_in_the_checkpoints_or_the_given_dtype_and_refuses_lossy_updates(model_dirs, tmp_path):
    """`--dtype` as SGLang's: "auto" keeps the checkpoint's bf16; a bf16 engine takes bf16 bit for bit and
    refuses float32 (rounding would change the trainer's weights silently)."""
    from megarl.rollout.weight_wire import held_checksum
    from megarl.rollout.cpu_engine.weights import WeightUpdateError, apply_named_tensors, load_model

    served_model(2).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    assert load_model(tmp_path / "bf16").model.norm.weight.dtype == torch.float32  # the CPU default
    model = load_model(tmp_path / "bf16", dtype="auto")
    assert {tensor.dtype for tensor in model.state_dict().values()} == {torch.bfloat16}
    update = torch.randn(64, 64).to(torch.bfloat16)
    apply_named_tensors(model, [("model.layers.0.self_attn.o_proj.weight", update)])
    assert torch.equal(model.model.layers[0].self_attn.o_proj.weight, update)
    with pytest.raises(WeightUpdateError, match=r"model\.norm\.weight: dtype torch\.float32 != model dtype"):
        apply_named_tensors(model, [("model.norm.weight", torch.ones(64))])

    handle = start_cpu_engine(model_dirs["base"], api_key=API_KEY, log_path=tmp_path / "server.log", dtype="bfloat16",
                              spawn=fork_server)
    try:
        info = call(handle, "/get_server_info", method="GET")[1]
        digests = weight_checksums(handle.url, key=API_KEY)
    finally:
        handle.stop()
    assert info["dtype"] == "bfloat16"
    base = AutoModelForCausalLM.from_pretrained(str(model_dirs["base"]), dtype=torch.bfloat16)
    assert digests["model.layers.1.mlp.down_proj.weight"] == held_checksum(base.model.layers[1].mlp.down_proj.weight,
                                                                           torch.bfloat16)
