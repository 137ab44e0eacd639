"""The body of one SGLang `/generate` request, from the run's `SamplingSettings`.

One builder for every generation: the client's (`RolloutClient.generate`, a prompt's n
samples per request) and the fleet's (`dispatch.generate_rows`, one request per prompt
group, an aborted or failed row re-sent alone or with others). A request carries its
samples as a batch of copies of the prompt, each with its own `sampling_params`.

Determinism: every sample of a call has a row number (prompt i's sample j is row
i * n + j), and with `seed` it is sent with `sampling_seed = (seed * 1000003 + row)
mod (2^63 - 1)`. A sample therefore does not depend on which server draws it, how its
server batches requests, or whether it is a retry. (One seed for all copies of a prompt
would make SGLang draw identical samples.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megarl.config.settings import SamplingSettings

SEED_STRIDE = 1_000_003
SEED_MODULUS = 2**63 - 1


def sample_seed(seed: int, row: int) -> int:
    """The `sampling_seed` of row `row` of a call seeded with `seed`."""
    return (seed * SEED_STRIDE + row) % SEED_MODULUS


def sampling_params(sampling: SamplingSettings) -> dict[str, Any]:
    """SGLang's `sampling_params` for `sampling` (without the per-sample seed)."""
    params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                              "top_p": sampling.top_p, "top_k": sampling.top_k, "ignore_eos": sampling.ignore_eos}
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    return params


def generate_body(prompt: Sequence[int], rows: Sequence[int], *, sampling: SamplingSettings, seed: int | None,
                  return_logprob: bool, lora_path: str | None = None) -> dict[str, Any]:
    """One `/generate` body for the samples `rows` of `prompt`: one copy per row, each with its row's seed; with
    `lora_path`, every copy generates with that LoRA adapter (SGLang's name of a loaded adapter).

    A single row is sent as a single request (SGLang answers it with one object, not a list of one)."""
    params = [sampling_params(sampling) for _ in rows]
    if seed is not None:
        for item, row in zip(params, rows):
            item["sampling_seed"] = sample_seed(seed, row)
    adapter = {"lora_path": lora_path} if lora_path is not None else {}
    if len(rows) == 1:
        return {"input_ids": list(prompt), "sampling_params": params[0], "return_logprob": return_logprob, **adapter}
    return {"input_ids": [list(prompt)] * len(rows), "sampling_params": params, "return_logprob": return_logprob,
            **adapter}
