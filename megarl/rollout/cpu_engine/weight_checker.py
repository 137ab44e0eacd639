"""`/weights_checker`: SGLang's weight checker (`srt/utils/weight_checker.py`) over the CPU engine's model.

Actions, as SGLang's `WeightChecker.handle` names them:
- `checksum`: every checked tensor's checksum (`weight_wire.tensor_checksum`), the rank's checksum over
  them, and the engine's checksum over its ranks' (one rank here), in the reply's `ranks` and
  `per_engine_checksum`;
- `snapshot`: keep a copy of every checked tensor; `compare`: fail naming each tensor that differs from
  the snapshot; `reset_tensors`: overwrite every checked tensor with random values (a test of updates).
The CPU engine holds HF tensor names (SGLang holds its fused, TP-sharded ones) and hashes on the CPU, so
its checksums compare with a CPU holder's of the same names, as a GPU server's compare with another's.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from megarl.rollout.cpu_engine.weights import checked_tensors
from megarl.rollout.weight_wire import engine_checksum, rank_checksum, tensor_checksum

ACTIONS = ("checksum", "snapshot", "compare", "reset_tensors")
MAX_NAMED = 8  # differing tensors named in a failed compare
# One rank: the CPU engine is a single process (TP, DP and PP all of size 1).
PARALLELISM = {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
               "rank": 0, "size": 1}


class WeightChecker:
    """The checker's state (its snapshot) for one model; callers hold the model still."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self._held: dict[str, torch.Tensor] | None = None  # the snapshot

    def handle(self, action: str, skip_tensor_list: list[str] | None = None) -> tuple[bool, str, dict]:
        """(success, message, extra reply fields) of `action`; names containing a `skip_tensor_list` entry are
        left out of checksum, compare and reset, as SGLang leaves them out."""
        if action not in ACTIONS:
            return False, f"Unsupported action={action!r} (one of {list(ACTIONS)})", {}
        with torch.no_grad():
            return getattr(self, f"_{action}")(skip_tensor_list)

    def _checksum(self, skip: list[str] | None) -> tuple[bool, str, dict]:
        checksums = {name: tensor_checksum(tensor) for name, tensor in checked_tensors(self.model, skip).items()}
        rank = {"checksums": checksums, "per_gpu_checksum": rank_checksum(checksums),
                "parallelism_info": dict(PARALLELISM)}
        return True, "Success", {"ranks": [rank], "per_engine_checksum": engine_checksum([rank["per_gpu_checksum"]])}

    def _snapshot(self, skip: list[str] | None) -> tuple[bool, str, dict]:
        del skip  # SGLang's snapshot holds every tensor; compare leaves out what its request skips
        self._held = {name: tensor.detach().clone() for name, tensor in checked_tensors(self.model).items()}
        return True, "Success", {}

    def _compare(self, skip: list[str] | None) -> tuple[bool, str, dict]:
        if self._held is None:
            return False, "compare needs a snapshot first (action 'snapshot')", {}
        current = checked_tensors(self.model, skip)
        differing = [name for name, held in self._held.items() if not any(part in name for part in skip or ())
                     and (name not in current or not torch.equal(held, current[name]))]
        if differing:
            named = ", ".join(differing[:MAX_NAMED]) + (f" and {len(differing) - MAX_NAMED} more"
                                                         if len(differing) > MAX_NAMED else "")
            return False, f"check tensor equality failed: {named}", {}
        return True, "Success", {}

    def _reset_tensors(self, skip: list[str] | None) -> tuple[bool, str, dict]:
        for tensor in checked_tensors(self.model, skip).values():
            if tensor.is_floating_point():
                tensor.copy_(torch.rand(tensor.shape, dtype=torch.float32).to(tensor.dtype))
        return True, "Success", {}
