"""Spawn target of the recipe-values property test (`test_robust_recipe_values.py`).

Inside one gloo rank with megatron initialised (TP1 PP1), hypothesis draws edge values (negative, zero, huge,
NaN, infinite, wrong types) into the numeric fields of the quickstart recipes and of their inline model config.
A drawn recipe must either be refused as bad input (one line per problem) or build everything a run builds
from it before the first step: the HF and Megatron model configs, each optimizer (and one step of it on a
tiny model, whose weights must stay finite), the sampling parameters of training and validation requests as
the CPU engine (SGLang's schema) reads them, and the data loaders with their first batches.
"""

from __future__ import annotations

import copy
import math
import tempfile
import typing
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from megarl.config import Recipe, load_recipe
from megarl.config.loader import deep_merge
from megarl.errors import InputError

REPO = Path(__file__).resolve().parents[1]
# Small data sets and batches keep one accepted example well under a second.
SMALL = {"data": {"synthetic": {"num_train": 300, "num_val": 20}, "train_batch_size": 16},
         "sft_warmup": {"batch_size": 32}, "trainer": {"total_steps": 4}}
SMALL_BATCHES = {"ppo_mini_batch_size": 32, "ppo_micro_batch_size": 16}
# Keys of an HF config megarl reads besides the ones the quickstart's inline config sets.
OPTIONAL_MODEL_KEYS = ("head_dim", "initializer_range")

INTEGERS = [-(2**70), -(2**63) - 1, -1, 0, 1, 2, 3, 7, 64, 1000, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63, 2**70]
FLOATS = [-1.0, -0.0, 5e-324, 1e-9, 1e-6, 0.1, 0.5, 0.999, 1.5, 1e6, 1e300, math.nan, math.inf, -math.inf]
WRONG_TYPES = ["x", "1e-5", True, False, None, [1, 2], {"a": 1}]
# Mostly the edges themselves; some plausible values too, so that drawn recipes also pass and get built.
EDGES = st.sampled_from(INTEGERS + FLOATS + WRONG_TYPES)
EDGE_VALUES = st.one_of(EDGES, EDGES, EDGES, st.integers(-2, 300), st.floats(min_value=0.0, max_value=2.0))


def _base(name: str, roles: tuple[str, ...]) -> dict[str, Any]:
    recipe = yaml.safe_load((REPO / "recipes" / name).read_text())
    base = yaml.safe_load((REPO / "recipes" / recipe.pop("base")).read_text())
    small = copy.deepcopy(SMALL)
    for role in roles:
        small[role] = dict(SMALL_BATCHES)
    return deep_merge(deep_merge(base, recipe), small)


BASES = {"grpo": _base("quickstart-grpo-cpu.yaml", ("actor",)), "ppo": _base("quickstart-ppo-cpu.yaml",
                                                                              ("actor", "critic"))}


