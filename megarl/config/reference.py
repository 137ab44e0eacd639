"""The recipe reference (`docs/recipe.md`): every key of the recipe JSON Schema as Markdown tables.

Rendered from `recipe_json_schema()`, the schema `megarl schema` prints, so the
reference cannot drift from what `megarl validate` accepts: `megarl schema --markdown`
writes it, and a test regenerates it and compares it with the committed page. One
table per section (`actor`, `actor.optim`, ...): key, type with its bounds or choices,
default, description.
"""

from __future__ import annotations

import json
from typing import Any

from megarl.config.dump import recipe_json_schema

HEADER = """# Recipe reference

Every key a recipe may set, with its type, default and meaning. A recipe is a YAML
file; `base: other.yaml` makes it extend another recipe (one level, this file's keys
win), and `--set key=value` on the command line overrides one value. `megarl validate
RECIPE` prints the resolved recipe (every default filled in) and checks it; `megarl
schema` prints the same schema as JSON Schema.

This page is generated from that schema by `megarl schema --markdown`; a test
regenerates it and compares, so it matches the code it ships with.
"""


def _ref_name(schema: dict) -> str | None:
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[1] if ref else None


def _section_of(schema: dict) -> tuple[str | None, bool]:
    """(the $defs name of the section a property holds, whether it may be null instead)."""
    if _ref_name(schema):
        return _ref_name(schema), False
    options = schema.get("anyOf", [])
    refs = [_ref_name(option) for option in options if _ref_name(option)]
    if len(refs) == 1 and len(options) == 2 and {"type": "null"} in options:
        return refs[0], True
    return None, False


def _bounds(schema: dict) -> str:
    marks = [(key, symbol) for key, symbol in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="),
                                               ("exclusiveMaximum", "<"), ("minItems", "items >="),
                                               ("maxLength", "length <=")) if key in schema]
    return ", ".join(f"{symbol} {schema[key]}" for key, symbol in marks)


def _type(schema: dict) -> str:
    if "enum" in schema:
        return "one of " + ", ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "anyOf" in schema:
        return " or ".join(_type(option) for option in schema["anyOf"])
    if _ref_name(schema):
        return f"section `{_ref_name(schema)}`"
    kind = schema.get("type", "any")
    if kind == "array":
        text = f"list of {_type(schema.get('items', {}))}"
    elif kind == "object":
        values = schema.get("additionalProperties")
        text = f"mapping of {_type(values)}" if isinstance(values, dict) and values else "mapping"
    else:
        text = kind
    bounds = _bounds(schema)
    return f"{text} ({bounds})" if bounds else text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(name: str, schema: dict, required: list[str]) -> str:
    if "default" in schema:
        return f"`{json.dumps(schema['default'])}`"
    return "required" if name in required else "-"


def _sections(schema: dict, definitions: dict, path: str, out: list[str]) -> None:
    rows, nested = [], []
    required = schema.get("required", [])
    for name, prop in schema.get("properties", {}).items():
        key = f"{path}.{name}" if path else name
        section, nullable = _section_of(prop)
        if section is not None:
            note = " (optional section, null by default)" if nullable and prop.get("default", 0) is None else ""
            rows.append(f"| `{name}` | section [`{key}`](#{key.replace('.', '')}){note} | "
                        f"{'required' if name in required else '-'} | {_cell(prop.get('description', ''))} |")
            nested.append((key, definitions[section]))
        else:
            rows.append(f"| `{name}` | {_cell(_type(prop))} | {_cell(_default(name, prop, required))} | "
                        f"{_cell(prop.get('description', ''))} |")
    out += [f"## `{path or 'recipe'}`", ""]
    if schema.get("description") and path:
        out += [schema["description"], ""]
    out += ["| key | type | default | description |", "|---|---|---|---|", *rows, ""]
    for key, section_schema in nested:
        _sections(section_schema, definitions, key, out)


def recipe_reference() -> str:
    """The Markdown page: the header, then one table per section, depth first in schema order."""
    schema = recipe_json_schema()
    out = [HEADER]
    _sections(schema, schema.get("$defs", {}), "", out)
    return "\n".join(out).rstrip("\n") + "\n"
