"""The rollout producer of asynchronous RL: admitted prompt batches generate in the background, group by group.

`admit(batch_index, batch)` starts a whole prompt batch on the fleet
(`RolloutFleet.start_generation`, seeded by the batch index as the synchronous
loop seeds step `batch_index`) and returns at once; as the samples of a prompt
come back, the prompt's group is completed and put into the `GroupBuffer`.
`regenerate(group)` sends a stale group's prompt again (it keeps its age).

Every token carries the weight version that generated it: the version the
server reported with the sample (`meta_info.weight_version`), or, for a
sample that went on under new weights (an in-flight update), the versions
its result lists per token. The producer also clocks the fleet's idle time:
the time no admitted group was generating.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

from megarl.config.settings import SamplingSettings
from megarl.controller.group_buffer import Group, GroupBuffer
from megarl.controller.phases import split_generation_batch
from megarl.protocol import Batch
from megarl.rollout.results import GenerationResult


def token_versions(result: GenerationResult) -> list[int]:
    """The weight version of each of the sample's tokens (one entry for a sample without tokens)."""
    if result.token_versions is not None:
        return [int(version) for version in result.token_versions] or [int(result.weight_version)]
    return [int(result.weight_version)] * max(len(result.output_ids), 1)


class RolloutProducer:
    """Admits prompt batches to the fleet and fills the buffer with their complete groups; see the module
    docstring. `admit`/`regenerate` run on the controller's thread, the row callbacks on the fleet's loop."""

    def __init__(self, fleet, buffer: GroupBuffer, *, sampling: SamplingSettings, rollout_n: int,
                 per_token_versions: bool = False, partial: bool = False):
        """`per_token_versions`: weight updates happen while samples run (in place), so ask for every token's;
        `partial`: a sample a weight update aborts goes on from its tokens (partial rollouts)."""
        self.fleet, self.buffer, self.sampling, self.n = fleet, buffer, sampling, rollout_n
        self.options = {"per_token_versions": True} if per_token_versions else {}
        self.options |= {"partial": True} if partial else {}
        self._lock = threading.Lock()
        self._generating = 0  # groups admitted and not yet complete
        self._seq = 0
        self._regenerations = 0
        self._idle_since: float | None = time.perf_counter()
        self._idle_s = 0.0
        self._futures: set[concurrent.futures.Future] = set()
        self.failure: BaseException | None = None

    def admit(self, batch_index: int, batch: Batch, *, skip: frozenset[int] = frozenset()) -> None:
        """Generate `batch` (prompts with their uids), the prompt rows in `skip` left out (trained already)."""
        keep = [row for row in range(len(batch)) if row not in skip]
        if not keep:
            return
        batch = batch[keep]
        gen = split_generation_batch(batch).repeat(self.n, interleave=True)
        rows = batch.repeat(self.n, interleave=True)
        groups = [Group(batch_index, prompt, self._next_seq(), rows[self._span(i)], gen[self._span(i)])
                  for i, prompt in enumerate(keep)]
        self._start(groups, gen, seed=batch_index)

    def regenerate(self, group: Group) -> None:
        """Generate a stale group's prompt again under the current weights; it keeps its place (age)."""
        self._regenerations += 1
        fresh = Group(group.batch_index, group.prompt, group.seq, group.rows, group.gen_rows)
        # Seeds of their own (negative call numbers are never a step's): a regenerated group is a new draw.
        self._start([fresh], group.gen_rows, seed=-self._regenerations)

    def idle_seconds(self) -> float:
        """The fleet's idle time since the last call (no admitted group generating), then reset."""
        with self._lock:
            now = time.perf_counter()
            idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle_s, self._idle_since = 0.0, (now if self._idle_since is not None else None)
            return idle

    @property
    def generating(self) -> int:
        """Groups admitted and not yet complete."""
        with self._lock:
            return self._generating

    def cancel(self) -> None:
        """Stop every generation in flight (a resume or a stop regenerates what they held)."""
        for future in list(self._futures):
            future.cancel()

    # ---- internals -----------------------------------------------------------------------------

    def _span(self, index: int) -> list[int]:
        return list(range(index * self.n, (index + 1) * self.n))

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _start(self, groups: list[Group], gen: Batch, *, seed: int) -> None:
        with self._lock:
            if self._idle_since is not None:
                self._idle_s += time.perf_counter() - self._idle_since
                self._idle_since = None
            self._generating += len(groups)
        slots: list[GenerationResult | None] = [None] * len(gen)

        def on_rows(rows: list[int], results: list[GenerationResult]) -> None:
            touched = set()
            for row, result in zip(rows, results):
                slots[row] = result
                touched.add(row // self.n)
            for index in sorted(touched):
                span = self._span(index)
                if all(slots[row] is not None for row in span):
                    self._complete(groups[index], [slots[row] for row in span])

        future = self.fleet.start_generation(gen, self.sampling, seed=seed, on_rows=on_rows, **self.options)
        self._futures.add(future)
        future.add_done_callback(self._finished)

    def _complete(self, group: Group, results: list[GenerationResult]) -> None:
        group.results = results
        group.token_versions = [token_versions(result) for result in results]
        with self._lock:
            self._generating -= 1
            if self._generating == 0:
                self._idle_since = time.perf_counter()
        self.buffer.put(group)

    def _finished(self, future: concurrent.futures.Future) -> None:
        self._futures.discard(future)
        if not future.cancelled() and future.exception() is not None and self.failure is None:
            self.failure = future.exception()
            self.buffer.wake()
