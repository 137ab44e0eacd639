"""Which scorer judges which `data_source`: the built-ins, custom scorers by import path, and the
up-front check that every data source of a run has one.

A scorer is `scorer(solution_str, ground_truth, extra_info) -> float | dict` (a dict carries
"score" plus extra fields to log). Built-in scorers are registered by data source in
`megarl.registry.REWARD_SCORERS`; keyword-only parameters a scorer declares (`method`,
`format_score`, `score`) are bound from the recipe's `reward` section. Scorers built here are
module-level functions or `functools.partial`s of them, so they pickle into reward worker processes.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from megarl.errors import InputError
from megarl.registry import REWARD_SCORERS
from megarl.rewards import digits, gsm8k
from megarl.rewards import math as math_reward

Scorer = Callable[[str, str, dict], Any]

GSM8K_SOURCES = ("openai/gsm8k", "megarl/arithmetic")
MATH_SOURCES = ("DigitalLearningGmbH/MATH-lighteval", "lighteval/MATH", "HuggingFaceH4/MATH-500")


@REWARD_SCORERS.register(*GSM8K_SOURCES, ground_truth_problem=gsm8k.ground_truth_problem)
def _score_gsm8k(
    solution_str: str, ground_truth: str, extra_info: dict, *, method: str, format_score: float, score: float
) -> float:
    return gsm8k.compute_score(solution_str, ground_truth, method=method, format_score=format_score, score=score)


@REWARD_SCORERS.register(*MATH_SOURCES)
def _score_math(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return math_reward.compute_score(solution_str, ground_truth)


@REWARD_SCORERS.register("megarl/random_digits")
def _score_random_digits(solution_str: str, ground_truth: str, extra_info: dict) -> float:
    return digits.compute_score(solution_str)


def import_scorer(data_source: str, import_path: str) -> Scorer:
    """The callable named by "package.module:function"; InputError naming the data source and path otherwise."""
    module_name, colon, attribute = import_path.partition(":")
    where = f"custom scorer for data_source {data_source!r}: {import_path!r}"
    if not colon or not module_name or not attribute:
        raise InputError(f"{where}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # a broken user module may raise anything on import
        raise InputError(f"{where}: cannot import module {module_name!r} ({type(error).__name__}: {error})") from error
    scorer = getattr(module, attribute, None)
    if not callable(scorer):
        raise InputError(f"{where}: module {module_name!r} has no function {attribute!r}")
    return scorer


def build_scorers(
    custom: Mapping[str, str] = {},  # noqa: B006 - read-only default, never mutated
    gsm8k_method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, Scorer]:
    """Scorers by data source: the registered built-ins, then `custom` ({data_source: "module:function"}) on top.

    A custom entry may override a built-in source or add a new one.
    """
    if gsm8k_method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k_method must be 'strict' or 'flexible', got {gsm8k_method!r}")
    options = {"method": gsm8k_method, "format_score": format_score, "score": score}
    scorers: dict[str, Scorer] = {source: _bind_options(REWARD_SCORERS.get(source).target, options)
                                  for source in REWARD_SCORERS}
    problems = []
    for data_source, import_path in custom.items():
        try:
            scorers[data_source] = import_scorer(data_source, import_path)
        except InputError as error:
            problems.extend(error.problems)
    if problems:
        raise InputError(problems)
    return scorers


def _bind_options(scorer: Scorer, options: Mapping[str, Any]) -> Scorer:
    """`scorer` with the keyword-only options it declares bound from the reward settings."""
    declared = [name for name, param in inspect.signature(scorer).parameters.items()
                if param.kind is inspect.Parameter.KEYWORD_ONLY]
    return functools.partial(scorer, **{name: options[name] for name in declared}) if declared else scorer


def ground_truth_checks(custom: Mapping[str, str] = {}) -> dict[str, Callable[[Any], str | None]]:  # noqa: B006
    """{data_source: check} for the built-in scorers that can tell a ground truth no response could match (a
    source whose scorer `custom` replaces is the user's to judge)."""
    return {source: REWARD_SCORERS.get(source).meta["ground_truth_problem"] for source in REWARD_SCORERS
            if source not in custom and "ground_truth_problem" in REWARD_SCORERS.get(source).meta}


def check_data_sources(sources: Iterable[str], scorers: Mapping[str, Scorer]) -> None:
    """Raise InputError naming every data source without a scorer, before training starts."""
    unknown = [source for source in dict.fromkeys(sources) if source not in scorers]
    if not unknown:
        return
    known = ", ".join(sorted(scorers))
    raise InputError(
        [
            f"data_source {source!r} has no reward scorer; known data sources: {known}; "
            f"allow it with a custom scorer in the recipe: reward.scorers: {{{source!r}: 'package.module:function'}}"
            for source in unknown
        ]
    )
