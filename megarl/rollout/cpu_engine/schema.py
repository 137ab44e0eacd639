"""Request validation: SGLang's HTTP request bodies as strict pydantic models.

Like SGLang's dataclass-based `GenerateReqInput`, unknown fields are rejected.
SGLang fields that do not change the generated tokens (logging, routing,
priority hints) are accepted and ignored; fields the CPU engine cannot honour
(penalties, grammars, LoRA, multimodal input, ...) are accepted only at their
neutral value, so a request never silently gets different semantics.
`RequestError` carries one line per problem, each naming its field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class RequestError(ValueError):
    """A bad request (HTTP `status`, 400 unless said); `problems` holds one line per problem, each starting with
    the field path."""

    def __init__(self, problems: list[str], *, status: int = 400):
        self.problems = problems
        self.status = status
        super().__init__("; ".join(problems))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    # field -> the only value (besides null) the CPU engine accepts for it
    _neutral_only: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="after")
    def _reject_unsupported(self):
        for name, neutral in self._neutral_only.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name}={value!r} is not supported by the CPU engine (only {neutral!r})")
        return self


class SamplingParamsBody(_Strict):
    """`sampling_params` of `/generate` (SGLang's SamplingParams)."""

    max_new_tokens: Annotated[int, Field(ge=0)] | None = 128
    temperature: Annotated[float, Field(ge=0.0)] | None = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = 1.0
    top_k: int | None = -1
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    n: Annotated[int, Field(ge=1)] | None = 1
    sampling_seed: int | None = None
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    # accepted and ignored: they only shape text or streaming cadence
    spaces_between_special_tokens: bool | None = True
    stream_interval: int | None = None
    custom_params: dict[str, Any] | None = None
    # accepted only at their neutral value
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    stop_regex: str | list[str] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None

    _neutral_only: ClassVar[dict[str, Any]] = {
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_new_tokens": 0,
        "stop_regex": [],
        "json_schema": "",
        "regex": "",
        "ebnf": "",
        "structural_tag": "",
        "logit_bias": {},
    }

    @model_validator(mode="after")
    def _check_top_k(self):
        if self.top_k is not None and self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


class GenerateBody(_Strict):
    """The body of `POST /generate` (SGLang's GenerateReqInput)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = False
    logprob_start_len: Annotated[int, Field(ge=-1)] | list[Annotated[int, Field(ge=-1)]] | None = -1
    top_logprobs_num: Annotated[int, Field(ge=0)] | list[Annotated[int, Field(ge=0)]] | None = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    # accepted and ignored: logging, tracing and routing hints
    log_metrics: bool = True
    no_logs: bool = False
    session_id: str | None = None
    conversation_id: str | None = None
    routing_key: str | None = None
    priority: int | None = None
    extra_key: str | list[str] | None = None
    custom_labels: dict[str, str] | None = None
    data_parallel_rank: int | None = None
    routed_dp_rank: int | None = None
    received_time: float | None = None
    external_trace_header: dict[str, Any] | None = None
    # sglang-router (0.3.2) adds `model` (null) and `return_bytes` (false) to every request it forwards
    model: str | None = None
    # the LoRA adapter of each prompt, by name (None: the base model); one name, or one per prompt
    lora_path: str | list[str | None] | None = None
    # accepted only at their neutral value
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    modalities: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: bool | None = False
    return_routed_experts: bool | None = False
    return_entropy: bool | None = False
    background: bool | None = False
    return_bytes: bool | None = False

    _neutral_only: ClassVar[dict[str, Any]] = {
        **{name: [] for name in ("input_embeds", "image_data", "video_data", "audio_data", "modalities")},
        **{name: [] for name in ("lora_id", "custom_logit_processor", "token_ids_logprob")},
        "session_params": {},
        **{name: False for name in ("return_hidden_states", "return_routed_experts", "return_entropy", "background",
                                    "return_bytes")},
    }


class BeginWeightUpdateBody(_Strict):
    selector: Literal["all", "target", "draft"] = "all"


class EndWeightUpdateBody(_Strict):
    pass


class UpdateWeightsFromTensorBody(_Strict):
    # No minimum length: SGLang's TP rank r reads entry r, and a missing entry is the engine's (fatal) error.
    serialized_named_tensors: list[str]
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    # accepted and ignored (GPU memory / draft-model knobs)
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


class UpdateWeightsFromDiskBody(_Strict):
    model_path: Annotated[str, Field(min_length=1)]
    load_format: Literal["auto", "safetensors"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    # accepted and ignored (GPU memory / bookkeeping knobs)
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    keep_pause: bool = False
    token_step: int = 0


MAX_WORLD_SIZE = 1 << 16  # ranks of one weight-update group: far beyond any cluster, far below what overflows


class InitWeightsUpdateGroupBody(_Strict):
    master_address: Annotated[str, Field(min_length=1)]
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=2, le=MAX_WORLD_SIZE)]
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"

    @model_validator(mode="after")
    def _check(self):
        if self.backend != "gloo":
            raise ValueError(f"backend={self.backend!r} needs CUDA; the CPU engine joins with 'gloo'")
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset={self.rank_offset} must be < world_size={self.world_size}")
        return self


class UpdateWeightsFromDistributedBody(_Strict):
    names: Annotated[list[str], Field(min_length=1)]
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: str = "weight_update_group"
    load_format: Literal["direct", "flattened_bucket"] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    @model_validator(mode="after")
    def _check_lengths(self):
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(
                f"names, dtypes and shapes must have one entry per tensor, got "
                f"{len(self.names)}, {len(self.dtypes)} and {len(self.shapes)}"
            )
        return self


class CheckWeightsBody(_Strict):
    action: str = "checksum"  # checksum, snapshot, compare, reset_tensors (SGLang's CheckWeightsReqInput)
    allow_quant_error: bool = False  # only quantized weights compare within a tolerance; none here
    skip_tensor_list: list[str] | None = None  # name fragments left out of reset, compare and checksum


class DestroyWeightsUpdateGroupBody(_Strict):
    group_name: str = "weight_update_group"


class UpdateWeightVersionBody(_Strict):
    new_version: str
    abort_all_requests: bool = True  # SGLang's default: publishing a version aborts every request


class ReleaseMemoryOccupationBody(_Strict):
    tags: list[str] | None = None  # weights, kv_cache, cuda_graph; none: all


class ResumeMemoryOccupationBody(_Strict):
    tags: list[str] | None = None


class PauseGenerationBody(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Strict):
    pass


class LoadLoRAAdapterBody(_Strict):
    """SGLang's LoadLoRAAdapterReqInput (`lora_id` is assigned by the server)."""

    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]
    pinned: bool = False


