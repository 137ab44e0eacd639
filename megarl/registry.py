"""Named registries of megarl's pluggable parts: the single source of their names and metadata.

A recipe names a part by a string (`algorithm.adv_estimator: grpo`,
`weight_sync.transport: tensor`); a `Registry` maps that string to the object
that implements it, plus the metadata other layers need before running it (does
this estimator need a critic? must this transport be colocated?).

The registries are declared here, at the top of the layer stack, so the recipe
checks in `megarl.config` can read them; each is filled by the layer that owns
the part (`megarl.algorithms` registers estimators with a decorator). A
registry names the module that registers its built-in entries and imports it
on first lookup: the checks see the built-ins without importing a lower layer
at load time, and an entry added anywhere else (a plug-in, a test) is seen too.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """One registered part: its name, the object behind it, and its metadata."""

    name: str
    target: Any
    meta: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __getattr__(self, key: str) -> Any:
        # Metadata reads like attributes: ADVANTAGE_ESTIMATORS.get("gae").needs_critic. Dunder and
        # field names never come from `meta` (copy and pickle probe them before the fields exist).
        if key.startswith("__") or key in ("name", "target", "meta"):
            raise AttributeError(key)
        try:
            return self.meta[key]
        except KeyError:
            raise AttributeError(f"{self.name!r} has no metadata {key!r}") from None


class Registry:
    """Name -> `Entry`; `what` names the kind of part in messages, `builtins` the module that registers them,
    `required` the metadata every entry must carry (checked when it is registered)."""

    def __init__(self, what: str, *, builtins: str, required: tuple[str, ...] = ()):
        self.what = what
        self.builtins = builtins
        self.required = required
        self._entries: dict[str, Entry] = {}
        self._loaded = False

    def add(self, name: str, target: Any, **meta: Any) -> Entry:
        """Register `target` under `name`; a name registered twice, or without the required metadata, is an error
        at import time, not at step 300."""
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is already registered to {self._entries[name].target!r}")
        missing = [key for key in self.required if key not in meta]
        if missing:
            raise ValueError(f"{self.what} {name!r} needs the metadata {missing}")
        entry = Entry(name, target, MappingProxyType(dict(meta)))
        self._entries[name] = entry
        return entry

    def register(self, *names: str, **meta: Any) -> Callable[[T], T]:
        """Decorator form of `add`: the object is stored under each of `names` (aliases) with `meta`."""
        if not names:
            raise ValueError("register() needs at least one name")

        def decorator(target: T) -> T:
            for name in names:
                self.add(name, target, **meta)
            return target

        return decorator

    def remove(self, name: str) -> None:
        """Forget `name` (a test's temporary entry)."""
        self._entries.pop(name, None)

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            importlib.import_module(self.builtins)

    def get(self, name: str) -> Entry:
        """The entry called `name`; ValueError naming the known names otherwise."""
        self._load()
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.what} {name!r}; known: {', '.join(self.names())}") from None

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self._load()
        return sorted(self._entries)

    def check(self, name: str) -> str:
        """`name` when it is registered (a pydantic validator for recipe fields); ValueError otherwise."""
        self.get(name)
        return name

    def resolve(self, spec: str) -> Entry:
        """A registered name, or a user's entry named by its Python path "package.module:attribute", imported
        now (its metadata: the attribute's `registry_meta` dict, if any); ValueError naming `spec` otherwise."""
        if ":" not in spec:
            return self.get(spec)
        module_name, _, attribute = spec.partition(":")
        if not module_name or not attribute:
            raise ValueError(f"{self.what} {spec!r}: expected a registered name or 'package.module:attribute'")
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # a broken user module may raise anything on import
            raise ValueError(f"{self.what} {spec!r}: cannot import module {module_name!r} "
                             f"({type(error).__name__}: {error})") from None
        if not hasattr(module, attribute):
            raise ValueError(f"{self.what} {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(module, attribute)
        return Entry(spec, target, MappingProxyType(dict(getattr(target, "registry_meta", {}))))

    def check_spec(self, spec: str) -> str:
        """`spec` when `resolve` finds it (a pydantic validator: `megarl validate` imports user entries)."""
        self.resolve(spec)
        return spec


ADVANTAGE_ESTIMATORS = Registry("advantage estimator", builtins="megarl.algorithms.advantages")
LOSS_AGG_MODES = Registry("loss_agg_mode", builtins="megarl.algorithms.losses")
POLICY_LOSSES = Registry("policy loss", builtins="megarl.algorithms.policy_losses")
KL_PENALTIES = Registry("KL penalty kind", builtins="megarl.algorithms.kl")
REWARD_SCORERS = Registry("built-in scorer", builtins="megarl.rewards.registry")
REWARD_COMBINE_MODES = Registry("reward.combine mode", builtins="megarl.rewards.combine")
JUDGE_PARSERS = Registry("judge parser", builtins="megarl.rewards.judge")
MODEL_SPECS = Registry("model_type", builtins="megarl.models.spec")
# Each transport carries the bound `megarl bench` measures its syncs against (megarl.weightsync.bounds.SyncBound).
WEIGHT_SYNC_TRANSPORTS = Registry("weight-sync transport", builtins="megarl.weightsync", required=("bound",))
TOOL_CALL_FORMATS = Registry("tool-call format", builtins="megarl.agent.tool_calls")
TOOLS = Registry("tool", builtins="megarl.agent.tools")
ENVIRONMENTS = Registry("environment", builtins="megarl.agent.environments")
