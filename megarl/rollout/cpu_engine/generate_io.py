"""`/generate` bodies -> Sequences, and Sequences -> SGLang response dicts.

Expansion follows SGLang: `input_ids` as list[int] (or `text` as a string) is
one prompt, list[list[int]] (list[str]) is a batch; `sampling_params`,
`rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num` may be one
value for all prompts or a list with one per prompt. A prompt with `n` samples
becomes n sequences placed consecutively; the response is a list (batch order)
for batched input or n > 1, else a single dict.

`sampling_seed` is honoured only by a server started with
`--enable-deterministic-inference`, as SGLang reads it only then; otherwise a
sample draws from the server's own generator, and a retried sample is another
sample. With the flag, a request without a seed gets SGLang's default seed,
`DEFAULT_SAMPLING_SEED` (42). Deviation from SGLang, on purpose: with seed s and n > 1,
sample j is seeded with s + j (SGLang would draw n identical samples), so one
request returns n different, reproducible samples.

Bounds (the server's arguments, `Limits`): at most `max_sequences` sequences
(prompts x n) per request, and at most `max_reply_entries` token entries in the
reply, counted as n x tokens x (1 + top_logprobs_num): a 200-byte request must
not buy a reply of hundreds of megabytes.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from megarl.rollout.cpu_engine.schema import GenerateBody, RequestError, SamplingParamsBody
from megarl.rollout.cpu_engine.sequence import SamplingSettings, Sequence

if TYPE_CHECKING:
    from megarl.rollout.cpu_engine.kv_pool import KvPool

Decode = Callable[[list[int], bool], str]
# A token of a BPE vocabulary stands for far fewer characters than this: a text longer than
# context * this cannot fit, and is refused before it is tokenized (a 12 MB text used to
# stall the server while tokenizing).
MAX_CHARS_PER_TOKEN = 64


# The seed SGLang gives an unseeded request under --enable-deterministic-inference
# (`srt/sampling/sampling_batch_info.py`, `SamplingBatchInfo.from_schedule_batch`).
DEFAULT_SAMPLING_SEED = 42


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (its start-up arguments)."""

    max_sequences: int = 256
    max_reply_entries: int = 1 << 22
    honour_seed: bool = False  # --enable-deterministic-inference


@dataclass
class GenerateJob:
    """The sequences of one `/generate` call and how to shape its response."""

    seqs: list[Sequence]
    returns_list: bool
    stream: bool
    text_in_logprobs: bool
    lora_names: list[str | None]  # per sequence: the LoRA adapter its prompt names (None: the base model)


