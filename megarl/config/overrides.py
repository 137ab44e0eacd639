"""`--set a.b.c=value` overrides: parse, check the path against the schema, apply to the raw recipe dict.

The path is checked against the pydantic models rather than the YAML, so a key
the recipe leaves at its default (or a section it omits) can still be set, and
a typo fails here naming the path instead of vanishing. Values are parsed as
YAML and coerced later by the same validation as the file.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from megarl.config.yamlio import parse_yaml_value

OVERRIDE_SOURCE = "--set"


@dataclass(frozen=True)
class Override:
    path: tuple[str, ...]
    value: Any

    @property
    def key(self) -> str:
        return ".".join(self.path)


def unwrap(annotation: Any) -> Any:
    """Strip Optional[...] and Annotated[...] down to the type that decides what a sub-key means."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def recipe_keys(model: type[BaseModel]) -> dict[str, Any]:
    """A section's fields by the key a recipe writes (the alias where one is set: `rollout.async`)."""
    return {field.alias or name: field for name, field in model.model_fields.items()}


def key_path_problem(model: type[BaseModel], path: tuple[str, ...]) -> str | None:
    """Why `path` names no recipe key, or None when it does."""
    annotation: Any = model
    for depth, segment in enumerate(path):
        annotation = unwrap(annotation)
        here = ".".join(path[:depth]) or "the recipe"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = recipe_keys(annotation)
            if segment not in fields:
                close = difflib.get_close_matches(segment, list(fields), n=1)
                if close:
                    return f"unknown key; did you mean {'.'.join((*path[:depth], close[0]))!r}?"
                return f"unknown key; {here} has: {', '.join(fields)}"
            annotation = fields[segment].annotation
        elif typing.get_origin(annotation) is dict or annotation is dict:
            # Free-form mappings (model.config, rollout.sglang, pools, ...) take any key.
            args = typing.get_args(annotation)
            annotation = args[1] if args else Any
        elif annotation is Any:
            return None
        else:
            return f"{here} is a value, not a section, so it has no key {segment!r}"
    return None


def parse_overrides(recipe_model: type[BaseModel], texts: typing.Sequence[str]) -> tuple[list[Override], list[str]]:
    """(overrides, problem lines) for `KEY=VALUE` texts; each problem is `--set: <key>: <message> (got <text>)`."""
    overrides: list[Override] = []
    problems: list[str] = []
    for text in texts:
        key, equals, raw_value = text.partition("=")
        path = tuple(key.strip().split("."))
        if not equals or not key.strip() or any(not segment.strip() for segment in path):
            problems.append(
                f"{OVERRIDE_SOURCE}: {key or '(empty)'}: expected KEY=VALUE with a dotted key (got {text!r})"
            )
            continue
        path = tuple(segment.strip() for segment in path)
        if (problem := key_path_problem(recipe_model, path)) is not None:
            problems.append(f"{OVERRIDE_SOURCE}: {'.'.join(path)}: {problem} (got {text!r})")
            continue
        try:
            value = parse_yaml_value(raw_value)
        except ValueError as error:
            problems.append(f"{OVERRIDE_SOURCE}: {'.'.join(path)}: {error} (got {raw_value!r})")
            continue
        overrides.append(Override(path, value))
    return overrides, problems


def apply_overrides(raw: dict[str, Any], overrides: typing.Sequence[Override]) -> list[str]:
    """Set each override in `raw` in place (creating sections as needed); problem lines for blocked paths."""
    problems = []
    for override in overrides:
        node = raw
        for depth, segment in enumerate(override.path[:-1]):
            child = node.get(segment)
            if child is None:
                child = node[segment] = {}
            if not isinstance(child, dict):
                where = ".".join(override.path[: depth + 1])
                problems.append(
                    f"{OVERRIDE_SOURCE}: {override.key}: {where} is {child!r} in the recipe, not a section"
                    f" (got {override.value!r})"
                )
                break
            node = child
        else:
            node[override.path[-1]] = override.value
    return problems


def overrides_as_tree(overrides: typing.Sequence[Override]) -> dict[str, Any]:
    """The overrides as one nested dict, so error origins can be looked up like a recipe layer."""
    tree: dict[str, Any] = {}
    for override in overrides:
        node = tree
        for segment in override.path[:-1]:
            child = node.get(segment)
            if not isinstance(child, dict):
                child = node[segment] = {}
            node = child
        node[override.path[-1]] = override.value
    return tree
