"""The batch loop: one worker thread that turns queued sequences into tokens.

The HTTP front end `submit`s sequences; the worker takes every waiting sequence
(up to `max_batch`), left-pads them, prefills once with a fresh KV cache and
then decodes one token per step for the whole batch. Sequences that finish
leave the batch at once (their rows are dropped from the cache), so the cost of
a step follows the live batch: for 256 sequences of 4..128 new tokens on a tiny
model this took 0.8 s, against 2-3 s when finished rows stayed in the batch.
Sequences that arrive mid-batch join it at the next step boundary (their own
prefill, then both caches left-padded to one length): a burst of HTTP requests
whose first few started a batch alone would otherwise wait for that whole batch.
Joining needs transformers' per-layer `DynamicCache` (>= 4.56); without it new
sequences wait for the next batch.

A step is a forward pass and the sampling of its tokens, as in SGLang. Between
two steps the worker applies aborts, pauses (`abort`, `retract`: put the
unfinished sequences back at the head of the queue to be re-prefilled with
their output so far, `in_place`: keep the batch and its cache and wait) and
holds: `with scheduler.hold():` blocks until the worker is between steps, so a
weight update never races a forward pass.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache, PreTrainedModel

try:
    from transformers.cache_utils import DynamicLayer
except ImportError:  # transformers < 4.56 keeps key/value lists instead of layers: no joining
    DynamicLayer = None

from megarl.rollout.cpu_engine.lora import LoraServing
from megarl.rollout.cpu_engine.sampler import BatchSamplingParams, sample_next_tokens, token_logprobs
from megarl.rollout.cpu_engine.sequence import Sequence

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class _Batch:
    """The live rows of the running batch and the tensors that follow them."""

    seqs: list[Sequence]
    cache: DynamicCache
    attention_mask: torch.Tensor  # [B, T]
    last_positions: torch.Tensor  # [B]
    params: BatchSamplingParams

    def keep(self, rows: list[int]) -> None:
        index = torch.tensor(rows, dtype=torch.long)
        self.seqs = [self.seqs[i] for i in rows]
        self.cache.batch_select_indices(index)
        self.attention_mask = self.attention_mask[index]
        self.last_positions = self.last_positions[index]
        self.params = self.params.select(index)

    def can_join(self) -> bool:
        layers = getattr(self.cache, "layers", None)
        return DynamicLayer is not None and bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def join(self, other: _Batch) -> None:
        """Append `other`'s rows; the shorter cache and mask are left-padded (masked) to the longer length."""
        width = max(self.attention_mask.shape[1], other.attention_mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([_left_pad(mine.keys, width, dim=-2), _left_pad(theirs.keys, width, dim=-2)])
            mine.values = torch.cat([_left_pad(mine.values, width, dim=-2), _left_pad(theirs.values, width, dim=-2)])
        self.attention_mask = torch.cat(
            [_left_pad(self.attention_mask, width, dim=-1), _left_pad(other.attention_mask, width, dim=-1)]
        )
        self.seqs = self.seqs + other.seqs
        self.last_positions = torch.cat([self.last_positions, other.last_positions])
        self.params = self.params.concat(other.params)


def _unfinished(seqs: list[Sequence]) -> list[Sequence]:
    """The sequences that still need tokens (those asking for none finish here)."""
    for seq in seqs:
        if seq.sampling.max_new_tokens == 0:
            seq.finish({"type": "length", "length": 0})
    return [seq for seq in seqs if not seq.done]


def _left_pad(tensor: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


class Scheduler:
    """Owns the model's forward passes; every public method is safe to call from any thread."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        max_batch: int,
        eos_token_ids: frozenset[int],
        decode: Callable[[list[int], bool], str] | None,
        seed: int,
        lora: LoraServing | None = None,
        pool_tokens: int,
    ):
        self._model = model
        self._lora = lora
        self._max_batch = max_batch
        self._pool_tokens = pool_tokens
        self._eos_token_ids = eos_token_ids
        self._decode = decode
        self._vocab_size = model.get_output_embeddings().weight.shape[0]
        self._fallback_generator = torch.Generator().manual_seed(seed)
        # transformers 5 renamed the forward argument `past_key_values` to `cache`.
        parameters = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._pause_mode: str | None = None
        self._holds = 0
        self._parked = True
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-scheduler", daemon=True)

    # ---- control, called from the HTTP side -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            for seq in self._waiting:
                seq.abort("server shutting down")
            self._waiting.clear()
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cond:
            if self._stopping:
                for seq in seqs:
                    seq.abort("server shutting down")
                return
            self._waiting.extend(seqs)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, message: str = "aborted") -> int:
        """Abort matching sequences (by sequence or request id); returns how many were found."""
        with self._cond:
            return self._abort_locked(rid, abort_all=abort_all, message=message)

    def pause(self, mode: str) -> None:
        """Stop generating (see the module docstring for the modes); returns once the worker is between steps."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            if mode == "abort":
                self._abort_locked(None, abort_all=True, message="aborted by pause_generation")
            self._pause_mode = mode
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._parked or self._stopping)

    def resume(self) -> None:
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Run the body while the worker waits between steps (no forward pass in flight)."""
        with self._cond:
            self._holds += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._parked or self._stopping)
        try:
            yield
        finally:
            with self._cond:
                self._holds -= 1
                self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def load(self) -> tuple[int, int]:
        """(unfinished sequences in the running batch, waiting sequences)."""
        with self._cond:
            return sum(not seq.done for seq in self._running), len(self._waiting)

    def _abort_locked(self, rid: str | None, *, abort_all: bool, message: str) -> int:
        def matches(seq: Sequence) -> bool:
            return abort_all or seq.rid == rid or seq.request_rid == rid

        queued = [seq for seq in self._waiting if matches(seq)]
        for seq in queued:
            self._waiting.remove(seq)
            seq.abort(message)
        running = [seq for seq in self._running if matches(seq) and not seq.done]
        for seq in running:
            seq.abort_message = message
        self._cond.notify_all()
        return len(queued) + len(running)

    # ---- the worker thread -------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    self._parked = True
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._stopping or self._may_start_batch())
                    if self._stopping:
                        return
                    self._parked = False
                    batch = self._take_waiting(self._max_batch)
                try:
                    started = time.perf_counter()
                    steps = self._run_batch(batch)
                    logger.debug(
                        "batch of %d sequences: %d decode steps in %.1f ms",
                        len(batch), steps, 1000 * (time.perf_counter() - started),
                    )
                except Exception as error:  # noqa: BLE001 - a failed batch must not kill the server
                    logger.exception("batch of %d sequences failed", len(batch))
                    with self._cond:
                        for seq in self._running:
                            seq.abort(f"internal error: {type(error).__name__}: {error}")
                finally:
                    with self._cond:
                        self._running = []

    def _may_start_batch(self) -> bool:
        return bool(self._waiting) and self._pause_mode is None and not self._holds

    def _take_waiting(self, limit: int) -> list[Sequence]:
        """Move up to `limit` waiting sequences into the running set (lock held), in order, while the KV pool holds
        them (`kv_pool`: the first that does not fit waits, and so do those behind it). With LoRA, a sequence whose
        adapter would make the batch use more than `--max-loras-per-batch` adapters waits (in order)."""
        # A batch that keeps admitting newcomers may never end: drop finished sequences here.
        running = [seq for seq in self._running if not seq.done]
        room = self._pool_tokens - sum(seq.reserved_tokens for seq in running)
        adapters = {_adapter_id(seq) for seq in running}
        taken, skipped = [], []
        while self._waiting and len(taken) < limit and self._waiting[0].reserved_tokens <= room:
            seq = self._waiting.popleft()
            if self._lora is not None and not self._lora.admits(adapters, seq.adapter):
                skipped.append(seq)
                continue
            adapters.add(_adapter_id(seq))
            room -= seq.reserved_tokens
            taken.append(seq)
        self._waiting.extendleft(reversed(skipped))
        self._running = running + taken
        return taken

    def _run_batch(self, seqs: list[Sequence]) -> int:
        """Generate until every sequence of the batch has finished or left; returns the decode steps run."""
        live = _unfinished(seqs)
        if not live:
            return 0
        batch, logits = self._prefill(live)
        steps = 0
        while True:
            # A forward pass and the sampling of its tokens are one step, as in SGLang: a pause or a weight
            # update lands after the tokens are recorded, so a token is never sampled from one version's
            # logits and reported under the next.
            tokens, logprobs = sample_next_tokens(logits, batch.params, fallback_generator=self._fallback_generator)
            self._record_step(batch.seqs, tokens, logprobs)
            if all(seq.done for seq in batch.seqs) or not self._between_steps(batch):
                return steps
            alive = [row for row, seq in enumerate(batch.seqs) if not seq.done]
            if not alive:
                return steps
            if len(alive) < len(batch.seqs):
                batch.keep(alive)
                tokens = tokens[alive]
            logits = self._admit_newcomers(batch, self._decode_step(batch, tokens))
            steps += 1

    def _admit_newcomers(self, batch: _Batch, logits: torch.Tensor) -> torch.Tensor:
        """Prefill waiting sequences and join them to the running batch; returns the joined logits."""
        if not batch.can_join():
            return logits
        with self._cond:
            if not self._may_start_batch():
                return logits
            newcomers = _unfinished(self._take_waiting(self._max_batch - len(batch.seqs)))
        if not newcomers:
            return logits
        joined, new_logits = self._prefill(newcomers)
        batch.join(joined)
        return torch.cat([logits, new_logits])

    def _between_steps(self, batch: _Batch) -> bool:
        """Apply aborts, pauses and holds; False when the batch must end now."""
        with self._cond:
            while True:
                for seq in batch.seqs:
                    if seq.abort_message is not None:
                        seq.abort(seq.abort_message)
                if self._stopping:
                    for seq in batch.seqs:
                        seq.abort("server shutting down")
                    return False
                if self._pause_mode == "retract":
                    unfinished = [seq for seq in batch.seqs if not seq.done]
                    self._waiting.extendleft(reversed(unfinished))
                    return False
                if self._pause_mode != "in_place" and not self._holds:
                    self._parked = False
                    return True
                self._parked = True
                self._cond.notify_all()
                self._cond.wait()

    def _forward(self, seqs: list[Sequence], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, **kwargs):
        with nullcontext() if self._lora is None else self._lora.rows([seq.adapter for seq in seqs]):
            return self._model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
                **kwargs,
            )

    def _prefill(self, seqs: list[Sequence]) -> tuple[_Batch, torch.Tensor]:
        # A retracted sequence resumes by re-reading its prompt plus what it generated so far.
        inputs = [seq.prompt_ids + seq.output_ids for seq in seqs]
        width = max(len(ids) for ids in inputs)
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        attention_mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, ids in enumerate(inputs):
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
        position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
        params = BatchSamplingParams.build(
            temperatures=[seq.sampling.temperature for seq in seqs],
            top_k=[seq.sampling.top_k for seq in seqs],
            top_p=[seq.sampling.top_p for seq in seqs],
            min_p=[seq.sampling.min_p for seq in seqs],
            generators=[seq.generator for seq in seqs],
            vocab_size=self._vocab_size,
        )
        want_prompt = any(seq.wants_prompt_logprobs for seq in seqs)
        cache = _new_cache(self._model.config)
        out = self._forward(
            seqs,
            input_ids,
            attention_mask,
            position_ids,
            logits_to_keep=0 if want_prompt else 1,
            **{self._cache_argument: cache},
        )
        if want_prompt:
            self._record_prompt_logprobs(seqs, out.logits, params.temperatures, width)
        batch = _Batch(seqs, cache, attention_mask, position_ids[:, -1], params)
        return batch, out.logits[:, -1, :]

    def _decode_step(self, batch: _Batch, tokens: torch.Tensor) -> torch.Tensor:
        batch.attention_mask = torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones(len(batch.seqs), 1)], dim=-1
        )
        batch.last_positions = batch.last_positions + 1
        out = self._forward(
            batch.seqs,
            tokens.unsqueeze(-1),
            batch.attention_mask,
            batch.last_positions.unsqueeze(-1),
            **{self._cache_argument: batch.cache},
        )
        return out.logits[:, -1, :]

    def _record_step(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        top = _top_logprobs(logprobs, max(seq.top_logprobs_num for seq in seqs))
        for row, (seq, token) in enumerate(zip(seqs, tokens.tolist())):
            row_top = top[row][: seq.top_logprobs_num] if seq.top_logprobs_num > 0 else None
            seq.append_token(token, chosen[row], row_top, eos_token_ids=self._eos_token_ids, decode=self._decode)
            if seq.stream and not seq.done and seq.on_progress is not None:
                seq.on_progress(seq, len(seq.output_ids))

    def _record_prompt_logprobs(
        self, seqs: list[Sequence], logits: torch.Tensor, temperatures: torch.Tensor, width: int
    ) -> None:
        for row, seq in enumerate(seqs):
            if not seq.wants_prompt_logprobs:
                continue
            prompt = seq.prompt_ids
            start = width - len(prompt) - len(seq.output_ids)
            # Position j of the prompt is predicted by the logits one position earlier;
            # the first prompt token has no log-prob (SGLang reports None).
            logprobs = token_logprobs(logits[row, start : start + len(prompt) - 1], temperatures[row])
            targets = torch.tensor(prompt[1:], dtype=torch.long)
            values = [None] + logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist()
            tops: list = [None] + _top_logprobs(logprobs, seq.top_logprobs_num)
            first = min(seq.logprob_start_len, len(prompt))
            seq.input_logprobs = values[first:]
            if seq.top_logprobs_num > 0:
                seq.input_top_logprobs = tops[first:]


def _adapter_id(seq: Sequence) -> str | None:
    return seq.adapter.lora_id if seq.adapter is not None else None


def _new_cache(config) -> DynamicCache:
    try:
        return DynamicCache(config=config)
    except TypeError:  # transformers < 4.56 builds its layers lazily and takes no config
        return DynamicCache()


def _top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """The k most likely (logprob, token_id) pairs of each row; [] per row when k == 0."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(values.tolist(), ids.tolist())]
