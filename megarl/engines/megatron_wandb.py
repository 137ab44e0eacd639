"""megatron-core's optional W&B logging, left unimported in engine ranks.

Megatron imports `wandb` at import time where it is installed (`timers`, the dynamic inference
context), for its own training-loop logging, which megarl never uses: the controller logs to W&B
(`megarl.tracking.wandb_sink`). The import costs each rank about 1 CPU s and leaves two temp dirs
in /tmp per process. `wandb_hidden()` makes `import wandb` fail with ImportError while megatron is
imported, the case megatron handles itself (it sets its `wandb` to None), then makes wandb
importable again for everything else in the process.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


@contextlib.contextmanager
def wandb_hidden() -> Iterator[None]:
    """While inside, `import wandb` raises ImportError, unless wandb was imported before."""
    if "wandb" in sys.modules:
        yield
        return
    sys.modules["wandb"] = None  # the import system's own marker for "raise ImportError"
    try:
        yield
    finally:
        if sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]
