"""Frozen settings the engines and the weight sync run with, built once from a validated recipe.

The recipe is the only place defaults live; these objects carry resolved values
(per-rank mini-batch sizes, optimizer steps of the whole run) across Ray to the
engines, which take them whole. Nothing here has a default of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megarl.config.layout import training_layout
from megarl.config.schema import Recipe


@dataclass(frozen=True)
class Batching:
    """How one rank cuts its rows into micro-batches: `micro_batch_size` rows, or packed sequences of at most
    `max_tokens_per_microbatch` tokens when that is set."""

    micro_batch_size: int
    max_tokens_per_microbatch: int | None


@dataclass(frozen=True)
class OptimizerSettings:
    """Adam(W) and its LR schedule; `total_steps` counts optimizer steps over the whole run."""

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    clip_grad: float
    warmup_steps: int
    schedule: str
    min_lr: float
    total_steps: int


@dataclass(frozen=True)
class PolicyLossSettings:
    """The policy loss (`policy_loss`, a `POLICY_LOSSES` name): clipping, aggregation, entropy bonus and the
    optional KL-to-reference term."""

    policy_loss: str
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str


@dataclass(frozen=True)
class PolicyUpdateSettings:
    """One actor update: `epochs` passes over the step's batch in mini-batches of `mini_batch_size` rows per
    DP rank, one optimizer step each, sampling temperature `temperature` for the log-probs."""

    epochs: int
    mini_batch_size: int
    batching: Batching
    shuffle: bool
    seed: int
    temperature: float
    loss: PolicyLossSettings


@dataclass(frozen=True)
class ValueUpdateSettings:
    """One critic update, shaped like the actor's, with the clipped value loss."""

    epochs: int
    mini_batch_size: int
    batching: Batching
    shuffle: bool
    seed: int
    cliprange_value: float
    loss_agg_mode: str


@dataclass(frozen=True)
class PreferenceUpdateSettings:
    """One reward-model update (`megarl train-rm`): `epochs` passes over the rows' pairs in mini-batches of
    `mini_batch_size` pairs per DP rank, one optimizer step each, with the Bradley-Terry loss; `batching`
    counts pairs per micro-batch."""

    epochs: int
    mini_batch_size: int
    batching: Batching
    shuffle: bool
    seed: int


@dataclass(frozen=True)
class WeightSyncSettings:
    """How the actor's weights reach the rollout fleet (`weight_sync` in the recipe); `disk_dir` is the run-local
    directory the disk transport writes to."""

    transport: str
    bucket_mb: float
    verify: str
    timeout_s: float
    disk_dir: str


def _updates_per_step(recipe: Recipe, section) -> int:
    samples = recipe.data.train_batch_size * recipe.rollout.n
    return section.ppo_epochs * (samples // section.ppo_mini_batch_size)


def optimizer_settings(recipe: Recipe, role: str) -> OptimizerSettings:
    """The optimizer of trainable role `role` ("actor" or "critic")."""
    section = recipe.actor if role == "actor" else recipe.critic
    return _optimizer(section.optim, total_steps=recipe.trainer.total_steps * _updates_per_step(recipe, section))


def _optimizer(optim, *, total_steps: int) -> OptimizerSettings:
    return OptimizerSettings(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=tuple(optim.betas),
        eps=optim.eps,
        clip_grad=optim.clip_grad,
        warmup_steps=optim.warmup_steps,
        schedule=optim.schedule,
        min_lr=optim.min_lr,
        total_steps=total_steps,
    )


def _per_rank(recipe: Recipe, role: str, global_size: int) -> int:
    # load_recipe filled in dp for every active training role.
    return global_size // training_layout(recipe, role).dp


def logprob_batching(recipe: Recipe) -> Batching:
    """Micro-batches of the actor's and the reference's log-prob forwards."""
    actor = recipe.actor
    return Batching(actor.logprob_micro_batch_size or actor.ppo_micro_batch_size, actor.max_tokens_per_microbatch)


def policy_update_settings(recipe: Recipe) -> PolicyUpdateSettings:
    actor = recipe.actor
    return PolicyUpdateSettings(
        epochs=actor.ppo_epochs,
        mini_batch_size=_per_rank(recipe, "actor", actor.ppo_mini_batch_size),
        batching=Batching(actor.ppo_micro_batch_size, actor.max_tokens_per_microbatch),
        shuffle=actor.shuffle,
        seed=recipe.seed,
        temperature=recipe.rollout.temperature,
        loss=PolicyLossSettings(
            policy_loss=actor.policy_loss,
            clip_ratio_low=actor.clip_ratio_low,
            clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c,
            loss_agg_mode=actor.loss_agg_mode,
            entropy_coeff=actor.entropy_coeff,
            use_kl_loss=actor.use_kl_loss,
            kl_loss_coef=actor.kl_loss_coef,
            kl_loss_type=actor.kl_loss_type,
        ),
    )


def values_batching(recipe: Recipe) -> Batching:
    """Micro-batches of the critic's value forwards."""
    critic = recipe.critic
    return Batching(critic.ppo_micro_batch_size, critic.max_tokens_per_microbatch)


def value_update_settings(recipe: Recipe) -> ValueUpdateSettings:
    critic = recipe.critic
    return ValueUpdateSettings(
        epochs=critic.ppo_epochs,
        mini_batch_size=_per_rank(recipe, "critic", critic.ppo_mini_batch_size),
        batching=values_batching(recipe),
        shuffle=recipe.actor.shuffle,
        seed=recipe.seed,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode,
    )


def weight_sync_settings(recipe: Recipe, run_dir: Path) -> WeightSyncSettings:
    sync = recipe.weight_sync
    return WeightSyncSettings(
        transport=sync.transport,
        bucket_mb=sync.bucket_mb,
        verify=sync.verify,
        timeout_s=sync.timeout_s,
        disk_dir=str(Path(run_dir) / "weight_sync"),
    )


def reward_scoring_batching(recipe: Recipe) -> Batching:
    """Micro-batches of the reward model's scoring forwards (rows per DP rank)."""
    rm = recipe.reward_model
    return Batching(rm.micro_batch_size, rm.max_tokens_per_microbatch)


def reward_model_optimizer_settings(recipe: Recipe, *, train_pairs: int) -> OptimizerSettings:
    """The reward model's optimizer for `megarl train-rm` over `train_pairs` pairs (epochs x full mini-batches)."""
    train = recipe.reward_model.train
    return _optimizer(train.optim, total_steps=train.epochs * (train_pairs // train.mini_batch_size))


def preference_update_settings(recipe: Recipe) -> PreferenceUpdateSettings:
    """One optimizer step per call: the driver hands each call one global mini-batch of pairs."""
    train = recipe.reward_model.train
    per_rank = _per_rank(recipe, "reward_model", train.mini_batch_size)
    return PreferenceUpdateSettings(epochs=1, mini_batch_size=per_rank,
                                    batching=Batching(train.micro_batch_size, None), shuffle=False, seed=recipe.seed)


def combine_options(recipe: Recipe) -> dict[str, float | None]:
    """The keyword options of the `reward.combine` modes (each mode takes the ones it declares)."""
    reward = recipe.reward
    return {"rule_weight": reward.weights.rule, "rm_weight": reward.weights.rm,
            "pass_threshold": reward.gate.pass_threshold, "fail_score": reward.gate.fail_score}
