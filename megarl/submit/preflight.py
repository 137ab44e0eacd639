"""Preflight inside a launched job, on every node, before Ray and training start.

`facts` runs once per node (one srun task each) and prints one JSON line: the
node's name, the devices it sees, which of the job's Ray ports are taken, and
the versions of the packages that must agree across nodes. `check` reads all
lines and prints one problem per node and difference. `node-ip` prints the
address this node advertises (run on the head node for the head's address).
`reach` runs on every node once the head is up and checks the head's port
answers from there.

    python -m megarl.submit.preflight facts --device cuda --port-seed $SLURM_JOB_ID
    python -m megarl.submit.preflight check --nodes "a b" --device cuda --gpus-per-node 8 < facts.jsonl
    python -m megarl.submit.preflight reach --address 10.0.0.1:10000 --timeout 120
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from importlib import metadata
from pathlib import Path

from megarl.net import IFACE_ENV, node_address, split_host_port
from megarl.cluster.ray_ports import block_for, busy_ports

# Mismatched builds of these across nodes fail late and obscurely (pickled tensors, NCCL, Ray protocol).
VERSIONED_PACKAGES = ("torch", "megatron-core", "sglang", "ray", "megarl")
NOT_INSTALLED = "not installed"


def node_name() -> str:
    """Slurm's name for this node when inside a job, else the short host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def megarl_source_digest() -> str:
    """A digest of the megarl sources this interpreter imports: equal versions can still be different checkouts."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def package_versions() -> dict[str, str]:
    versions = {}
    for package in VERSIONED_PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = NOT_INSTALLED
    versions["megarl"] = f"{versions['megarl']} (sources {megarl_source_digest()})"
    return versions


def visible_gpus() -> int | str:
    """CUDA devices torch sees here, or the reason it cannot tell."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception as error:  # a broken CUDA install is exactly what preflight must report
        return f"torch cannot count GPUs: {error}"


def node_facts(*, device: str, port_seed: int) -> dict:
    return {
        "node": node_name(),
        "gpus": visible_gpus() if device == "cuda" else None,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "busy_ports": busy_ports(block_for(port_seed)),
        "versions": package_versions(),
    }


def check_facts(facts: list[dict], *, nodes: list[str], device: str, gpus_per_node: int) -> list[str]:
    """One line per problem, each naming the node; the first node (the head) is the version reference."""
    by_node = {fact["node"]: fact for fact in facts}
    problems = [f"node {node}: preflight reported nothing (see its lines in the job log)" for node in nodes
                if node not in by_node]
    for node in nodes:
        fact = by_node.get(node)
        if fact is None:
            continue
        gpus = fact["gpus"]
        if device == "cuda" and (not isinstance(gpus, int) or gpus < gpus_per_node):
            problems.append(
                f"node {node}: {gpus} GPU(s) visible (CUDA_VISIBLE_DEVICES={fact['cuda_visible_devices']}), "
                f"expected {gpus_per_node}"
            )
        busy = fact["busy_ports"]
        if busy:
            shown = ", ".join(f"{port} ({what})" for what, port in busy[:4]) + (", ..." if len(busy) > 4 else "")
            problems.append(
                f"node {node}: {len(busy)} port(s) of this job's Ray port block are in use: {shown} "
                "(another Ray on the node? pin another block with --env MEGARL_RAY_PORT_BASE=...)"
            )
    reference = next((by_node[node] for node in nodes if node in by_node), None)
    for node in nodes:
        if reference is None or node not in by_node or by_node[node] is reference:
            continue
        for package, version in by_node[node]["versions"].items():
            expected = reference["versions"].get(package, NOT_INSTALLED)
            if version != expected:
                problems.append(f"node {node}: {package} {version} differs from {reference['node']}'s {expected}")
    return problems


def reach(address: str, *, timeout_s: float) -> str | None:
    """None once a TCP connection to `address` succeeds; the last error when `timeout_s` passes first."""
    host, port = split_host_port(address)
    deadline, error = time.monotonic() + timeout_s, "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=5):
                return None
        except OSError as failure:
            error = str(failure)
            time.sleep(1)
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.submit.preflight", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    facts = verbs.add_parser("facts", help="print this node's facts as one JSON line")
    facts.add_argument("--device", choices=["cuda", "cpu"], required=True)
    facts.add_argument("--port-seed", type=int, required=True)
    check = verbs.add_parser("check", help="read every node's facts on stdin, print the problems")
    check.add_argument("--nodes", required=True, help="the job's node names, head first, space separated")
    check.add_argument("--device", choices=["cuda", "cpu"], required=True)
    check.add_argument("--gpus-per-node", type=int, required=True)
    verbs.add_parser("node-ip", help=f"print the address this node's Ray advertises (${IFACE_ENV}, else Ray's pick)")
    head = verbs.add_parser("reach", help="wait until the Ray head's port answers from this node")
    head.add_argument("--address", required=True)
    head.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args(argv)

    if args.verb == "facts":
        print(json.dumps(node_facts(device=args.device, port_seed=args.port_seed)), flush=True)
        return 0
    if args.verb == "check":
        facts = [json.loads(line) for line in sys.stdin if line.startswith("{")]
        problems = check_facts(facts, nodes=args.nodes.split(), device=args.device, gpus_per_node=args.gpus_per_node)
        for problem in problems:
            print(f"preflight: {problem}", file=sys.stderr)
        if not problems:
            print(f"preflight: {len(facts)} node(s) agree: {json.dumps(facts[0]['versions'])}")
        return 1 if problems else 0
    if args.verb == "node-ip":
        try:
            print(node_address())
        except OSError as error:
            print(f"preflight: node {node_name()}: {IFACE_ENV}={os.environ.get(IFACE_ENV)}: {error}", file=sys.stderr)
            return 1
        return 0
    error = reach(args.address, timeout_s=args.timeout)
    if error is not None:
        print(f"preflight: node {node_name()}: cannot reach the Ray head at {args.address} "
              f"within {args.timeout:.0f} s: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
