"""Name -> function tables for the algorithm core (advantage estimators, KL kinds, loss modes).

A registry is a plain dict filled by a decorator at import time, so a recipe's
string (`algorithm.adv_estimator: grpo`) resolves to a function without any
if/elif chain, and an unknown name fails with the list of known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

FnT = TypeVar("FnT", bound=Callable)


def register(table: dict[str, Callable], *names: str) -> Callable[[FnT], FnT]:
    """Decorator that stores the function under each of `names` in `table`.

    Several names allow aliases (e.g. `kl` and `k1`); a name registered twice
    is a programming error and raises at import time, not at step 300.
    """
    if not names:
        raise ValueError("register() needs at least one name")

    def decorator(fn: FnT) -> FnT:
        for name in names:
            if name in table:
                raise ValueError(f"{name!r} is already registered to {table[name].__qualname__}")
            table[name] = fn
        return fn

    return decorator


def lookup(table: dict[str, Callable], name: str, what: str) -> Callable:
    """`table[name]`, or a ValueError naming the unknown `what` and the known names."""
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table))
        raise ValueError(f"unknown {what} {name!r}; known: {known}") from None
