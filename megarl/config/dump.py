"""The resolved recipe as YAML plus a layout summary (the `megarl validate` dry run), and the JSON Schema.

The YAML part loads back into the same recipe; the trailing comment block shows
what placement resolved to per role, so a layout can be checked on a laptop
before it is queued on a cluster.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter

from megarl.config.layout import (
    FLEET_ROLES,
    TRAINING_ROLES,
    RolloutLayout,
    TrainingLayout,
    active_roles,
    reference_fused,
    resolve_layout,
)
from megarl.config.loader import BASE_KEY
from megarl.config.overrides import recipe_keys, unwrap
from megarl.config.schema import Recipe
from megarl.config.yamlio import dump_yaml

OPTIONAL_ROLES = ("reward_model", "judge")


def _unused_reason(recipe: Recipe, role: str) -> str:
    if role == "critic":
        return f"not used (adv_estimator {recipe.algorithm.adv_estimator!r} needs no critic)"
    if recipe.actor.lora is not None and (recipe.algorithm.use_kl_in_reward or recipe.actor.use_kl_loss):
        return "no engine of its own (the actor with its LoRA adapters switched off)"
    return "not used (algorithm.use_kl_in_reward and actor.use_kl_loss are both false)"


def _role_line(role: str, layout: TrainingLayout | RolloutLayout) -> str:
    pool = f"pool {layout.pool.name} ({layout.pool.nodes}x{layout.pool.gpus_per_node})"
    if isinstance(layout, RolloutLayout):
        return f"{role:<10} {pool}  world {layout.world_size}  servers {layout.num_servers} x tp {layout.tp}"
    vpp = layout.vpp if layout.vpp is not None else "-"
    sequence_parallel = "on" if layout.sequence_parallel else "off"
    return (
        f"{role:<10} {pool}  world {layout.world_size}  tp {layout.tp}  pp {layout.pp}  vpp {vpp}"
        f"  ep {layout.ep}  dp {layout.dp}  sp {sequence_parallel}"
    )


def layout_summary(recipe: Recipe) -> list[str]:
    """One line for the placement and one per role (unused roles say why)."""
    placement = recipe.placement
    mode = "colocated" if placement.colocate else "disaggregated"
    lines = [
        f"device {placement.device}, {mode}, allocation {placement.nodes} node(s) x {placement.gpus_per_node}"
        f" = {placement.nodes * placement.gpus_per_node}"
    ]
    layouts, active = resolve_layout(recipe), active_roles(recipe)
    # The reward side's roles are optional features: listed only when the recipe uses them.
    shown = [role for role in (*TRAINING_ROLES, *FLEET_ROLES) if role not in OPTIONAL_ROLES or role in active]
    for role in shown:
        lines.append(
            _role_line(role, layouts[role]) if role in active else f"{role:<10} {_unused_reason(recipe, role)}"
        )
        if role == "reference" and reference_fused(recipe):
            lines[-1] += "  (in the actor's ranks)"
    return lines


def dump_recipe(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML, then the layout summary as comments."""
    body = dump_yaml(recipe.model_dump(mode="json"))
    summary = "\n".join(f"#   {line}" for line in layout_summary(recipe))
    return f"{body}\n# resolved layout:\n{summary}\n"


def default_of(key: str) -> tuple[bool, Any]:
    """(True, the schema's default of the recipe key `key` as `dump_recipe` writes it), or (False, None) when
    it has none: a required key, or one below a free-form mapping or a choice of sections."""
    section: Any = Recipe
    *parents, leaf = key.split(".")
    for name in parents:
        field = recipe_keys(section).get(name)
        section = unwrap(field.annotation) if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return False, None
    field = recipe_keys(section).get(leaf)
    if field is None or field.is_required():
        return False, None
    return True, TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")


def recipe_json_schema() -> dict[str, Any]:
    """JSON Schema of a recipe file: the `Recipe` model plus the file-only `base:` key."""
    schema = Recipe.model_json_schema()
    schema["properties"] = {
        BASE_KEY: {
            "type": "string",
            "description": "recipe this one extends, relative to this file (one level; this file's keys win)",
        },
        **schema["properties"],
    }
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}
