"""One sequence being generated: its parameters, its growing output and how it finishes.

A sequence is created by the HTTP layer, appended to by the scheduler's worker
thread and read back by the HTTP layer once `done` is set (or, for streaming,
up to the length the worker last announced), so no lock is needed.

Finishing follows SGLang: the token that stops a sequence (EOS or one of
`stop_token_ids`, neither of which stops it under `ignore_eos`; reaching
`max_new_tokens` wins over both) stays in `output_ids` and gets a log-prob, and finish reasons
are `{"type": "length", "length": N}`, `{"type": "stop", "matched": ID or
string}` or `{"type": "abort", "message": ...}`. Only the returned *text*
drops the matched stop token/string, unless `no_stop_trim` is set.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class SamplingSettings:
    """The validated sampling parameters of one sequence."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class Sequence:
    """Everything the scheduler and the HTTP layer share about one generated sample."""

    rid: str
    request_rid: str
    prompt_ids: list[int]
    sampling: SamplingSettings
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
    finish_reason: dict[str, Any] | None = None
    weight_version: str | None = None
    created_at: float = field(default_factory=time.perf_counter)
    adapter: Any = None  # the LoRA adapter it generates with (`lora.Adapter`); None: the base model
    finished_at: float | None = None
    abort_message: str | None = None
    generator: torch.Generator | None = None
    # Called on the worker thread; the HTTP layer hands them on to its event loop.
    on_progress: Callable[[Sequence, int], None] | None = None
    on_finish: Callable[[Sequence], None] | None = None

    def __post_init__(self) -> None:
        if self.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def reserved_tokens(self) -> int:
        """The most tokens it holds in the KV pool: its prompt and every token it may generate."""
        return len(self.prompt_ids) + self.sampling.max_new_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_logprobs is None

    def append_token(
        self,
        token: int,
        logprob: float,
        top: list[tuple[float, int]] | None,
        *,
        eos_token_ids: frozenset[int],
        decode: Callable[[list[int], bool], str] | None,
    ) -> None:
        """Record one generated token and finish the sequence if it should stop here."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        # SGLang's order (Req.check_finished): the length limit first, then EOS and `stop_token_ids`, both
        # skipped under `ignore_eos`, then stop strings, which `ignore_eos` leaves in force.
        if len(self.output_ids) >= self.sampling.max_new_tokens:
            self.finish({"type": "length", "length": len(self.output_ids)})
        elif not self.sampling.ignore_eos and (token in self.sampling.stop_token_ids or token in eos_token_ids):
            self.finish({"type": "stop", "matched": token})
        elif self.sampling.stop_strings and decode is not None and (matched := self._matched_stop_string(decode)):
            self.finish({"type": "stop", "matched": matched})

    def finish(self, reason: dict[str, Any]) -> None:
        if self.done:
            return
        self.finish_reason = reason
        self.finished_at = time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(self)

    def abort(self, message: str) -> None:
        self.finish({"type": "abort", "message": message})

    def _matched_stop_string(self, decode: Callable[[list[int], bool], str]) -> str | None:
        text = decode(self.output_ids, self.sampling.skip_special_tokens)
        for stop in self.sampling.stop_strings:
            if stop in text:
                return stop
        return None

    def text(self, decode: Callable[[list[int], bool], str] | None) -> str:
        """The output text (empty without a tokenizer), trimmed at the matched stop unless `no_stop_trim`."""
        if decode is None:
            return ""
        ids = self.output_ids
        matched = (self.finish_reason or {}).get("matched")
        stopped = self.finish_reason is not None and self.finish_reason["type"] == "stop"
        trim = stopped and not self.sampling.no_stop_trim
        if trim and isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = decode(ids, self.sampling.skip_special_tokens)
        if trim and isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        return text

    def e2e_latency(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.created_at
