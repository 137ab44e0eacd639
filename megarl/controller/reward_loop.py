"""The reward phase as a loop of its own: rows are scored while the rest of the batch is still generating.

`RewardLoop.begin(batch, gen_batch)` opens a `ScoringRun` for one step; the rollout
fleet hands it each group of rows as soon as their generation finishes (`add`, called
on the fleet's event loop, only queues work). Scoring then runs beside generation:
decoding and the rule scorers at once in a thread, the remote reward at once on its
own client, the judge per group on its fleet, and the reward model in batches of
`reward_model.batch_rows` rows as they fill (one thread sends them, so every rank of
the RM group sees its calls in the same order). `finish(batch, rows=...)` waits for
what is left (the last partial RM batch, slow remote rows), combines the rule and
model-side scores (`reward.combine`), puts `rm_scores` and `token_level_scores` into
the batch at the last valid response token, and returns the reward metrics.

A remote row that still fails after its retries fails the step, or with
`reward.remote.on_failure: drop` leaves its group: it stays in the batch as a
placeholder without response tokens (no loss, no baseline), marked in `dropped`, and
counts in `reward/remote_failed`.

`busy_seconds` is the wall time during which any scoring work was in progress, over
the whole step: the step loop logs it as `timing_s/reward_total`, while
`timing_s/reward` times `finish` alone, the part that did not overlap generation.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megarl.algorithms.metrics import rm_score_metrics
from megarl.protocol import Batch
from megarl.rewards.combine import combine_scores
from megarl.rewards.manager import at_last_token
from megarl.rewards.remote import RemoteRewardClient, RemoteRewardError, gather_scores
from megarl.rollout.batching import prompt_token_lists

logger = logging.getLogger(__name__)


class BusyClock:
    """Wall time during which at least one task was running (overlapping tasks count once)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active, self._since, self._total = 0, 0.0, 0.0

    def start(self) -> None:
        with self._lock:
            if self._active == 0:
                self._since = time.perf_counter()
            self._active += 1

    def stop(self) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0:
                self._total += time.perf_counter() - self._since

    def __enter__(self) -> BusyClock:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self._active else 0.0)


@dataclass
class ModelSide:
    """The model-side scorer of a run (at most one is configured): a reward model with its input builder and
    batch size, a judge, or a remote client."""

    reward_model: Any = None  # megarl.controller.roles.RewardModelRole
    rm_inputs: Any = None  # megarl.data.rm_inputs.RewardModelInputs
    batch_rows: int | None = None
    judge: Any = None  # megarl.controller.judge.JudgeScorer
    remote: RemoteRewardClient | None = None
    remote_on_failure: str = "fail"  # reward.remote.on_failure: "fail" the step or "drop" the row


class RewardLoop:
    """The run's scorers: the rule reward manager, the model side, and `reward.combine` with its options."""

    def __init__(self, *, manager: Any, tokenizer: Any, combine: str, combine_options: dict[str, float],
                 model_side: ModelSide, threads: int = 4):
        self.manager, self.tokenizer = manager, tokenizer
        self.combine, self.combine_options = combine, dict(combine_options)
        self.model_side = model_side
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="reward")
        self._rm_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")

    def begin(self, batch: Batch, gen_batch: Batch) -> ScoringRun:
        """A run for one step: `batch` holds the rows' non-tensor fields (raw_prompt, data_source,
        reward_model, extra_info, uid), `gen_batch` their prompts, row for row."""
        return ScoringRun(self, batch, gen_batch)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._rm_thread.shutdown(wait=True, cancel_futures=True)
        if self.model_side.remote is not None:
            self.model_side.remote.close()


def _sample_indices(uids: Sequence[Any]) -> list[int]:
    """For each row, how many earlier rows share its uid: its sample number within the prompt's group."""
    seen: dict[Any, int] = {}
    out = []
    for uid in uids:
        out.append(seen.get(uid, 0))
        seen[uid] = out[-1] + 1
    return out


