"""The buffer between the rollout producer and the trainer: complete prompt groups, oldest first, staleness-bounded.

A group is the `rollout.n` samples of one prompt; it enters the buffer when its
last sample is generated (so groups stay whole) and leaves it when the trainer
takes it. Age is admission order (`Group.seq`): the trainer takes the oldest
complete groups, a batch at a time, without waiting for any batch to finish.

Staleness of a sample = the trainer's weight version - the oldest weight
version among its tokens. A group whose staleness would exceed k
(`max_staleness`) is never trained: `take` removes it and hands it to
`on_stale`, which regenerates it (the prompt is generated again under current
weights and keeps its age); it is counted in `async/dropped_groups`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megarl.protocol import Batch
from megarl.rollout.results import GenerationResult


@dataclass
class Group:
    """One prompt's samples: `rows` its non-tensor fields (uid, data_source, ...), `gen_rows` its generation
    rows (the prompt, repeated), `results` the generated samples, row for row; `token_versions` the weight
    version of every token of every sample."""

    batch_index: int
    prompt: int
    seq: int
    rows: Batch
    gen_rows: Batch
    results: list[GenerationResult] = field(default_factory=list)
    token_versions: list[list[int]] = field(default_factory=list)

    @property
    def uid(self) -> str:
        return str(self.rows["uid"][0])

    @property
    def min_version(self) -> int:
        """The oldest weight version among the group's tokens (a sample without tokens: its finish version)."""
        return min(min(versions) for versions in self.token_versions)


class GroupBuffer:
    """Complete groups waiting for the trainer; thread-safe (the producer puts from the fleet's loop)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._groups: dict[int, Group] = {}

    def put(self, group: Group) -> None:
        with self._cond:
            self._groups[group.seq] = group
            self._cond.notify_all()

    def wake(self) -> None:
        """Make a waiting `take` look again (a failure or a stop to notice)."""
        with self._cond:
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def drain(self) -> list[Group]:
        """Remove and return every buffered group (a resume regenerates them)."""
        with self._cond:
            groups, self._groups = list(self._groups.values()), {}
            return groups

    def take(self, count: int, *, version: int, max_staleness: int, on_stale: Callable[[Group], None],
             check: Callable[[], None]) -> tuple[list[Group], int, float]:
        """(the `count` oldest complete groups within the bound, oldest first; groups dropped as stale; seconds
        waited). `check()` runs while waiting and raises to stop it (a failed producer, a stop request)."""
        start, dropped = time.perf_counter(), 0
        while True:
            stale: list[Group] = []
            with self._cond:
                for seq in sorted(self._groups):
                    if version - self._groups[seq].min_version > max_staleness:
                        stale.append(self._groups.pop(seq))
                if not stale and len(self._groups) >= count:
                    oldest = sorted(self._groups)[:count]
                    return [self._groups.pop(seq) for seq in oldest], dropped, time.perf_counter() - start
                if not stale:
                    self._cond.wait(0.2)
            for group in stale:
                dropped += 1
                on_stale(group)
            check()
