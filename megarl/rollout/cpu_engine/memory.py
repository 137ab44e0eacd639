"""`/release_memory_occupation` and `/resume_memory_occupation`: really dropping and restoring weights and KV cache.

SGLang (with `--enable-memory-saver`) unmaps the GPU memory of the tagged regions
so a colocated trainer can use it, and maps it back on resume. Here:
- `weights`: every parameter's storage is replaced by an empty one (the memory is
  freed; shapes and dtypes are kept). On resume the parameters get fresh storage:
  a copy of the released values with `--enable-weights-cpu-backup`, otherwise NaN,
  because SGLang without that flag gives back memory whose contents are undefined
  (a trainer must push weights after resuming them). Buffers (rotary tables) are
  kept, as SGLang keeps the model's static state.
- `kv_cache`: this engine keeps no KV pool between batches (SGLang's pool is what
  the tag frees); releasing it makes the engine refuse generation until resumed.
- `cuda_graph`: accepted; there are no graphs on CPU.
Generating while any tag is released is an error (see `generate_routes`); while
`weights` is, the engine also refuses to load or read weights (a trainer resumes `weights`, pushes, then resumes `kv_cache`).
Weights resumed undefined (NaN) stay refused for generation until updates have
given every one of them a finite value: their log-probs would be NaN otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

TAGS = ("weights", "kv_cache", "cuda_graph")


@dataclass
class _Dropped:
    param: torch.nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    backup: torch.Tensor | None


class MemorySaver:
    """Which tags are released, and the model's weights while they are."""

    def __init__(self, model: PreTrainedModel, *, cpu_backup: bool):
        self.model = model
        self.cpu_backup = cpu_backup
        self.released: set[str] = set()
        self._dropped: list[_Dropped] = []
        self._undefined: list[torch.nn.Parameter] = []  # resumed without a backup, not yet written

    @staticmethod
    def tags_of(tags: list[str] | None) -> list[str]:
        """The tags a request names (all of them when it names none); ValueError for an unknown tag."""
        if not tags:
            return list(TAGS)
        unknown = [tag for tag in tags if tag not in TAGS]
        if unknown:
            raise ValueError(f"tags: {unknown} are not among {list(TAGS)}")
        return list(dict.fromkeys(tags))

    def release(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" not in self.released:
            with torch.no_grad():
                for param in self.model.parameters():  # tied parameters appear once
                    held = param.data
                    self._dropped.append(_Dropped(param, held.shape, held.dtype, held if self.cpu_backup else None))
                    param.data = torch.empty(0, dtype=held.dtype)
        self.released.update(tags)

    def resume(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.released:
            with torch.no_grad():
                for dropped in self._dropped:
                    if dropped.backup is not None:
                        dropped.param.data = dropped.backup
                    else:
                        dropped.param.data = torch.full(dropped.shape, float("nan"), dtype=dropped.dtype)
                        self._undefined.append(dropped.param)
            self._dropped = []
        self.released.difference_update(tags)

    def updated(self) -> None:
        """After a weight update: forget the undefined parameters it gave finite values."""
        with torch.no_grad():
            self._undefined = [param for param in self._undefined if not torch.isfinite(param).all()]

    def generation_refusal(self) -> str | None:
        """Why the engine refuses to generate on resumed memory (weights still undefined); None when it can.
        Generating while memory is released is the HTTP layer's (louder) error."""
        if self._undefined:
            return (f"cannot generate: {len(self._undefined)} weight tensors are undefined since "
                    f"/resume_memory_occupation without --enable-weights-cpu-backup; push weights first")
        return None

    def refusal(self, action: str, *, needs: tuple[str, ...] = TAGS) -> str | None:
        """Why `action`, which needs the memory of `needs`, cannot run now; None when it can."""
        blocking = sorted(self.released.intersection(needs))
        if not blocking:
            return None
        return f"cannot {action}: memory is released (tags {blocking}); call /resume_memory_occupation first"