def build_job(body: GenerateBody, *, vocab_size: int, context_length: int, tokenizer: Any | None,
              limits: Limits = Limits(), pool: KvPool | None = None) -> GenerateJob:
    """Validate the body against the model, the server's `limits` and its KV `pool` (SGLang's prompt limit and
    `max_new_tokens` lowered to what the pool leaves) and expand it into sequences; RequestError lists every
    problem."""
    problems: list[str] = []
    prompts, is_batch = _prompts(body, tokenizer, problems, max_chars=context_length * MAX_CHARS_PER_TOKEN)
    if problems:
        raise RequestError(problems)
    count = len(prompts)
    for index, prompt in enumerate(prompts):
        where = f"input_ids[{index}]" if is_batch else "input_ids"
        if not prompt:
            problems.append(f"{where}: empty prompt")
        elif bad := [token for token in prompt if not 0 <= token < vocab_size]:
            problems.append(f"{where}: token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    params = _per_prompt("sampling_params", body.sampling_params, count, SamplingParamsBody(), problems)
    for index, item in enumerate(params):
        where = f"sampling_params[{index}]" if isinstance(body.sampling_params, list) else "sampling_params"
        if bad := [token for token in item.stop_token_ids or () if not 0 <= token < vocab_size]:
            problems.append(f"{where}.stop_token_ids: {bad[:5]} outside the vocabulary [0, {vocab_size})")
    rids = _request_ids(body.rid, count, is_batch, problems)
    return_logprob = _per_prompt("return_logprob", body.return_logprob, count, False, problems)
    start_lens = _per_prompt("logprob_start_len", body.logprob_start_len, count, -1, problems)
    top_nums = _per_prompt("top_logprobs_num", body.top_logprobs_num, count, 0, problems)
    lora_names = _per_prompt("lora_path", body.lora_path, count, None, problems)
    if any(number > vocab_size for number in top_nums):
        problems.append(f"top_logprobs_num: at most the vocabulary size {vocab_size} (got {max(top_nums)})")
    total = sum(item.n or 1 for item in params)
    if total > limits.max_sequences:
        problems.append(f"sampling_params.n: {total} sequences in one request (prompts x n; this server's "
                        f"--max-sequences is {limits.max_sequences})")
    if problems:
        raise RequestError(problems)

    seqs: list[Sequence] = []
    seq_lora_names: list[str | None] = []
    for index, prompt in enumerate(prompts):
        settings = _settings(params[index], len(prompt), context_length, tokenizer, index, problems)
        if pool is not None:
            if refusal := pool.input_problem(len(prompt)):
                problems.append(refusal)
            settings = dataclasses.replace(settings,
                                           max_new_tokens=pool.max_new_tokens(settings.max_new_tokens, len(prompt)))
        samples = params[index].n or 1
        for sample in range(samples):
            seed = None
            if limits.honour_seed:
                seed = (DEFAULT_SAMPLING_SEED if settings.seed is None else settings.seed) + sample
            seqs.append(
                Sequence(
                    rid=rids[index] if samples == 1 else f"{rids[index]}_{sample}",
                    request_rid=rids[index],
                    prompt_ids=list(prompt),
                    sampling=dataclasses.replace(settings, seed=seed),
                    return_logprob=bool(return_logprob[index]),
                    logprob_start_len=start_lens[index],
                    top_logprobs_num=top_nums[index] if return_logprob[index] else 0,
                    stream=body.stream,
                )
            )
            seq_lora_names.append(lora_names[index])
    entries = sum(reply_entries(seq) for seq in seqs)
    if entries > limits.max_reply_entries:
        problems.append(f"sampling_params.max_new_tokens: the reply would hold {entries} token entries (n x tokens x "
                        f"(1 + top_logprobs_num)); this server's --max-reply-entries is {limits.max_reply_entries}: "
                        f"ask for fewer tokens, samples or top log-probs, or split the request")
    if problems:
        raise RequestError(problems)
    returns_list = is_batch or len(seqs) > len(prompts)
    return GenerateJob(seqs, returns_list, body.stream, body.return_text_in_logprobs, seq_lora_names)


def reply_entries(seq: Sequence) -> int:
    """The most token entries `seq`'s reply can hold: its output tokens and, with log-probs, each prompt token
    scored, each with its `top_logprobs_num` alternatives."""
    tokens = seq.sampling.max_new_tokens
    if seq.return_logprob and seq.logprob_start_len >= 0:
        tokens += max(len(seq.prompt_ids) - seq.logprob_start_len, 0)
    return tokens * (1 + (seq.top_logprobs_num if seq.return_logprob else 0))


def output_dict(
    seq: Sequence,
    *,
    decode: Decode | None,
    text_in_logprobs: bool,
    current_weight_version: str,
    upto: int | None = None,
) -> dict:
    """SGLang's `{text, output_ids, meta_info}` for one sequence; `upto` cuts a streaming snapshot.

    A finished sequence reports the weight version it finished under; a
    streaming snapshot of an unfinished one reports the current version.
    """
    length = len(seq.output_ids) if upto is None else upto
    finished = seq.done and length == len(seq.output_ids)
    output_ids = seq.output_ids[:length]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason if finished else None,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": length,
        "cached_tokens": 0,
        "weight_version": seq.weight_version if finished else current_weight_version,
        "e2e_latency": seq.e2e_latency(),
    }
    if seq.return_logprob:
        token_text = _token_text(decode) if text_in_logprobs else (lambda token: None)
        meta["output_token_logprobs"] = [
            [logprob, token, token_text(token)] for logprob, token in zip(seq.output_logprobs[:length], output_ids)
        ]
        prompt_logprobs = seq.input_logprobs or []
        prompt_tail = seq.prompt_ids[len(seq.prompt_ids) - len(prompt_logprobs) :]
        meta["input_token_logprobs"] = [
            [logprob, token, token_text(token)] for logprob, token in zip(prompt_logprobs, prompt_tail)
        ]
        if seq.top_logprobs_num > 0:
            meta["output_top_logprobs"] = [_top_entries(top, token_text) for top in seq.output_top_logprobs[:length]]
            meta["input_top_logprobs"] = [_top_entries(top, token_text) for top in seq.input_top_logprobs or []]
    text = seq.text(decode) if finished else (decode(output_ids, seq.sampling.skip_special_tokens) if decode else "")
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


