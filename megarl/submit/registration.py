"""Wait until every node of a launched job has joined the Ray cluster with its devices.

`ray status` exiting 0 only says the head answers; workers register seconds
later, or never (a wrong address, a port taken, a crashed raylet). This waits
until Ray lists `--nodes` alive nodes that each offer `--per-node` GPUs (CPU
slots on a CPU recipe), and on timeout names the nodes that are missing and
where their logs are. (The launch script itself stops this wait at once when a
Ray node's step exits.)

    python -m megarl.submit.registration --address 10.0.0.1:10000 --nodes 2 --device cuda \\
        --per-node 8 --hosts "gpu01 gpu02" --log-dir runs/x/logs --attempt 4711.0 --timeout 300
"""

from __future__ import annotations

import argparse
import sys
import time


def _short(host: str) -> str:
    return host.split(".")[0]


def registered_nodes(*, resource: str, per_node: int) -> tuple[list[str], list[str]]:
    """(hosts offering `per_node` of `resource`, hosts alive but offering less) as Ray lists them now."""
    import ray

    ready, short = [], []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        host = _short(node["NodeManagerHostname"])
        offered = node["Resources"].get(resource, 0)
        if offered >= per_node:
            ready.append(host)
        else:
            short.append(f"{host} ({offered:g} {resource})")
    return ready, short


def wait_for_nodes(*, address: str, nodes: int, resource: str, per_node: int, hosts: list[str], log_dir: str,
                   attempt: str, timeout_s: float, poll_s: float = 2.0) -> str | None:
    """None once `nodes` nodes offer `per_node` of `resource`; else a message saying what is missing."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:  # the head's port may answer before its GCS serves: try again until the deadline
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)
            break
        except (ConnectionError, RuntimeError) as error:
            ray.shutdown()  # whatever the failed attempt set up
            if time.monotonic() >= deadline:
                return (f"cannot join the Ray head at {address} within {timeout_s:.0f} s: {error}; "
                        f"see {log_dir}/ray-head-{hosts[0]}-{attempt}.log")
            time.sleep(poll_s)
    try:
        while True:
            ready, short = registered_nodes(resource=resource, per_node=per_node)
            if len(ready) >= nodes:
                print(f"megarl-launch: {len(ready)} node(s) registered with {per_node} {resource} each: "
                      f"{' '.join(sorted(ready))}", flush=True)
                return None
            if time.monotonic() >= deadline:
                missing = [host for host in hosts if _short(host) not in {_short(r) for r in ready}]
                logs = ", ".join(f"{log_dir}/ray-*-{host}-{attempt}.log" for host in missing)
                return (f"{len(ready)} of {nodes} node(s) registered with {per_node} {resource} each, "
                        f"not within {timeout_s:.0f} s; "
                        f"missing: {' '.join(missing) or '?'}"
                        + (f"; registered with too few: {' '.join(short)}" if short else "")
                        + f"; see {logs or log_dir}")
            time.sleep(poll_s)
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.submit.registration", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS address host:port")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--per-node", type=int, required=True, help="GPUs (cuda) or CPU slots (cpu) every node offers")
    parser.add_argument("--hosts", required=True, help="the job's node names, space separated")
    parser.add_argument("--log-dir", required=True, help="where the nodes' Ray logs go (named in the error)")
    parser.add_argument("--attempt", default="local", help="<job>.<restart>: names this start's log files")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    problem = wait_for_nodes(address=args.address, nodes=args.nodes, resource="GPU" if args.device == "cuda" else "CPU",
                             per_node=args.per_node, hosts=args.hosts.split(), log_dir=args.log_dir,
                             attempt=args.attempt, timeout_s=args.timeout)
    if problem is not None:
        print(f"megarl-launch: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
