"""`reward.combine`: the outcome reward of each row from its rule score and its model-side score (`rm_scores`).

Each mode is a pure function over per-row scores (`rule` [B], `rm` [B], float) and
the options it declares as keyword-only parameters, registered in
`megarl.registry.REWARD_COMBINE_MODES`. Whether a mode reads the rule side or the
model side comes from its parameter names (`rule`, `rm`), so the recipe checks know
which sources a mode needs. Formulas:

    rule        r = rule
    rm          r = rm
    sum         r = rule_weight * rule + rm_weight * rm
    rule_gated  r = rm where rule >= pass_threshold, else fail_score
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from megarl.registry import REWARD_COMBINE_MODES

Tensor = torch.Tensor
SOURCES = ("rule", "rm")


def combine_mode(name: str) -> Callable[[Callable], Callable]:
    """Register a mode; positional parameters must be score sources (`rule`, `rm`), options keyword-only."""

    def decorator(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        positional = [p for p, spec in params.items() if spec.kind is not inspect.Parameter.KEYWORD_ONLY]
        unknown = [p for p in positional if p not in SOURCES]
        if unknown:
            raise TypeError(f"combine mode {name!r}: parameters {unknown} are not score sources {SOURCES}")
        options = tuple(p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY)
        REWARD_COMBINE_MODES.add(name, fn, uses_rule="rule" in params, uses_rm="rm" in params, options=options)
        return fn

    return decorator


@combine_mode("rule")
def combine_rule(rule: Tensor) -> Tensor:
    return rule


@combine_mode("rm")
def combine_rm(rm: Tensor) -> Tensor:
    return rm


@combine_mode("sum")
def combine_sum(rule: Tensor, rm: Tensor, *, rule_weight: float, rm_weight: float) -> Tensor:
    return rule_weight * rule + rm_weight * rm


@combine_mode("rule_gated")
def combine_rule_gated(rule: Tensor, rm: Tensor, *, pass_threshold: float, fail_score: float) -> Tensor:
    return torch.where(rule >= pass_threshold, rm, torch.full_like(rm, fail_score))


def combine_scores(mode: str, *, rule: Tensor, rm: Tensor | None, options: Mapping[str, Any]) -> Tensor:
    """The outcome reward [B] of `mode`; `options` holds (at least) the mode's keyword options."""
    entry = REWARD_COMBINE_MODES.get(mode)
    if entry.uses_rm and rm is None:
        raise ValueError(f"reward.combine {mode!r} needs the model-side score, and no reward model, judge or "
                         "remote reward is configured")
    sources = {"rule": rule, "rm": rm}
    args = {name: sources[name] for name in SOURCES if getattr(entry, f"uses_{name}")}
    return entry.target(**args, **{name: options[name] for name in entry.options})