def _prompts(body: GenerateBody, tokenizer: Any | None, problems: list[str], *,
             max_chars: int) -> tuple[list[list[int]], bool]:
    if body.text is not None and body.input_ids is not None:
        problems.append("text: give either text or input_ids, not both")
        return [], False
    if body.input_ids is not None:
        if not body.input_ids:
            problems.append("input_ids: must not be empty")
            return [], False
        is_batch = isinstance(body.input_ids[0], list)
        return (body.input_ids if is_batch else [body.input_ids]), is_batch
    if body.text is not None:
        if tokenizer is None:
            problems.append("text: this server has no tokenizer (start it with --tokenizer-path); send input_ids")
            return [], False
        texts = body.text if isinstance(body.text, list) else [body.text]
        long = [index for index, text in enumerate(texts) if len(text) > max_chars]
        if long:
            problems.append(f"text: {len(texts[long[0]])} characters cannot fit the model context length "
                            f"(at most {max_chars} characters; text {long[0]})")
            return [], False
        return [tokenizer(text)["input_ids"] for text in texts], isinstance(body.text, list)
    problems.append("input_ids: required (or text)")
    return [], False


def _per_prompt(name: str, value: Any, count: int, default: Any, problems: list[str]) -> list[Any]:
    if isinstance(value, list):
        if len(value) != count:
            problems.append(f"{name}: has {len(value)} entries for {count} prompts")
            return [default] * count
        return [default if item is None else item for item in value]
    return [default if value is None else value] * count


def _request_ids(rid: str | list[str] | None, count: int, is_batch: bool, problems: list[str]) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(count)]
    if isinstance(rid, str):
        # SGLang expands one string into per-item ids for a batch.
        return [rid] if not is_batch else [f"{rid}_{index}" for index in range(count)]
    if len(rid) != count:
        problems.append(f"rid: has {len(rid)} entries for {count} prompts")
    elif len(set(rid)) != len(rid):
        problems.append("rid: duplicate request ids in one batch")
    return list(rid)


def _settings(
    params: SamplingParamsBody,
    prompt_length: int,
    context_length: int,
    tokenizer: Any | None,
    index: int,
    problems: list[str],
) -> SamplingSettings:
    max_new = params.max_new_tokens if params.max_new_tokens is not None else context_length - prompt_length
    if prompt_length + max_new > context_length:
        problems.append(
            f"sampling_params.max_new_tokens: prompt {index} has {prompt_length} tokens; + max_new_tokens "
            f"{max_new} exceeds the model context length {context_length}"
        )
    stops = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop or ())
    if stops and tokenizer is None:
        problems.append("sampling_params.stop: stop strings need a tokenizer; use stop_token_ids")
    return SamplingSettings(
        max_new_tokens=max_new,
        temperature=1.0 if params.temperature is None else params.temperature,
        top_p=1.0 if params.top_p is None else params.top_p,
        top_k=-1 if params.top_k is None else params.top_k,
        min_p=params.min_p or 0.0,
        stop_token_ids=frozenset(params.stop_token_ids or ()),
        stop_strings=stops,
        ignore_eos=bool(params.ignore_eos),
        seed=params.sampling_seed,
        skip_special_tokens=params.skip_special_tokens is not False,
        no_stop_trim=bool(params.no_stop_trim),
    )


def _token_text(decode: Decode | None) -> Callable[[int], str | None]:
    if decode is None:
        return lambda token: None
    return lambda token: decode([token], False)


def _top_entries(top: list[tuple[float, int]] | None, token_text: Callable[[int], str | None]) -> list | None:
    if top is None:
        return None
    return [[logprob, token, token_text(token)] for logprob, token in top]
