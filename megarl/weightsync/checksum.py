"""`weight_sync.verify: checksum`: after a sync, SGLang's weight checker on every server, against the trainer.

The senders checksum every HF tensor as they send it (`weight_wire.held_checksum`: the value widened to
float32, as the CPU engine holds it). After the sync rank 0 asks every server for its checksums (`POST
/weights_checker {"action": "checksum"}`, SGLang's route) and raises `WeightSyncError` when
- a server cannot answer, or servers of the same TP size disagree on `per_engine_checksum` (replicas of
  one model hold different weights); or
- a server that names every tensor the trainer sent (the CPU engine holds HF names, hashed on the CPU)
  holds any of them with another checksum, naming each.
SGLang on GPUs names its fused, TP-sharded tensors and hashes with a kernel of its own, so there only the
agreement of the replicas is checked.
"""

from __future__ import annotations

from megarl.rollout.client import RolloutClient
from megarl.weightsync.session import WeightSyncError, call_servers, server_tp_sizes

__all__ = ["verify_server_checksums"]

MAX_NAMED = 8
CHECK = {"action": "checksum"}


def verify_server_checksums(client: RolloutClient, expected: dict[str, str]) -> None:
    """Raise WeightSyncError unless the servers agree with each other and, where comparable, with `expected`."""
    replies = call_servers(client, "POST", "/weights_checker", CHECK, phase="verify checksums")
    tp_sizes = server_tp_sizes(client, phase="verify checksums")
    problems: list[str] = []
    by_layout: dict[int, dict[str, list[str]]] = {}
    for url, tp_size, reply in zip(client.urls, tp_sizes, replies):
        engine = reply.get("per_engine_checksum") if isinstance(reply, dict) else None
        ranks = reply.get("ranks") if isinstance(reply, dict) else None
        if not isinstance(engine, str) or not isinstance(ranks, list):
            problems.append(f"{url}: /weights_checker gave no per_engine_checksum and ranks")
            continue
        by_layout.setdefault(tp_size, {}).setdefault(engine, []).append(url)
        held: dict[str, str] = {}
        for rank in ranks:
            held.update(rank.get("checksums", {}) if isinstance(rank, dict) else {})
        if expected and expected.keys() <= held.keys():
            problems += _differing(url, expected, held)
    for tp_size, groups in by_layout.items():
        if len(groups) > 1:
            split = "; ".join(f"{', '.join(urls)}: {checksum[:16]}" for checksum, urls in groups.items())
            problems.append(f"servers of TP size {tp_size} hold different weights (per_engine_checksum {split})")
    if problems:
        raise WeightSyncError("weight sync verification failed: " + "; ".join(problems))


def _differing(url: str, expected: dict[str, str], held: dict[str, str]) -> list[str]:
    wrong = [name for name, checksum in expected.items() if held[name] != checksum]
    lines = [f"{url}: {name}: server {held[name]} != trainer {expected[name]}" for name in wrong[:MAX_NAMED]]
    if len(wrong) > MAX_NAMED:
        lines.append(f"{url}: ... {len(wrong) - MAX_NAMED} more of {len(expected)} tensors differ")
    return lines