class ScoringRun:
    """The scoring of one step's rows, fed group by group while generation runs; see the module docstring."""

    def __init__(self, loop: RewardLoop, batch: Batch, gen_batch: Batch):
        self.loop = loop
        size = len(gen_batch)
        self.prompt_ids = prompt_token_lists(gen_batch)
        self.messages = [list(m) for m in batch["raw_prompt"]]
        self.data_sources = [str(s) for s in batch["data_source"]]
        self.ground_truths = [(info or {}).get("ground_truth") for info in batch["reward_model"]]
        self.extra_infos = [info or {} for info in batch["extra_info"]]
        self.uids = [str(uid) for uid in batch["uid"]]
        self.samples = _sample_indices(self.uids)
        self.response_ids: list[list[int] | None] = [None] * size
        self.texts: list[str | None] = [None] * size
        self.rule = np.full(size, np.nan)
        self.rule_failed = np.zeros(size, dtype=bool)
        self.model = np.full(size, np.nan)
        self.judge_failed = np.zeros(size, dtype=bool)
        self.verdicts: list[str | None] = [None] * size
        self.clock = BusyClock()
        self._lock = threading.Lock()
        self._tasks: list[concurrent.futures.Future] = []
        self._remote: dict[int, concurrent.futures.Future] = {}
        self._rm_pending: list[int] = []

    @property
    def busy_seconds(self) -> float:
        return self.clock.seconds

    # ---- feeding ---------------------------------------------------------------------------------

    def add(self, rows: Sequence[int], results: Sequence[Any]) -> None:
        """Rows whose generation finished (`results[i].output_ids`); queues their scoring and returns at once."""
        ids = [list(result.output_ids) for result in results]
        self._submit(self.loop._pool, self._score_rows, list(rows), ids)

    def _submit(self, pool: concurrent.futures.Executor, fn: Callable, *args) -> None:
        self.clock.start()
        future = pool.submit(fn, *args)
        future.add_done_callback(lambda _: self.clock.stop())
        with self._lock:
            self._tasks.append(future)

    def _score_rows(self, rows: list[int], response_ids: list[list[int]]) -> None:
        texts = self.loop.tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        for row, ids, text in zip(rows, response_ids, texts):
            self.response_ids[row], self.texts[row] = ids, text
        tasks = [(self.data_sources[r], texts[i], self.ground_truths[r], self.extra_infos[r])
                 for i, r in enumerate(rows)]
        # Scored per group as it arrives: with reward.num_workers, each group goes to the worker processes.
        for row, result in zip(rows, self.loop.manager.score_tasks(tasks, pooled=True)):
            self.rule[row], self.rule_failed[row] = result.score, result.error is not None
        side = self.loop.model_side
        if side.remote is not None:
            for row in rows:
                self.clock.start()
                future = side.remote.submit(self._remote_request(row))
                future.add_done_callback(lambda _: self.clock.stop())
                self._remote[row] = future
        if side.judge is not None:
            self._judge(rows)
        if side.reward_model is not None:
            with self._lock:
                self._rm_pending += rows
                ready = side.batch_rows is not None and len(self._rm_pending) >= side.batch_rows
                batch, self._rm_pending = (self._rm_pending, []) if ready else (None, self._rm_pending)
            if batch:
                self._submit(self.loop._rm_thread, self._score_rm, batch)

    def _remote_request(self, row: int) -> dict[str, Any]:
        return {"uid": self.uids[row], "sample": self.samples[row], "data_source": self.data_sources[row],
                "prompt": self.messages[row], "response": self.texts[row], "ground_truth": self.ground_truths[row],
                "extra_info": self.extra_infos[row]}

    def _judge(self, rows: list[int]) -> None:
        verdicts = self.loop.model_side.judge.score(
            messages=[self.messages[r] for r in rows], responses=[self.texts[r] for r in rows],
            ground_truths=[self.ground_truths[r] for r in rows], data_sources=[self.data_sources[r] for r in rows])
        for row, score, failed, text in zip(rows, verdicts.scores, verdicts.failed, verdicts.texts):
            self.model[row], self.judge_failed[row], self.verdicts[row] = score, failed, text

    def _score_rm(self, rows: list[int]) -> None:
        side = self.loop.model_side
        inputs = side.rm_inputs.from_generation(prompt_ids=[self.prompt_ids[r] for r in rows],
                                                response_ids=[self.response_ids[r] for r in rows],
                                                messages=[self.messages[r] for r in rows])
        self.model[rows] = side.reward_model.score(inputs).double().numpy()

    # ---- the reward phase ------------------------------------------------------------------------

    def _remote_scores(self) -> np.ndarray:
        """The remote scores into `model`; the generation rows whose request failed (bool [B]). Failures fail the
        step (RemoteRewardError naming every row) unless `reward.remote.on_failure` is drop."""
        order = sorted(self._remote)
        scores, failures = gather_scores([self._remote[row] for row in order])
        if failures and self.loop.model_side.remote_on_failure == "fail":
            raise RemoteRewardError(failures)
        if failures:
            uid, sample, error = failures[0]
            logger.warning("remote reward: %d row(s) failed and leave their groups (reward.remote.on_failure: "
                           "drop); first: uid %s sample %d: %s", len(failures), uid, sample, error)
        self.model[order] = scores
        dropped = np.zeros(len(self.model), dtype=bool)
        dropped[order] = np.isnan(scores)
        return dropped

    def _wait(self) -> None:
        """Until every queued task (and the tasks they queue) has finished; re-raises the first failure."""
        while True:
            with self._lock:
                pending = [task for task in self._tasks if not task.done()]
                failed = next((task for task in self._tasks if task.done() and task.exception()), None)
            if failed is not None:
                raise failed.exception()
            if not pending:
                return
            concurrent.futures.wait(pending)

    def finish(self, batch: Batch, *, rows: np.ndarray) -> tuple[Batch, dict[str, float]]:
        """Scores into `batch` (its row i is generation row `rows[i]`): `rm_scores` (when a model side is
        configured) and `token_level_scores`, each at the last valid response token; the reward metrics."""
        self._wait()
        side = self.loop.model_side
        if side.reward_model is not None and self._rm_pending:
            self._submit(self.loop._rm_thread, self._score_rm, self._rm_pending)
            self._rm_pending = []
            self._wait()
        missing = [row for row, ids in enumerate(self.response_ids) if ids is None]
        if missing:
            raise RuntimeError(f"rows {missing[:8]} were never handed to the reward loop")
        dropped = self._remote_scores() if side.remote is not None else np.zeros(len(self.rule), dtype=bool)
        has_model = side.reward_model is not None or side.judge is not None or side.remote is not None
        rows = np.asarray(rows)
        gone = torch.as_tensor(dropped[rows])
        rule = torch.as_tensor(self.rule[rows], dtype=torch.float32)
        model = torch.as_tensor(np.where(dropped, 0.0, self.model)[rows], dtype=torch.float32) if has_model else None
        reward = combine_scores(self.loop.combine, rule=rule, rm=model, options=self.loop.combine_options)
        metrics = {"reward/scorer_failed": int(self.rule_failed.sum())}
        if side.remote is not None:
            batch = _leave_groups(batch, gone)
            metrics["reward/remote_failed"] = int(dropped.sum())
        mask = batch["response_mask"]
        batch["token_level_scores"] = at_last_token(reward.masked_fill(gone, 0.0), mask)
        if model is not None:
            batch["rm_scores"] = at_last_token(model, mask)
            metrics.update(rm_score_metrics(model, rule, (mask.sum(-1) > 0) & ~gone))
        if side.judge is not None:
            metrics["reward/judge_parse_fail"] = int(self.judge_failed.sum())
            _warn_parse_failures(self.judge_failed, self.verdicts)
        return batch, metrics


def _leave_groups(batch: Batch, gone: torch.Tensor) -> Batch:
    """Rows `gone` (bool [B]) stay in the batch as placeholders, so every DP shard and mini-batch keeps its size:
    no response token (no loss, counted in no token or sequence total), a uid of their own (no group's baseline
    sees them) and `dropped` (bool [B]) set, which the step's metrics skip."""
    batch["response_mask"] = batch["response_mask"].masked_fill(gone.unsqueeze(-1), 0)
    uids = np.array(batch["uid"], dtype=object)
    for row in np.flatnonzero(gone.numpy()):
        uids[row] = f"{uids[row]}/dropped-{row}"
    batch["uid"] = uids
    batch["dropped"] = gone
    return batch


def _warn_parse_failures(failed: np.ndarray, texts: Sequence[str | None]) -> None:
    if failed.any():
        first = int(np.flatnonzero(failed)[0])
        logger.warning("judge: %d verdict(s) held no score in range (scored with parse_fail_score); first: %r",
                       int(failed.sum()), texts[first])
