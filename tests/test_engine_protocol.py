"""The TrainEngine seam: the Megatron engines offer every protocol method with the protocol's signature,
and the packages above them (the engine worker in megarl/cluster, the run in megarl/controller, the other
commands in megarl/commands) reach engines through those methods alone (an ast walk of those packages)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megarl.engines.protocol import TrainEngine

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"
WORKER = PACKAGE / "cluster" / "engine_worker.py"
ABOVE_THE_ENGINES = [PACKAGE / name for name in ("cluster", "controller", "commands", "bench")]
MEMBERS = sorted(name for name, value in vars(TrainEngine).items()
                 if callable(value) and not name.startswith("_"))


def test_the_protocol_covers_the_engine_phases():
    assert MEMBERS == sorted([
        "compute_log_prob", "compute_values", "compute_scores", "update", "sft_step", "weight_shards",
        "adapter_shards", "hf_state_dict", "load_hf_state_dict", "train_state_bytes", "save_checkpoint", "load_checkpoint", "load_policy_checkpoint",
        "reset_optimizer_state", "offload", "onload", "copy_weights_from",
    ])


@pytest.mark.parametrize("engine", ["actor.PolicyEngine", "critic.ValueEngine", "reward_model.RewardModelEngine"])
def test_megatron_engines_implement_it_with_the_same_signatures(engine):
    import importlib

    module, name = engine.split(".")
    cls = getattr(importlib.import_module(f"megarl.engines.{module}"), name)
    for member in MEMBERS:
        ours = inspect.signature(getattr(cls, member))
        theirs = inspect.signature(getattr(TrainEngine, member))
        assert list(ours.parameters) == list(theirs.parameters), (engine, member)


def _is_an_engine(node: ast.AST, *, in_worker: bool) -> bool:
    """`self.engine` anywhere; in the engine worker also its fused `self.reference`, `self._engine(...)` and the
    local `engine` it picks with them."""
    if isinstance(node, ast.Attribute):
        names = ("engine", "reference") if in_worker else ("engine",)
        return node.attr in names and isinstance(node.value, ast.Name) and node.value.id == "self"
    if isinstance(node, ast.Call):
        return in_worker and isinstance(node.func, ast.Attribute) and node.func.attr == "_engine"
    return in_worker and isinstance(node, ast.Name) and node.id == "engine"


def test_the_packages_above_the_engines_use_only_protocol_methods():
    used = set()
    for path in (path for package in ABOVE_THE_ENGINES for path in package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            # self.engine.<name>, self.reference.<name>, self._engine(...).<name> and engine.<name>: what the
            # worker calls on its engine and on a fused reference
            if isinstance(node, ast.Attribute) and _is_an_engine(node.value, in_worker=path == WORKER):
                used.add(node.attr)
    assert used and used <= set(MEMBERS), sorted(used - set(MEMBERS))
