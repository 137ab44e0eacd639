"""The data protocol between controller and workers: `Batch` and token balancing.

`Batch` (tensors + non-tensor object arrays + meta) is the object every phase
of the RL step reads and extends; `balanced_permutation` reorders samples so
that data-parallel ranks receive near-equal token counts.
"""

from megarl.protocol.balance import balanced_permutation
from megarl.protocol.batch import Batch

__all__ = ["Batch", "balanced_permutation"]