class LoadLoRAAdapterFromTensorsBody(_Strict):
    """SGLang's LoadLoRAAdapterFromTensorsReqInput: the PEFT config and one serialized copy of the tensors per TP
    rank (read as `/update_weights_from_tensor` reads its entries), with optional per-tensor checksums."""

    lora_name: Annotated[str, Field(min_length=1)]
    config_dict: dict[str, Any]
    serialized_named_tensors: list[str]
    pinned: bool = False
    added_tokens_config: dict[str, int] | None = None
    load_format: Literal["direct", "flattened_bucket"] | None = None
    expected_checksums: dict[str, str] | None = None

    _neutral_only: ClassVar[dict[str, Any]] = {"added_tokens_config": {}}


class UnloadLoRAAdapterBody(_Strict):
    lora_name: Annotated[str, Field(min_length=1)]


class AbortRequestBody(_Strict):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


MAX_DEPTH = 32  # SGLang's bodies nest three levels deep; anything much deeper is not a request
INT64 = (-(2**63), 2**63)  # what every integer field ends up in (torch, numpy, seeds)


def _shape_problems(value: Any, path: str, depth: int = 0) -> list[str]:
    """Nesting past MAX_DEPTH, integers outside 64 bits and strings that are no Unicode text (a lone surrogate,
    which JSON's \\ud800 escape or raw bytes can carry: no tokenizer or encoder takes it), found before any field
    is read."""
    if depth > MAX_DEPTH:
        return [f"{path or 'body'}: nested deeper than {MAX_DEPTH} levels"]
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if _has_surrogate(key):
                problems.append(f"{path or 'body'}: a key that is not valid Unicode text ({key!r:.40})")
            else:
                problems += _shape_problems(item, f"{path}.{key}".lstrip("."), depth + 1)
        return problems
    if isinstance(value, list):
        if value and set(map(type, value)) == {int}:
            # A flat list of ints (token ids): checked in bulk, not item by item (millions of them).
            if INT64[0] <= min(value) and max(value) < INT64[1]:
                return []
        return [line for index, item in enumerate(value) for line in _shape_problems(item, f"{path}[{index}]",
                                                                                      depth + 1)]
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value < INT64[1]:
        return [f"{path}: integer outside the 64-bit range (got {value!r:.40})"]
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            return [f"{path or 'body'}: not valid Unicode text (a lone surrogate at character {error.start})"]
    return []


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def parse_body(model: type[_Strict], payload: Any) -> Any:
    """Validate a decoded JSON body; raise RequestError naming each bad field."""
    if payload is None:
        payload = {}
    if not isinstance(payload, dict):
        raise RequestError([f"body: expected a JSON object, got {type(payload).__name__}"])
    problems = _shape_problems(payload, "")
    if problems:
        raise RequestError(problems[:10])
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise RequestError(_describe(error)) from None


# Errors that only say "this union member does not fit the input's JSON type".
_UNION_MISMATCH = {"list_type", "model_type", "model_attributes_type", "dict_type"}


def _describe(error: ValidationError) -> list[str]:
    items = error.errors()
    # With a union such as `dict | list[dict]`, pydantic reports every member's
    # failure; when some error is about a value, the type mismatches are noise.
    if any(item["type"] not in _UNION_MISMATCH for item in items):
        items = [item for item in items if item["type"] not in _UNION_MISMATCH]
    problems = []
    for item in items:
        # pydantic puts union member names ("list[int]", "SamplingParamsBody") into
        # the location; a user only cares about the field path.
        path = [str(part) for part in item["loc"] if isinstance(part, int) or "[" not in str(part)]
        path = [part for part in path if not part.endswith("Body")]
        field = ".".join(path) or "body"
        message = item["msg"].removeprefix("Value error, ")
        line = f"{field}: {message}"
        if item["type"] not in ("extra_forbidden", "missing", "value_error") and "input" in item:
            line += f" (got {item['input']!r:.80})"
        if line not in problems:
            problems.append(line)
    return problems
