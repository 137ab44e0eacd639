"""`load_recipe`: YAML file -> `base:` inheritance -> `--set` overrides -> field validation -> cross-field checks.

Every failure is an `InputError` whose lines read `<source>: <dotted.key>:
<message> (got <value>)`, where the source is the file (base or recipe) or
`--set` that supplied the offending value, so a user knows where to edit.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from megarl.config.checks import check_recipe
from megarl.config.layout import TRAINING_ROLES, active_roles, role_parallel, training_layout
from megarl.config.overrides import (
    OVERRIDE_SOURCE,
    Override,
    apply_overrides,
    key_path_problem,
    overrides_as_tree,
    parse_overrides,
)
from megarl.config.schema import Recipe
from megarl.config.yamlio import read_yaml_file
from megarl.errors import InputError

BASE_KEY = "base"
_MAX_SHOWN = 80

# (source name, the raw mapping it contributed), lowest priority first.
Layers = list[tuple[str, dict[str, Any]]]


def deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """`child` over `base`: mappings merge key by key, anything else (lists, scalars, null) replaces."""
    merged = copy.deepcopy(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _read_layers(path: Path) -> Layers:
    """The recipe file and, when it names one, its base; a base may not name another base."""
    recipe = read_yaml_file(path)
    base_ref = recipe.pop(BASE_KEY, None)
    if base_ref is None:
        return [(str(path), recipe)]
    if not isinstance(base_ref, str) or not base_ref.strip():
        raise InputError(f"{path}: {BASE_KEY}: expected a recipe file path relative to this file (got {base_ref!r})")
    base_path = path.parent / base_ref
    if not base_path.exists():
        raise InputError(f"{path}: {BASE_KEY}: base recipe {base_path} not found (got {base_ref!r})")
    base = read_yaml_file(base_path)
    if BASE_KEY in base:
        raise InputError(
            f"{base_path}: {BASE_KEY}: a base recipe cannot have its own base (only one level) (got {base[BASE_KEY]!r})"
        )
    return [(str(base_path), base), (str(path), recipe)]


def _matched_depth(tree: Any, path: Sequence[Any]) -> int:
    """How many leading segments of `path` exist in `tree`."""
    for depth, segment in enumerate(path):
        if isinstance(tree, dict) and segment in tree:
            tree = tree[segment]
        elif isinstance(tree, list) and isinstance(segment, int) and 0 <= segment < len(tree):
            tree = tree[segment]
        else:
            return depth
    return len(path)


@dataclass(frozen=True)
class _Origins:
    """Who wrote each key: the recipe files (base first), then the `--set` overrides."""

    files: Layers
    overrides: Sequence[Override]

    def source_of(self, path: Sequence[Any]) -> str:
        """The author of the value at `path`, or for a default or missing key the author of its section."""
        path = tuple(path)
        # An override replaces the whole subtree it names, so it wrote everything below it.
        if any(path[: len(override.path)] == override.path for override in self.overrides):
            return OVERRIDE_SOURCE
        source, best = self.files[-1][0], 0
        for name, tree in [*self.files, (OVERRIDE_SOURCE, overrides_as_tree(self.overrides))]:
            depth = _matched_depth(tree, path)
            if depth and depth >= best:  # later layers win ties
                source, best = name, depth
        return source


def _show(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= _MAX_SHOWN else shown[: _MAX_SHOWN - 3] + "..."


def _dotted(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _validation_lines(error: ValidationError, origins: _Origins) -> list[str]:
    lines = []
    for detail in error.errors():
        loc = [part for part in detail["loc"] if part != "[key]"]
        key, source = _dotted(loc) or "(top level)", origins.source_of(loc)
        kind, message = detail["type"], detail["msg"].removeprefix("Value error, ")
        if kind == "missing":
            what = "missing list item" if isinstance(loc[-1], int) else "missing required key"
            lines.append(f"{source}: {key}: {what}")
            continue
        if kind == "extra_forbidden":
            message = key_path_problem(Recipe, tuple(str(part) for part in loc)) or "unknown key"
        elif "[key]" in detail["loc"]:
            message = f"invalid key: {message}"
        lines.append(f"{source}: {key}: {message} (got {_show(detail.get('input'))})")
    return lines


def _fill_derived(recipe: Recipe) -> None:
    """Write the values other keys imply back, so the resolved recipe states them: the dp of each active
    training role, and the critic's loss_agg_mode (the actor's unless given, as verl's critic config does)."""
    for role in active_roles(recipe):
        if role in TRAINING_ROLES:
            role_parallel(recipe, role).dp = training_layout(recipe, role).dp
    if recipe.critic is not None and recipe.critic.loss_agg_mode is None:
        recipe.critic.loss_agg_mode = recipe.actor.loss_agg_mode


def load_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Read, inherit, override, validate and check a recipe; InputError listing every problem found."""
    if isinstance(overrides, str):
        raise TypeError(
            f"load_recipe: overrides must be a sequence of 'KEY=VALUE' strings, not one string {overrides!r}"
        )
    path = Path(path)
    layers = _read_layers(path)
    raw = deep_merge(layers[0][1], layers[1][1]) if len(layers) == 2 else copy.deepcopy(layers[0][1])
    parsed, problems = parse_overrides(Recipe, overrides)
    problems += apply_overrides(raw, parsed)
    if problems:
        raise InputError(problems)
    origins = _Origins(layers, parsed)
    try:
        recipe = Recipe.model_validate(raw)
    except ValidationError as error:
        raise InputError(_validation_lines(error, origins)) from None
    cross_field = check_recipe(recipe)
    if cross_field:
        raise InputError([f"{origins.source_of(problem.key.split('.'))}: {problem.line}" for problem in cross_field])
    _fill_derived(recipe)
    return recipe
