"""The remote reward: the user's HTTP service scores one row per request, with bounded concurrency,
timeouts and retries.

Request: `POST <reward.remote.url>` with a JSON object

    {"uid": "<the prompt's uid>", "sample": 0,      # sample of that prompt (0 .. rollout.n - 1)
     "data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],  # the row's chat messages
     "response": "...",                              # the decoded response (special tokens skipped)
     "ground_truth": "72",                           # reward_model.ground_truth, or null
     "extra_info": {...}}                            # the row's extra_info

Response: HTTP 200 with a JSON object holding a finite number `"score"` (other keys are
ignored). (uid, sample) names a row uniquely within a step, so a service may
deduplicate the retries of one row.

Failures: a connection error, a timeout, or HTTP 408, 429 or 5xx is retried after
`backoff_s`, doubling, up to `retries` times; any other status, or a 200 without a
finite score, fails the row at once (repeating the request cannot fix it). A row
that has failed is reported with its uid and sample (`RemoteRewardError`, or the
failures `gather_scores` returns), never scored 0; the reward loop then fails the
step or drops the row (`reward.remote.on_failure`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import aiohttp

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
T = TypeVar("T")


class RemoteRewardError(RuntimeError):
    """Rows the remote reward could not score; names each by uid and sample with its last error."""

    def __init__(self, failures: Sequence[tuple[str, int, str]]):
        self.failures = list(failures)
        lines = [f"uid {uid} sample {sample}: {error}" for uid, sample, error in self.failures[:20]]
        more = len(self.failures) - len(lines)
        super().__init__(f"remote reward failed for {len(self.failures)} row(s):\n" + "\n".join(lines)
                         + (f"\n... and {more} more" if more > 0 else ""))


class RequestFailed(Exception):
    """One request that failed for good (after its retries, or at once when retrying cannot help)."""


class _AttemptFailed(Exception):
    def __init__(self, message: str, *, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


async def post_json(session: aiohttp.ClientSession, url: str, body: Any, *, slots: asyncio.Semaphore, retries: int,
                    backoff_s: float, read: Callable[[Any], T]) -> T:
    """POST `body` to `url` and return `read(<the JSON answer>)`, with the failure rules of the module docstring
    (`read` raises ValueError, KeyError or TypeError for an unusable answer); RequestFailed with the last error."""
    attempt = 0
    while True:
        try:
            async with slots:
                return await _attempt(session, url, body, read)
        except _AttemptFailed as failure:
            if not failure.retryable or attempt >= retries:
                tries = f" after {attempt + 1} attempts" if attempt else ""
                raise RequestFailed(f"{failure}{tries}") from None
        await asyncio.sleep(backoff_s * 2**attempt)
        attempt += 1


async def _attempt(session: aiohttp.ClientSession, url: str, body: Any, read: Callable[[Any], T]) -> T:
    try:
        async with session.post(url, json=body) as response:
            text = await response.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        raise _AttemptFailed(f"{url}: {type(error).__name__}: {error}".rstrip(": "), retryable=True) from None
    if response.status != 200:
        raise _AttemptFailed(f"{url}: HTTP {response.status}: {text.strip()[:200]}",
                             retryable=response.status in RETRYABLE_STATUS)
    try:
        return read(json.loads(text))
    except (ValueError, KeyError, TypeError) as error:
        reason = error.args[0] if isinstance(error, ValueError) and error.args else f"{type(error).__name__} {error}"
        raise _AttemptFailed(f"{url}: {reason} in the answer {text.strip()[:200]!r}", retryable=False) from None


def _read_score(answer: Any) -> float:
    try:
        score = float(answer["score"])
    except (KeyError, TypeError, ValueError):
        raise ValueError("no numeric 'score'") from None
    if not math.isfinite(score):
        raise ValueError(f"non-finite score {score}")
    return score


class RemoteRewardClient:
    """Scores rows on the service at `url`; `submit` may be called from any thread, results are futures."""

    def __init__(self, url: str, *, max_concurrency: int, timeout_s: float, retries: int, backoff_s: float,
                 headers: Mapping[str, str] | None = None):
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self._headers = dict(headers or {})
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_concurrency = max_concurrency
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        # Requests run on a private loop in a thread of their own, so rows can be submitted from the
        # generation callback and from plain code alike.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="remote-reward", daemon=True)
        self._thread.start()

    def submit(self, row: Mapping[str, Any]) -> concurrent.futures.Future:
        """Score one request object (the module's schema); the future's result is the score (float) or
        `RemoteRewardError` naming the row."""
        return asyncio.run_coroutine_threadsafe(self._score(dict(row)), self._loop)

    def score(self, rows: Sequence[Mapping[str, Any]]) -> list[float]:
        """Scores of `rows`, in order; RemoteRewardError naming every row that failed."""
        return collect_scores(rows, [self.submit(row) for row in rows])

    async def _score(self, row: dict) -> float:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout, headers=self._headers)
            self._slots = asyncio.Semaphore(self._max_concurrency)
        try:
            return await post_json(self._session, self.url, row, slots=self._slots, retries=self.retries,
                                   backoff_s=self.backoff_s, read=_read_score)
        except RequestFailed as failure:
            raise RemoteRewardError([(str(row.get("uid")), int(row.get("sample", 0)), str(failure))]) from None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def gather_scores(futures: Sequence[concurrent.futures.Future]) -> tuple[list[float], list[tuple[str, int, str]]]:
    """The scores of `futures` (one per row, NaN where the row failed), waiting for all, and the failures as
    (uid, sample, last error)."""
    scores, failures = [], []
    for future in futures:
        try:
            scores.append(future.result())
        except RemoteRewardError as error:
            failures += error.failures
            scores.append(math.nan)
    return scores, failures


def collect_scores(rows: Sequence[Mapping[str, Any]], futures: Sequence[concurrent.futures.Future]) -> list[float]:
    """The scores of `futures` (one per row), waiting for all; one RemoteRewardError naming every failed row."""
    scores, failures = gather_scores(futures)
    if failures:
        raise RemoteRewardError(failures)
    return scores
