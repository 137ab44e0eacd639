"""Asynchronous RL's producer, buffer and bookkeeping (`megarl.controller.rollout_ahead`) against a fake fleet
whose groups finish out of order: the staleness bound from the per-token version tags, k = 0 as the synchronous
loop's batches, every uid trained exactly once (through stale regenerations and a resume)."""

from __future__ import annotations

import collections
import concurrent.futures
import random
import threading
import time

import numpy as np
import pytest
import torch

from megarl.controller.rollout_ahead import AsyncRollout, assemble
from megarl.rollout.results import GenerationResult

BATCH, N = 4, 2


class FakeLoader:
    """Prompt batches numbered by position; `state_dict` is the position."""

    def __init__(self):
        self.position = 0

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def __next__(self) -> dict:
        first, self.position = self.position, self.position + BATCH
        ids = torch.arange(first, first + BATCH).unsqueeze(1).repeat(1, 3) + 10
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(3).repeat(BATCH, 1),
                "index": np.arange(first, first + BATCH)}


class FakeFleet:
    """Generates each prompt group after a random delay on threads; a token's version is the one served when its
    group started, and with `split` the later half of a sample is tagged with the version served when it ended (an
    in-flight update)."""

    def __init__(self, seed: int, *, slow: float = 0.0, split: bool = False):
        self.weight_version, self.pad_token_id = "0", 0
        self.random, self.slow, self.split = random.Random(seed), slow, split
        self.pool = concurrent.futures.ThreadPoolExecutor(8)
        self.seeds: list[int] = []

    def serve_stalled(self) -> None:
        pass

    def start_generation(self, gen_batch, sampling, *, seed, on_rows):
        self.seeds.append(seed)
        rows = len(gen_batch)
        delays = [self.random.random() * 0.03 + (self.slow if self.random.random() < 0.2 else 0.0)
                  for _ in range(rows // N)]

        def group(index: int) -> None:
            start = self.weight_version
            time.sleep(delays[index])
            end = self.weight_version
            versions = [start, start, end, end] if self.split else None
            on_rows(list(range(index * N, index * N + N)),
                    [GenerationResult([5, 6, 7, 8], [-1.0] * 4, "stop", end, versions) for _ in range(N)])

        def run() -> None:
            list(self.pool.map(group, range(rows // N)))

        return self.pool.submit(run)


def _run(ahead: AsyncRollout, fleet: FakeFleet, steps: range, *, k: int) -> tuple[list[list[str]], list[dict]]:
    """The step loop's calls with a trainer that takes a few ms; returns each step's uids and metrics."""
    uids, metrics = [], []
    for step in steps:
        ahead.admit_until(step)
        version = int(fleet.weight_version)
        groups, step_metrics = ahead.take(version=version, stop_requested=lambda: False)
        for group in groups:  # the bound, from every token's tag
            assert all(version - v <= k for versions in group.token_versions for v in versions)
        rows, gen, results, table = assemble(groups, version=version, width=6)
        assert table.shape == (BATCH * N, 6) and len(rows) == len(gen) == len(results) == BATCH * N
        uids.append(list(dict.fromkeys(rows["uid"])))
        metrics.append(step_metrics)
        time.sleep(0.01)
        fleet.weight_version = str(step + 1)  # the step's weight sync
        ahead.commit(groups)
        ahead.admit_until(step + 1)
    return uids, metrics


def _ahead(fleet: FakeFleet, loader: FakeLoader, *, k: int, steps: int) -> AsyncRollout:
    return AsyncRollout(fleet, loader, sampling=None, rollout_n=N, batch_size=BATCH, max_staleness=k,
                        total_steps=steps)


def test_zero_staleness_trains_each_steps_own_batch_in_order_with_its_seed() -> None:
    fleet, loader = FakeFleet(0, slow=0.05), FakeLoader()
    uids, metrics = _run(_ahead(fleet, loader, k=0, steps=5), fleet, range(5), k=0)
    assert uids == [[f"b{step}-p{row}" for row in range(BATCH)] for step in range(5)]
    assert fleet.seeds == list(range(5))  # the synchronous loop seeds step s with s
    assert all(m["async/staleness/max"] == 0 and m["async/dropped_groups"] == 0 for m in metrics)


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_bound_holds_and_every_uid_is_trained_once(k: int) -> None:
    fleet, loader = FakeFleet(k, slow=0.08, split=True), FakeLoader()
    uids, metrics = _run(_ahead(fleet, loader, k=k, steps=12), fleet, range(12), k=k)
    trained = [uid for step in uids for uid in step]
    assert collections.Counter(trained) == {f"b{b}-p{row}": 1 for b in range(12) for row in range(BATCH)}
    assert max(m["async/staleness/max"] for m in metrics) == k  # it runs ahead as far as allowed
    assert all(m["async/staleness/max"] <= k for m in metrics)
    # Out of order: some step trained a group of a later batch before an older batch was complete.
    assert any(uid.split("-")[0] != f"b{step}" for step, step_uids in enumerate(uids) for uid in step_uids)
    assert sum(m["async/dropped_groups"] for m in metrics) >= 1  # a slow group outlived the bound: regenerated


def test_resume_regenerates_what_was_in_flight_and_trains_no_uid_twice() -> None:
    fleet, loader = FakeFleet(7, slow=0.05), FakeLoader()
    first = _ahead(fleet, loader, k=2, steps=10)
    before, _ = _run(first, fleet, range(4), k=2)
    state = first.state()  # the checkpoint after 4 steps; batches 4 and 5 are generating or buffered
    first.close()
    assert state["next_batch"] <= 4 and loader.position > state["loader"]["position"]
    # A fresh process: the loader back at the checkpoint's position, the weights at version 4.
    fleet, loader = FakeFleet(8, slow=0.05), FakeLoader()
    loader.load_state_dict(state["loader"])
    fleet.weight_version = "4"
    second = _ahead(fleet, loader, k=2, steps=10)
    second.restore(state)
    after, _ = _run(second, fleet, range(4, 10), k=2)
    trained = [uid for step in before + after for uid in step]
    assert collections.Counter(trained) == {f"b{b}-p{row}": 1 for b in range(10) for row in range(BATCH)}


def test_a_failed_generation_stops_the_waiting_trainer() -> None:
    class Broken(FakeFleet):
        def start_generation(self, gen_batch, sampling, *, seed, on_rows):
            future = concurrent.futures.Future()
            threading.Timer(0.05, future.set_exception, (RuntimeError("no rollout server is serving"),)).start()
            return future

    ahead = _ahead(Broken(0), FakeLoader(), k=1, steps=3)
    ahead.admit_until(0)
    with pytest.raises(RuntimeError, match="no rollout server is serving"):
        ahead.take(version=0, stop_requested=lambda: False)


def test_a_stop_request_ends_the_wait_and_the_checkpoint_keeps_the_untrained_groups() -> None:
    """SIGTERM while the trainer waits: the wait ends (GenerationInterrupted, which abandons the step), and the
    state a checkpoint writes then regenerates everything not trained."""
    from megarl.rollout import GenerationInterrupted

    fleet, loader = FakeFleet(3, slow=5.0), FakeLoader()
    fleet.random = random.Random(0)
    ahead = _ahead(fleet, loader, k=1, steps=4)
    (trained,), _ = _run(ahead, fleet, range(1), k=1)
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.perf_counter()
    with pytest.raises(GenerationInterrupted):
        for _ in range(3):  # the slow groups keep the buffer short of a batch until the stop
            ahead.take(version=1, stop_requested=stop.is_set)
    assert time.perf_counter() - started < 3.0
    state = ahead.state()
    first = state["next_batch"]
    assert first <= 1 and state["loader"] == {"position": first * BATCH}
    recorded = {f"b{b}-p{p}" for b in range(first) for p in range(BATCH)}
    recorded |= {f"b{b}-p{p}" for b, rows in state["trained"].items() for p in rows}
    assert recorded == set(trained)  # the checkpoint names exactly what was trained; the rest is regenerated
    ahead.close()
