"""Sending a batch's prompt groups to the fleet and getting every row back exactly once, through failures.

Each group (the rows that share a prompt) is one `/generate` request carrying
one copy per row, all in flight together. A `Targets` object (the fleet) hands
out a server (or the router) with a free in-flight slot and hears about
failures. A request that fails because its target is unreachable or answers
5xx is re-sent (the target may be dead: the fleet then restarts it and hands
out others); samples that come back aborted are re-sent on their own. A 4xx
answer is the request's fault and fails the call at once. Each row's result is
stored once; the attempts per request are bounded.

Every row has its own sampling seed derived from the call's seed and the row
index (`megarl.rollout.sampling`, the client's bodies too). Servers honour it
only when started with `--enable-deterministic-inference` (`rollout.deterministic`):
then a retried sample on another server is the same sample; without it SGLang
ignores the seed and a retry draws another sample.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Awaitable, Callable, Protocol

from megarl.config.settings import SamplingSettings
from megarl.rollout.client import RolloutError
from megarl.rollout.results import GenerationResult, parse_output
from megarl.rollout.sampling import generate_body

RETRYABLE_STATUS = frozenset({500, 502, 503, 504})

Request = Callable[[str, str, str, Any], Awaitable[Any]]
Stream = Callable[[str, str, Any], Awaitable[list[Any]]]


class FleetError(RuntimeError):
    """Generation cannot finish: every server is gone, or a request kept failing; names servers and causes."""


class Target(Protocol):
    url: str


class Targets(Protocol):
    async def acquire(self) -> Target:
        """A target with a free in-flight slot (waits for one); raises FleetError when none can come back."""

    def release(self, target: Target) -> None:
        """Give back the slot taken by `acquire`."""

    async def report_failure(self, target: Target, error: RolloutError) -> None:
        """A request to `target` failed as unreachable/5xx: check it (and restart it if it is dead)."""


def is_retryable(error: RolloutError) -> bool:
    return error.status is None or error.status in RETRYABLE_STATUS


async def generate_rows(
    prompts: list[list[int]],
    groups: list[list[int]],
    *,
    sampling: SamplingSettings,
    seed: int | None,
    targets: Targets,
    request: Request,
    max_attempts: int,
    on_rows: Callable[[list[int], list[GenerationResult]], None] | None = None,
    lora_path: str | None = None,
    stream: Stream | None = None,
    partial: bool = False,
) -> list[GenerationResult]:
    """One result per prompt row, in row order; `groups` partition the rows into shared-prompt requests.

    `on_rows(rows, results)` hears about rows as soon as they are generated (on this event loop: it must
    only hand the work on); each row is reported exactly once. With `stream` (the client's `stream`) requests
    are streamed and each result lists the weight version of every token (`token_versions`): the version the
    server reported with the event that brought the token, so a sample that went on under new weights
    (a weight update while it was paused in place) says which tokens each version generated. With `partial`
    (partial rollouts) a sample aborted with tokens is re-sent as its prompt plus those tokens, for the tokens
    left of its budget, and its result is the two parts joined (`joined`)."""
    results: list[GenerationResult | None] = [None] * len(prompts)

    def store(row: int, result: GenerationResult) -> None:
        if results[row] is not None:
            raise RuntimeError(f"row {row} was generated twice")
        results[row] = result

    async def run_group(rows: list[int], prefix: GenerationResult | None = None) -> None:
        pending, attempt = list(rows), 0
        prompt, params = prompts[rows[0]], sampling
        if prefix is not None:  # a partial rollout goes on from the tokens it has
            if len(prefix.output_ids) >= sampling.max_new_tokens:
                store(rows[0], replace(prefix, finish_reason="length"))
                return
            prompt = prompt + prefix.output_ids
            params = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(prefix.output_ids))
        while pending:
            attempt += 1
            body = generate_body(prompt, pending, sampling=params, seed=seed, return_logprob=True,
                                 lora_path=lora_path)
            target = await targets.acquire()
            try:
                if stream is None:
                    outputs = _parse(await request(target.url, "POST", "/generate", body), count=len(pending),
                                     url=target.url)
                else:
                    events = await stream(target.url, "/generate", {**body, "stream": True})
                    outputs = _streamed(events, count=len(pending), url=target.url)
            except RolloutError as error:
                if not is_retryable(error):
                    raise
                if attempt >= max_attempts:
                    raise FleetError(f"rows {pending[:8]}: /generate failed {attempt} times; last: {error}") from error
                await targets.report_failure(target, error)
                continue
            finally:
                targets.release(target)
            if prefix is not None:
                outputs = [joined(prefix, output, limit=sampling.max_new_tokens) for output in outputs]
            if partial:
                # An aborted sample (a weight update aborted it) goes on from its tokens, each row on its own.
                cut = {row: output for row, output in zip(pending, outputs)
                       if output.finish_reason == "abort" and output.output_ids}
                await asyncio.gather(*(run_group([row], output) for row, output in cut.items()))
                outputs = [output for row, output in zip(pending, outputs) if row not in cut]
                pending = [row for row in pending if row not in cut]
            # An aborted sample (server paused or shutting down) is no sample: send it again.
            aborted = [row for row, output in zip(pending, outputs) if output.finish_reason == "abort"]
            done = [(row, output) for row, output in zip(pending, outputs) if output.finish_reason != "abort"]
            for row, output in done:
                store(row, output)
            if on_rows is not None and done:
                on_rows([row for row, _ in done], [output for _, output in done])
            if aborted and attempt >= max_attempts:
                raise FleetError(f"rows {aborted[:8]} were aborted {attempt} times (last by {target.url})")
            if aborted:
                await asyncio.sleep(min(1.0, 0.05 * 2**attempt))
            pending = aborted

    tasks = [asyncio.ensure_future(run_group(rows)) for rows in groups]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        # One failure fails the call: stop sending the rest.
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    missing = [row for row, result in enumerate(results) if result is None]
    if missing:
        raise RuntimeError(f"rows {missing[:8]} were never generated (groups do not cover the batch)")
    return results  # type: ignore[return-value]


def _parse(reply: Any, *, count: int, url: str) -> list[GenerationResult]:
    items = reply if isinstance(reply, list) else [reply]
    if len(items) != count:
        raise RolloutError(url, "/generate", 200, f"expected {count} outputs, got {len(items)}")
    try:
        return [parse_output(item, return_logprob=True) for item in items]
    except (KeyError, TypeError, ValueError) as error:
        raise RolloutError(url, "/generate", 200, f"malformed response: {error!r}") from error


def _streamed(events: list[Any], *, count: int, url: str) -> list[GenerationResult]:
    """The results of a streamed request: each index's last event (cumulative output), and the version of
    each token from the event that first carried it."""
    last: dict[int, dict] = {}
    versions: dict[int, list[str]] = {}
    try:
        for event in events:
            index = int(event.get("index", 0))
            seen = versions.setdefault(index, [])
            seen += [str(event["meta_info"]["weight_version"])] * (len(event["output_ids"]) - len(seen))
            last[index] = event
        if sorted(last) != list(range(count)):
            raise ValueError(f"expected outputs 0..{count - 1}, the stream had {sorted(last)}")
        return [replace(parse_output(last[index], return_logprob=True), token_versions=versions[index])
                for index in range(count)]
    except (KeyError, TypeError, ValueError) as error:
        raise RolloutError(url, "/generate", 200, f"malformed stream: {error!r}") from error


def joined(prefix: GenerationResult, rest: GenerationResult, *, limit: int) -> GenerationResult:
    """A partial rollout's parts as one sample: tokens, log-probs and per-token versions in order; it finishes as
    `rest` does (by length when the prefix alone used the budget `limit`)."""
    def versions(result: GenerationResult) -> list[str]:
        return list(result.token_versions or [str(result.weight_version)] * len(result.output_ids))

    reason = rest.finish_reason
    if len(prefix.output_ids) >= limit and reason == "abort":
        reason = "length"
    logprobs = None if prefix.logprobs is None or rest.logprobs is None else prefix.logprobs + rest.logprobs
    return GenerationResult(output_ids=prefix.output_ids + rest.output_ids, logprobs=logprobs, finish_reason=reason,
                            weight_version=rest.weight_version, token_versions=versions(prefix) + versions(rest))
