"""Weight sync: trainer weights (HF names and layout) -> the rollout fleet, with a version.

v1 (the spine): the actor gathers its shards into full HF-named tensors and the
colocated `tensor` transport hands them to every server through
`/update_weights_from_tensor`, wrapped in begin/end so generation pauses.
"""

from megarl.weightsync.tensor_transport import SyncStats, sync_from_tensor

__all__ = ["SyncStats", "sync_from_tensor"]
