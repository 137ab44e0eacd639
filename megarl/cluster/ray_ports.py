"""The ports a launched job's Ray cluster uses: one block per job, so two jobs on one node never share a port.

Ray's defaults are fixed ports (6379, 10001, 52365, ...): a second Ray on the
same node clashes with the first. A job instead takes a block of BLOCK_SIZE
ports chosen by a seed (the Slurm job id, or the launcher's PID), names every
port Ray opens from it, and preflight checks the block is free on every node.

    eval "$(python -m megarl.cluster.ray_ports --seed $SLURM_JOB_ID)"   # MEGARL_RAY_*_PORT
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from megarl.ports import port_is_free

FIRST_PORT = 10000
# Every Ray worker process (a task worker, an actor, a driver) binds one port of the worker range, and
# Ray keeps up to one idle task worker per CPU: a 128-CPU node needs about 128 + its actors (~40 for 8
# GPUs with colocated roles and servers). NeMo-RL's ray.sub gives 128-CPU nodes 513 worker ports; 512
# here leave three times the need, rather than capping Ray's workers (which stalls task-heavy rewards).
WORKER_PORTS = 512
WORKER_OFFSET = 18
BLOCK_SIZE = WORKER_OFFSET + WORKER_PORTS
# Blocks end below 32768, where Linux draws the ephemeral ports of outgoing connections.
NUM_BLOCKS = (32768 - FIRST_PORT) // BLOCK_SIZE
NAMED_PORTS = (
    "gcs",
    "node_manager",
    "object_manager",
    "client_server",
    "dashboard_agent_grpc",
    "dashboard_agent_listen",
    "metrics_export",
    "runtime_env_agent",
)
BASE_OVERRIDE_ENV = "MEGARL_RAY_PORT_BASE"


@dataclass(frozen=True)
class RayPorts:
    """The block [base, base + BLOCK_SIZE): named ports first, then the range Ray's worker processes bind."""

    base: int

    def named(self) -> dict[str, int]:
        return {name: self.base + offset for offset, name in enumerate(NAMED_PORTS)}

    @property
    def worker_range(self) -> tuple[int, int]:
        return self.base + WORKER_OFFSET, self.base + BLOCK_SIZE - 1

    def every_port(self) -> list[tuple[str, int]]:
        """(what, port) for every port of the block Ray may bind, for the free-port check."""
        low, high = self.worker_range
        return [*self.named().items(), *(("worker", port) for port in range(low, high + 1))]

    def shell_exports(self) -> str:
        """`export MEGARL_RAY_<NAME>_PORT=...` lines the launch scripts eval."""
        low, high = self.worker_range
        lines = [f"export MEGARL_RAY_PORT_BASE={self.base}"]
        lines += [f"export MEGARL_RAY_{name.upper()}_PORT={port}" for name, port in self.named().items()]
        lines += [f"export MEGARL_RAY_MIN_WORKER_PORT={low}", f"export MEGARL_RAY_MAX_WORKER_PORT={high}"]
        return "\n".join(lines) + "\n"


def block_for(seed: int) -> RayPorts:
    """The block of a job: from its seed, unless MEGARL_RAY_PORT_BASE pins it (e.g. via `megarl submit --env`)."""
    pinned = os.environ.get(BASE_OVERRIDE_ENV)
    if pinned:
        return RayPorts(int(pinned))
    return RayPorts(FIRST_PORT + (seed % NUM_BLOCKS) * BLOCK_SIZE)


def busy_ports(ports: RayPorts, host: str = "") -> list[tuple[str, int]]:
    """The ports of the block that cannot be bound on `host` ("" = every interface) right now."""
    return [(name, port) for name, port in ports.every_port() if not port_is_free(host, port)]


def free_block(seed: int, host: str = "") -> RayPorts:
    """The first block, starting at the seed's, whose every port is free here (single-machine launches)."""
    first = block_for(seed)
    if os.environ.get(BASE_OVERRIDE_ENV):
        return first
    for step in range(NUM_BLOCKS):
        candidate = block_for(seed + step)
        if not busy_ports(candidate, host):
            return candidate
    last = FIRST_PORT + NUM_BLOCKS * BLOCK_SIZE
    raise RuntimeError(f"no block of {BLOCK_SIZE} free ports between {FIRST_PORT} and {last}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.cluster.ray_ports", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, required=True, help="the Slurm job id, or the launcher's PID")
    parser.add_argument("--free", action="store_true", help="from the seed's block on, the first one free here")
    args = parser.parse_args(argv)
    sys.stdout.write((free_block(args.seed) if args.free else block_for(args.seed)).shell_exports())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
