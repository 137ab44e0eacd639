"""`weight_sync.verify: checksum`: per-tensor digests on the trainer compared with what each server holds.

The senders digest every HF tensor as they send it; after the sync rank 0 asks
every server for its digests (`GET /weights_checksum`, megarl's CPU-engine
extension: real SGLang has no such endpoint, check `rollout/logprob_diff` there)
and raises `WeightSyncError` naming each tensor that differs or is missing, so
training never continues on silently wrong weights.
"""

from __future__ import annotations

from megarl.rollout.client import RolloutClient
from megarl.rollout.weight_wire import DIGEST_ALGORITHM, tensor_digest
from megarl.weightsync.session import WeightSyncError, call_servers

__all__ = ["tensor_digest", "verify_server_checksums"]

MAX_NAMED = 8


def verify_server_checksums(client: RolloutClient, expected: dict[str, str]) -> None:
    """Raise WeightSyncError unless every server holds every tensor of `expected` with that digest."""
    replies = call_servers(client, "GET", "/weights_checksum", phase="verify checksums")
    problems = []
    for url, reply in zip(client.urls, replies):
        if not isinstance(reply, dict) or reply.get("algorithm") != DIGEST_ALGORITHM:
            algorithm = reply.get("algorithm") if isinstance(reply, dict) else None
            problems.append(f"{url}: no comparable checksums (algorithm {algorithm!r}, expected {DIGEST_ALGORITHM!r})")
            continue
        held = reply.get("checksums", {})
        wrong = [name for name, digest in expected.items() if held.get(name) != digest]
        for name in wrong[:MAX_NAMED]:
            state = "missing on the server" if name not in held else f"server {held[name]} != trainer {expected[name]}"
            problems.append(f"{url}: {name}: {state}")
        if len(wrong) > MAX_NAMED:
            problems.append(f"{url}: ... {len(wrong) - MAX_NAMED} more of {len(expected)} tensors differ")
    if problems:
        raise WeightSyncError("weight sync verification failed: " + "; ".join(problems))
