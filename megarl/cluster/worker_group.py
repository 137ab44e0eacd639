"""A group of Ray actors, one per rank of a role, with data-parallel dispatch.

The controller calls one method per phase on a group. `dispatch_dp` splits a
Batch into one shard per data-parallel rank (tensor/pipeline peers of a DP rank
receive the same shard, put into the object store once), and gathers the
results of the ranks that hold the output (TP rank 0 on the last PP stage).

Calls name the method itself, `group.run(MegatronWorker.offload, weights=True)`,
never a string: a misspelt method fails where Python resolves the attribute, and
the arguments are bound to the method's signature here, before anything goes to
Ray, so a wrong keyword fails in the driver with the method's name.

A rank killed for memory (by Ray's memory monitor, or SIGKILLed: the kernel's
OOM killer) fails the call with `megarl.oom.RoleOutOfMemory`, which names the
group's role, the rank and the method: the one line the CLI prints.

Calls on one group are serialised: a call made from another thread waits until the
one in flight has returned. Most worker methods are collectives over the group's
ranks (NCCL or gloo); two calls submitted at once from two threads could reach the
ranks in different orders, each rank would enter a different collective, and both
would hang.
"""

from __future__ import annotations

import inspect
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from megarl.cluster.placement import ResourcePool
from megarl.oom import RoleOutOfMemory, memory_kill
from megarl.protocol import Batch


class WorkerGroup:
    """`pool.world_size` instances of `worker_cls`, rank r on slot r of the pool; with `log_dir`, rank r is
    created with `log_path=<log_dir>/<name>-<r>.log` (where it writes its output)."""

    def __init__(self, worker_cls: type, pool: ResourcePool, *, name: str, env: dict[str, str] | None = None,
                 log_dir: Path | None = None):
        import ray

        pool.reserve()
        self.name = name
        self.worker_cls = worker_cls
        self.world_size = pool.world_size
        remote_cls = ray.remote(worker_cls)
        self.workers = []
        for rank in range(self.world_size):
            options: dict[str, Any] = {
                **pool.actor_options(rank),
                "name": self._actor_name(rank),
                "runtime_env": {"env_vars": dict(env or {})},
            }
            log = {"log_path": str(Path(log_dir) / f"{name}-{rank}.log")} if log_dir is not None else {}
            self.workers.append(remote_cls.options(**options).remote(rank=rank, world_size=self.world_size, **log))
        self._layout: list[dict] | None = None
        self._calls = threading.RLock()  # held from a call's submission to its last result (module docstring)

    def _method_name(self, method: Callable, args: tuple, kwargs: dict) -> str:
        """The name of `method`, once it is known to be a method of the worker class that takes these arguments."""
        name = getattr(method, "__name__", None)
        if not isinstance(name, str) or getattr(self.worker_cls, name, None) is not method:
            raise TypeError(f"worker group {self.name!r}: call a method of {self.worker_cls.__name__} by itself "
                            f"(e.g. {self.worker_cls.__name__}.{name or 'method'}), got {method!r}")
        try:
            inspect.signature(method).bind(None, *args, **kwargs)  # None: the worker's `self`
        except TypeError as error:
            raise TypeError(f"{self.worker_cls.__name__}.{name}: {error}") from None
        return name

    def run(self, method: Callable, *args, **kwargs) -> list:
        """Call `method` (a method of the worker class) on every rank with the same arguments; results in rank order."""
        name = self._method_name(method, args, kwargs)
        with self._calls:
            return self._results(name, [getattr(worker, name).remote(*args, **kwargs) for worker in self.workers])

    def run_rank(self, rank: int, method: Callable, *args, **kwargs):
        name = self._method_name(method, args, kwargs)
        with self._calls:
            return self._results(name, [getattr(self.workers[rank], name).remote(*args, **kwargs)], ranks=[rank])[0]

    def _results(self, name: str, futures: list, ranks: list[int] | None = None) -> list:
        """`ray.get(futures)` (rank `ranks[i]`'s call is `futures[i]`; all ranks in order by default); a rank
        killed for memory raises `RoleOutOfMemory` instead of Ray's error."""
        import ray

        try:
            return ray.get(futures)
        except ray.exceptions.RayError as error:
            if memory_kill(error) is None:
                raise
            method = f"{self.worker_cls.__name__}.{name}"
            rank, own_error = self._killed_rank(futures, ranks if ranks is not None else list(range(len(futures))))
            # Ray names an actor's task "<actor name>:<class>.__init__" (newer) or by the method (older).
            names = ((f"{self._actor_name(rank)}:",) if rank is not None else ()) + (method,)
            kill = memory_kill(own_error or error, names=names)
            raise RoleOutOfMemory(kill, role=self.name, rank=rank, method=method) from error

    @staticmethod
    def _killed_rank(futures: list, ranks: list[int]) -> tuple[int | None, BaseException | None]:
        """The first rank whose own result is a memory kill, and that error: ray.get raised the first failure it
        saw, whichever rank it was."""
        import ray

        for rank, future in zip(ranks, futures):
            try:
                ray.get(future, timeout=0)
            except ray.exceptions.GetTimeoutError:
                continue  # still running (a collective waiting for the dead rank)
            except ray.exceptions.RayError as error:
                if memory_kill(error) is not None:
                    return rank, error
        return None, None

    def _actor_name(self, rank: int) -> str:
        return f"megarl-{self.name}-{rank}"

    def layout(self) -> list[dict]:
        """Per rank: `dp_rank`, `dp_size`, `is_output` (known after the engine is initialised)."""
        if self._layout is None:
            self._layout = self.run(self.worker_cls.parallel_layout)
        return self._layout

    @property
    def dp_size(self) -> int:
        return self.layout()[0]["dp_size"]

    def dispatch_dp(self, method: Callable, batch: Batch, **kwargs) -> list:
        """Run `method(shard, **kwargs)` with shard = this rank's DP chunk; return the output ranks' results in DP order."""
        import ray

        name = self._method_name(method, (batch,), kwargs)
        with self._calls:
            layout = self.layout()
            shards = [ray.put(shard) for shard in batch.chunk(self.dp_size)]
            futures = [
                getattr(worker, name).remote(shards[info["dp_rank"]], **kwargs)
                for worker, info in zip(self.workers, layout)
            ]
            results = self._results(name, futures)
        by_dp = {info["dp_rank"]: result for info, result in zip(layout, results) if info["is_output"]}
        return [by_dp[dp_rank] for dp_rank in range(self.dp_size)]

    def kill(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []


def mean_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Average each metric over the DP ranks that reported it."""
    keys = {key for metrics in per_rank for key in metrics}
    return {
        key: sum(metrics[key] for metrics in per_rank if key in metrics)
        / sum(1 for metrics in per_rank if key in metrics)
        for key in sorted(keys)
    }
