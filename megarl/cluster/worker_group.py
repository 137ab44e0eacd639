"""A group of Ray actors, one per rank of a role, with data-parallel dispatch.

The controller calls one method per phase on a group. `dispatch_dp` splits a
Batch into one shard per data-parallel rank (tensor/pipeline peers of a DP rank
receive the same shard, put into the object store once), and gathers the
results of the ranks that hold the output (TP rank 0 on the last PP stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from megarl.cluster.placement import ResourcePool
from megarl.protocol import Batch


class WorkerGroup:
    """`pool.world_size` instances of `worker_cls`, rank r on slot r of the pool; with `log_dir`, rank r is
    created with `log_path=<log_dir>/<name>-<r>.log` (where it writes its output)."""

    def __init__(self, worker_cls: type, pool: ResourcePool, *, name: str, env: dict[str, str] | None = None,
                 log_dir: Path | None = None):
        import ray

        pool.reserve()
        self.name = name
        self.world_size = pool.world_size
        remote_cls = ray.remote(worker_cls)
        self.workers = []
        for rank in range(self.world_size):
            options: dict[str, Any] = {
                **pool.actor_options(rank),
                "name": f"megarl-{name}-{rank}",
                "runtime_env": {"env_vars": dict(env or {})},
            }
            log = {"log_path": str(Path(log_dir) / f"{name}-{rank}.log")} if log_dir is not None else {}
            self.workers.append(remote_cls.options(**options).remote(rank=rank, world_size=self.world_size, **log))
        self._layout: list[dict] | None = None

    def run(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank with the same arguments; results in rank order."""
        import ray

        return ray.get([getattr(worker, method).remote(*args, **kwargs) for worker in self.workers])

    def run_rank(self, rank: int, method: str, *args, **kwargs):
        import ray

        return ray.get(getattr(self.workers[rank], method).remote(*args, **kwargs))

    def layout(self) -> list[dict]:
        """Per rank: `dp_rank`, `dp_size`, `is_output` (known after the engine is initialised)."""
        if self._layout is None:
            self._layout = self.run("parallel_layout")
        return self._layout

    @property
    def dp_size(self) -> int:
        return self.layout()[0]["dp_size"]

    def dispatch_dp(self, method: str, batch: Batch, **kwargs) -> list:
        """Run `method(shard, **kwargs)` with shard = this rank's DP chunk; return the output ranks' results in DP order."""
        import ray

        layout = self.layout()
        shards = [ray.put(shard) for shard in batch.chunk(self.dp_size)]
        futures = [
            getattr(worker, method).remote(shards[info["dp_rank"]], **kwargs)
            for worker, info in zip(self.workers, layout)
        ]
        results = ray.get(futures)
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
