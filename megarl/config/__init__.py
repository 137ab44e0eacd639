"""Typed YAML recipes: the schema (pydantic, unknown keys rejected), loading with `base:` and `--set`, checks, dump.

`load_recipe` is the only way the rest of megarl should get a `Recipe`: it
runs the cross-field checks and fills in derived values (each active training
role's `parallel.dp`). Importing this package pulls in pydantic and PyYAML only.
"""

from megarl.config.checks import Problem, check_recipe
from megarl.config.dump import dump_recipe, layout_summary, recipe_json_schema
from megarl.config.layout import (
    Pool,
    RolloutLayout,
    TrainingLayout,
    active_roles,
    resolve_layout,
    role_pool,
    rollout_layout,
    training_layout,
)
from megarl.config.loader import load_recipe
from megarl.config.schema import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    PlacementConfig,
    PoolSpec,
    Recipe,
    RewardConfig,
    RolloutConfig,
    SamplesConfig,
    SftWarmupConfig,
    SyntheticData,
    TrainerConfig,
    WandbConfig,
    WeightSyncConfig,
    read_hf_config,
)
from megarl.config.training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    KLControl,
    Optim,
    Parallel,
    ReferenceConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "DataConfig",
    "KLControl",
    "LoggingConfig",
    "ModelConfig",
    "Optim",
    "Parallel",
    "PlacementConfig",
    "Pool",
    "PoolSpec",
    "Problem",
    "Recipe",
    "ReferenceConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutLayout",
    "SamplesConfig",
    "SftWarmupConfig",
    "SyntheticData",
    "TrainerConfig",
    "TrainingLayout",
    "WandbConfig",
    "WeightSyncConfig",
    "active_roles",
    "check_recipe",
    "dump_recipe",
    "layout_summary",
    "load_recipe",
    "read_hf_config",
    "recipe_json_schema",
    "resolve_layout",
    "role_pool",
    "rollout_layout",
    "training_layout",
]