def _section_of(annotation: Any) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _numeric_fields(model: type[BaseModel], raw: dict[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple]:
    """Paths of every int/float field of the schema below `model` whose section `raw` holds (or defaults)."""
    paths = []
    for name, field in model.model_fields.items():
        section = _section_of(field.annotation)
        if section is not None:
            if name in raw or field.default is not None or field.default_factory is not None:
                paths += _numeric_fields(section, raw.get(name) or {}, prefix + (name,))
        elif any(kind in str(field.annotation) for kind in ("int", "float")):
            paths.append(prefix + (name,))
    return paths


def _fields(raw: dict[str, Any]) -> list[tuple]:
    model_keys = [key for key, value in raw["model"]["config"].items() if isinstance(value, (int, float))]
    return _numeric_fields(Recipe, raw) + [("model", "config", key) for key in (*model_keys, *OPTIONAL_MODEL_KEYS)]


FIELDS = {name: _fields(raw) for name, raw in BASES.items()}


@st.composite
def drawn_recipes(draw) -> tuple[str, dict[str, Any], list[tuple]]:
    name = draw(st.sampled_from(sorted(BASES)))
    raw, drawn = copy.deepcopy(BASES[name]), []
    for _ in range(draw(st.integers(1, 2))):
        path, value = draw(st.sampled_from(FIELDS[name])), draw(EDGE_VALUES)
        parent = raw
        for key in path[:-1]:
            parent = parent.setdefault(key, {})
        parent[path[-1]] = value
        drawn.append((".".join(path), value))
    return name, raw, drawn


def _build_everything(recipe: Recipe, run_dir: Path, tiny_model) -> None:
    """What a run builds from `recipe` before its first step (bar the processes)."""
    import torch
    from transformers import AutoConfig

    from megarl.config import settings
    from megarl.controller.bootstrap import prepare_data
    from megarl.data.dataset import PromptLoader
    from megarl.engines.gpt import resolve_dtype, transformer_config
    from megarl.engines.optim import build_train_state
    from megarl.models.spec import arch_from_hf
    from megarl.rollout.cpu_engine.schema import GenerateBody
    from megarl.rollout.sampling import generate_body

    hf_config = recipe.model.hf_config()
    AutoConfig.for_model(**hf_config)
    transformer_config(arch_from_hf(hf_config), params_dtype=resolve_dtype(recipe.model.dtype))

    data = prepare_data(recipe, run_dir)
    batch = next(data.train_batches)
    assert batch["input_ids"].shape[0] == recipe.data.train_batch_size
    for _ in data.val_batches():
        pass
    if recipe.sft_warmup.steps:
        next(PromptLoader(data.train_dataset, recipe.sft_warmup.batch_size, shuffle=True, seed=recipe.seed + 1))

    eos = data.tokenizer.eos_token_id
    sampling = settings.rollout_sampling(recipe, eos_token_id=eos)
    settings.step_settings(recipe, sampling=sampling, num_devices=1)
    settings.policy_update_settings(recipe, sampling=sampling)
    settings.logprob_batching(recipe)
    prompt = batch["input_ids"][0][batch["attention_mask"][0].bool()].tolist()
    for each in (sampling, settings.validation_sampling(recipe, eos_token_id=eos)):
        body = generate_body(prompt, list(range(recipe.rollout.n)), sampling=each, seed=recipe.trainer.total_steps,
                             return_logprob=True)
        GenerateBody.model_validate(body)  # what the CPU engine (SGLang's schema) accepts

    roles = ["actor"] + (["critic"] if recipe.critic is not None else [])
    if recipe.critic is not None:
        settings.value_update_settings(recipe)
    for role in roles:
        chunks, config = tiny_model()
        state = build_train_state(chunks, config, settings.engine_settings(recipe, role).optimizer)
        for chunk in state.ddp_chunks:
            for param in chunk.parameters():
                param.main_grad.fill_(0.01)
        state.step()
        if role == "actor" and recipe.sft_warmup.steps:
            state.step_with_lr(recipe.sft_warmup.lr)  # the warm-up's steps
        assert all(torch.isfinite(p).all() for chunk in chunks for p in chunk.parameters()), role


def _tiny_model_factory():
    from megarl.engines.gpt import build_gpt

    hf_config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                 "num_hidden_layers": 1, "num_attention_heads": 2}

    def build():
        model = build_gpt(hf_config, params_dtype="float32", transformer_impl="local")
        for chunk in model.chunks:
            for param in chunk.parameters():
                param.data.normal_()
        return model.chunks, model.config

    return build


def _validate_or_build(raw: dict[str, Any], tiny_model, counts: dict[str, int]) -> None:
    """`megarl validate`'s checks on `raw`; when they pass, everything a run builds from it."""
    from megarl.controller.preflight import check_inputs

    with tempfile.TemporaryDirectory(prefix="megarl-values-") as scratch:
        raw = {**raw, "trainer": {**raw["trainer"], "output_dir": scratch}}
        path = Path(scratch) / "recipe.yaml"
        path.write_text(yaml.safe_dump(raw))
        try:
            recipe = load_recipe(path)
            problems = check_inputs(recipe)
        except InputError as error:
            problems = error.problems
        assert all(line.strip() and "\n" not in line for line in problems), problems
        if problems:
            counts["refused"] += 1
            return
        _build_everything(recipe, Path(scratch) / "run", tiny_model)
        counts["built"] += 1


# One value of each kind that broke a run once: every field gets each of them in the sweep.
SWEEP = [math.inf, -1, 0, 2**63, 1e300, "x"]


def check_drawn_recipes(*, rank: int, max_examples: int) -> dict[str, int]:
    """The sweep (each field alone at each SWEEP value), then the property (hypothesis: one or two fields at
    drawn edges); returns how many recipes were refused and how many built."""
    counts = {"refused": 0, "built": 0}
    tiny_model = _tiny_model_factory()
    # The PPO recipe adds the critic's fields; the ones it shares with GRPO are swept once.
    swept = {"grpo": FIELDS["grpo"], "ppo": [path for path in FIELDS["ppo"] if path not in FIELDS["grpo"]]}
    for name, fields in swept.items():
        for path in fields:
            for value in SWEEP:
                raw = copy.deepcopy(BASES[name])
                parent = raw
                for key in path[:-1]:
                    parent = parent.setdefault(key, {})
                parent[path[-1]] = value
                try:
                    _validate_or_build(raw, tiny_model, counts)
                except Exception as error:
                    raise AssertionError(f"{name} recipe with {'.'.join(path)}={value!r}: validate accepted it, "
                                         f"building failed: {type(error).__name__}: {error}") from error

    @settings(max_examples=max_examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(drawn_recipes())
    def accepted_means_buildable(example):
        _validate_or_build(example[1], tiny_model, counts)

    accepted_means_buildable()
    return counts
