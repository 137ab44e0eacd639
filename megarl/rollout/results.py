"""Generation results: parsing SGLang `/generate` outputs and packing them into padded tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GenerationResult:
    """One generated sample: its tokens, their log-probs (None when not asked for), why it stopped, and
    the weight version the server reported when it finished (and per token, when the sample spans two)."""

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str  # "length" | "stop" | "abort"
    weight_version: str | None
    # The version of each token when they differ (a sample that went on under new weights), else None.
    token_versions: list[str] | None = None


def parse_output(item: dict[str, Any], *, return_logprob: bool) -> GenerationResult:
    """One `{text, output_ids, meta_info}` item of an SGLang `/generate` response."""
    meta = item["meta_info"]
    output_ids = [int(token) for token in item["output_ids"]]
    logprobs = None
    if return_logprob:
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        if len(logprobs) != len(output_ids):
            raise ValueError(f"server returned {len(output_ids)} output_ids but {len(logprobs)} log-probs")
    reason = meta.get("finish_reason") or {}
    return GenerationResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=str(reason.get("type", "unknown")),
        weight_version=meta.get("weight_version"),
    )


def results_to_tensors(results: list[GenerationResult], *, pad_id: int, max_response_length: int) -> dict[str, Any]:
    """Right-padded batch tensors for the controller.

    Returns `responses` [N, R] int64 (pad_id after each response),
    `response_mask` [N, R] int64 (1 on response tokens), `response_lengths` [N]
    int64, `rollout_log_probs` [N, R] float32 (0 on padding; absent when the
    results carry no log-probs), `finish_reasons` and `weight_versions`
    (lists of N), with R = max_response_length.
    """
    too_long = [index for index, result in enumerate(results) if len(result.output_ids) > max_response_length]
    if too_long:
        raise ValueError(
            f"results {too_long[:5]} are longer than max_response_length={max_response_length} "
            f"(lengths {[len(results[i].output_ids) for i in too_long[:5]]}); generate with "
            "max_new_tokens <= max_response_length"
        )
    with_logprobs = [result.logprobs is not None for result in results]
    if any(with_logprobs) and not all(with_logprobs):
        raise ValueError("results_to_tensors: some results have log-probs and some do not")
    count = len(results)
    responses = torch.full((count, max_response_length), pad_id, dtype=torch.long)
    response_mask = torch.zeros(count, max_response_length, dtype=torch.long)
    log_probs = torch.zeros(count, max_response_length, dtype=torch.float32)
    lengths = torch.tensor([len(result.output_ids) for result in results], dtype=torch.long)
    for row, result in enumerate(results):
        length = len(result.output_ids)
        responses[row, :length] = torch.tensor(result.output_ids, dtype=torch.long)
        response_mask[row, :length] = 1
        if result.logprobs is not None:
            log_probs[row, :length] = torch.tensor(result.logprobs, dtype=torch.float32)
    packed: dict[str, Any] = {
        "responses": responses,
        "response_mask": response_mask,
        "response_lengths": lengths,
        "finish_reasons": [result.finish_reason for result in results],
        "weight_versions": [result.weight_version for result in results],
    }
    if all(with_logprobs):
        packed["rollout_log_probs"] = log_probs
    return packed
