"""megatron-core's optional logging libraries (W&B, TensorBoard), left unimported in engine ranks.

Megatron imports `wandb` and `torch.utils.tensorboard` at import time where they are installed
(`timers`, the dynamic inference context), for its own training-loop logging, which megarl never
uses: the controller logs (`megarl.tracking`). In each engine rank they cost about 1.5 CPU s
(wandb ~0.8 and two temp dirs in /tmp per process, TensorBoard ~0.7). `loggers_hidden()` makes
their import fail with ImportError while megatron is imported, the case megatron handles itself
(it sets its `wandb` and `SummaryWriter` to None), then makes them importable again for everything
else in the process.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

HIDDEN = ("wandb", "torch.utils.tensorboard")


@contextlib.contextmanager
def loggers_hidden() -> Iterator[None]:
    """While inside, importing `HIDDEN` modules raises ImportError, unless one was imported before."""
    hidden = [name for name in HIDDEN if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # the import system's own marker for "raise ImportError"
    try:
        yield
    finally:
        for name in hidden:
            if sys.modules.get(name, 0) is None:
                del sys.modules[name]
