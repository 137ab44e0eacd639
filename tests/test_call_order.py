"""Two orderings the fleet's fault handling relies on, checked without Ray or servers.

- A worker group serialises its calls: a call from a second thread (as a fleet thread
  re-syncing a restarted server once did) is not submitted to any rank until the call
  in flight has returned, so every rank sees the group's calls in one order. The group's
  workers and `ray.get` are recording stand-ins; the first call is held inside
  `ray.get` until the second thread has had every chance to submit.
- The memory gate: a restart does not begin while the fleet's memory is released (a
  colocated trainer holds the devices), and a release waits for the restarts in progress.
"""

from __future__ import annotations

import threading
import time

import pytest

from megarl.cluster.worker_group import WorkerGroup
from megarl.rollout.memory_gate import MemoryGate


class _Worker:
    """The worker class: its methods only give the group names and signatures to check calls against."""

    def collective_a(self) -> None: ...

    def collective_b(self) -> None: ...


class _Handle:
    """One rank's actor handle: `.<method>.remote()` records the submission."""

    def __init__(self, rank: int, log: list):
        self.rank, self.log = rank, log

    def __getattr__(self, name: str):
        handle = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                handle.log.append(("submit", name, handle.rank))
                return name

        return _Method


class _Pool:
    world_size = 2

    def reserve(self) -> None:
        pass

    def actor_options(self, rank: int) -> dict:
        return {}


def _group(log: list, monkeypatch) -> WorkerGroup:
    """A two-rank group built by `WorkerGroup` itself, its Ray actors replaced by recording handles."""
    import ray

    class _Remote:
        def options(self, **options):
            return self

        def remote(self, *, rank: int, world_size: int):
            return _Handle(rank, log)

    monkeypatch.setattr(ray, "remote", lambda worker_cls: _Remote())
    return WorkerGroup(_Worker, _Pool(), name="actor")


def test_a_call_from_another_thread_waits_for_the_call_in_flight(monkeypatch):
    import ray

    log: list = []
    in_first_get, second_started = threading.Event(), threading.Event()

    def get(refs):
        if refs[0] == "collective_a":
            in_first_get.set()
            second_started.wait(5)
            time.sleep(0.2)  # room for the other thread to submit, were it not held back
        log.append(("returned", refs[0]))
        return [None] * len(refs)

    monkeypatch.setattr(ray, "get", get)
    group = _group(log, monkeypatch)
    first = threading.Thread(target=group.run, args=(_Worker.collective_a,))
    first.start()
    assert in_first_get.wait(5)
    second = threading.Thread(target=lambda: (second_started.set(), group.run(_Worker.collective_b)))
    second.start()
    first.join(5)
    second.join(5)
    assert log == [("submit", "collective_a", 0), ("submit", "collective_a", 1), ("returned", "collective_a"),
                   ("submit", "collective_b", 0), ("submit", "collective_b", 1), ("returned", "collective_b")]


def test_a_restart_waits_for_the_fleets_memory_and_a_release_for_the_restart():
    gate, events = MemoryGate(), []
    gate.release(["kv_cache", "weights"], timeout_s=1)
    restart = threading.Thread(target=lambda: (gate.begin_start(timeout_s=5, stop=lambda: False),
                                               events.append("restart begins")))
    restart.start()
    time.sleep(0.2)
    gate.resume(["weights"])
    time.sleep(0.2)
    assert events == []  # the KV cache is still released: the trainer holds the devices
    events.append("fleet resumes")
    gate.resume(["kv_cache"])
    restart.join(5)
    assert events == ["fleet resumes", "restart begins"]

    # A release waits for the start in progress to end (the new server must let go of its memory too).
    release = threading.Thread(target=lambda: (gate.release(None, timeout_s=5), events.append("released")))
    release.start()
    time.sleep(0.2)
    assert events[-1] == "restart begins"
    events.append("restart ends")
    gate.end_start()
    release.join(5)
    assert events[-2:] == ["restart ends", "released"] and gate.released == {"weights", "kv_cache", "cuda_graph"}


def test_a_waiting_restart_gives_up_when_the_fleet_shuts_down_and_waits_are_bounded():
    gate, stopping = MemoryGate(), threading.Event()
    gate.release(None, timeout_s=1)
    errors = []

    def restart():
        try:
            gate.begin_start(timeout_s=None, stop=stopping.is_set)
        except RuntimeError as error:
            errors.append(str(error))

    waiter = threading.Thread(target=restart)
    waiter.start()
    stopping.set()
    gate.wake()
    waiter.join(5)
    assert errors == ["the fleet is shutting down"]
    with pytest.raises(TimeoutError, match="stayed released"):
        gate.begin_start(timeout_s=0.1, stop=lambda: False)
    gate.resume(None)
    gate.begin_start(timeout_s=0.1, stop=lambda: False)
    with pytest.raises(TimeoutError, match="did not come up within"):
        gate.release(["kv_cache"], timeout_s=0.1)
