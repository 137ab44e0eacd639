"""torch.compile wrappers that megatron-core builds at import time, built at their first call instead.

Megatron decorates its fused kernels (`megatron.core.jit.jit_fuser`, i.e. `torch.compile`) when its modules
are imported. Building a `torch.compile` wrapper imports torch._dynamo and torch._inductor: about 3 CPU s
of every engine rank's start (8 -> 5 s for what a rank imports, measured on the 2-core CPU machine), for
kernels megarl never calls (every fusion is off in `gpt.py`). `deferred_compile()` swaps in a decorator
that makes the real `torch.compile` wrapper at the function's first call and uses it from then on (what
torch.compile does itself: it compiles at the first call), so nothing changes but when dynamo is imported.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch


def _compile_at_first_call(real_compile: Callable) -> Callable:
    def compile_later(model=None, **options):
        if model is None:  # used as @torch.compile(**options)
            return lambda function: compile_later(function, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


@contextlib.contextmanager
def deferred_compile() -> Iterator[None]:
    """While inside, `torch.compile(fn, ...)` returns a function that compiles `fn` at its first call."""
    real_compile = torch.compile
    torch.compile = _compile_at_first_call(real_compile)
    try:
        yield
    finally:
        torch.compile = real_compile
