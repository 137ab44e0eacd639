"""YAML reading for recipes: one loader, so files and `--set` values parse the same way.

Two departures from PyYAML's YAML 1.1 defaults, both to stop silent surprises:
`1e-5` is a float (YAML 1.1 wants `1.0e-5` and would hand back a string), and
a key repeated in one mapping is an error instead of "last one wins".

And bounds, so a hostile or broken file cannot hang `megarl validate`: a recipe is
a regular file (not a FIFO or a device), of which at most `MAX_RECIPE_BYTES` are
read whatever `stat` says, and its document may expand to at most
`MAX_EXPANDED_NODES` nodes once aliases are followed (anchors are fine; a
"billion laughs" of nested aliases is refused before anything is copied).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from megarl.errors import InputError
from megarl.userfiles import file_problem, read_bounded

MAX_RECIPE_BYTES = 1 << 20
MAX_EXPANDED_NODES = 100_000


class RecipeLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 exponent floats and duplicate-key detection."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)):
                continue  # unhashable keys are rejected by the base constructor
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class RecipeDumper(yaml.SafeDumper):
    """SafeDumper that quotes what RecipeLoader would misread, and keeps scalar lists on one line."""


def _represent_list(dumper: RecipeDumper, items: list[Any]) -> yaml.SequenceNode:
    flow = all(not isinstance(item, (dict, list)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=flow)


RecipeDumper.add_representer(list, _represent_list)

# Registered on the dumper too, so a string like "1e5" is written quoted and loads back as a string.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _yaml_class in (RecipeLoader, RecipeDumper):
    _yaml_class.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789"))


def _describe_yaml_error(error: yaml.YAMLError, text: str) -> tuple[int | None, str]:
    """(1-based line, one-line message) of a PyYAML error."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and context_mark is not None:
        # The parser notices an unclosed bracket lines later; the opening line is where to look.
        problem = f"{problem}, {context} started on line {context_mark.line + 1}"
    if mark is None:
        return None, problem
    lines = text.splitlines()
    source = lines[mark.line].strip() if mark.line < len(lines) else ""
    return mark.line + 1, f"{problem} (got {source!r})"


def _expanded_nodes(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many nodes `node` stands for with every alias expanded (shared nodes counted once per use)."""
    if id(node) not in memo:
        memo[id(node)] = 0  # a recursive alias counts as a leaf here; the constructor handles it
        children = []
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        memo[id(node)] = 1 + sum(_expanded_nodes(child, memo) for child in children)
    return memo[id(node)]


def _load_bounded(text: str) -> Any:
    """`text` parsed with RecipeLoader, refused when its aliases expand past MAX_EXPANDED_NODES."""
    loader = RecipeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_nodes(node, {})
        if size > MAX_EXPANDED_NODES:
            raise ValueError(f"the YAML expands to more than {MAX_EXPANDED_NODES} values once its aliases are "
                             f"followed (an alias bomb?)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml_file(path: Path) -> dict[str, Any]:
    """The top-level mapping of a recipe file; InputError naming the file (and line) on any problem."""
    problem = file_problem(path)
    if problem == "no such file":
        raise InputError(f"{path}: recipe file not found")
    if problem is not None:  # a FIFO would block and /dev/zero never end
        raise InputError(f"{path}: {problem.replace('a regular file', 'a recipe file')}")
    try:
        text = read_bounded(path, MAX_RECIPE_BYTES).decode()
    except InputError:
        raise InputError(f"{path}: a recipe file may be at most {MAX_RECIPE_BYTES} bytes "
                         f"(got {path.stat().st_size})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: cannot read recipe file: {error}") from None
    try:
        loaded = _load_bounded(text)
    except yaml.YAMLError as error:
        line, message = _describe_yaml_error(error, text)
        where = f"{path}:{line}" if line is not None else str(path)
        raise InputError(f"{where}: YAML syntax error: {message}") from None
    except (ValueError, RecursionError) as error:
        reason = str(error) if isinstance(error, ValueError) else "nested too deeply"
        raise InputError(f"{path}: {reason}") from None
    if not isinstance(loaded, dict):
        got = "an empty file" if loaded is None else f"a {type(loaded).__name__}"
        raise InputError(f"{path}: a recipe must be a YAML mapping of sections (got {got})")
    return loaded


def parse_yaml_value(text: str) -> Any:
    """One `--set` value parsed as YAML (scalar, list or mapping); ValueError with a one-line reason."""
    try:
        return _load_bounded(text)
    except yaml.YAMLError as error:
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"not a valid YAML value: {problem}") from None
    except RecursionError:
        raise ValueError("not a valid YAML value: nested too deeply") from None


def dump_yaml(data: dict[str, Any]) -> str:
    """Block-style YAML in key order that `read_yaml_file` loads back to the same values."""
    return yaml.dump(data, Dumper=RecipeDumper, sort_keys=False, default_flow_style=False, width=120)
