"""Recipe sections for the training side: algorithm, per-role layout and optimizer, actor, critic, reference.

Only field types, defaults and single-field bounds live here; rules that relate
several fields (layout vs pool size, batch divisibility, critic iff GAE) are in
`megarl.config.checks`, so every model stays a plain description of one section.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
)

from megarl.registry import ADVANTAGE_ESTIMATORS, KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES, Registry


def registered(registry: Registry) -> Any:
    """A recipe string that must name an entry of `registry`; `megarl schema` lists the entries as its enum.

    The allowed values are read from the registry when a recipe is validated, so an entry
    registered anywhere (a plug-in module, a test) is usable from a recipe at once.
    """

    def add_enum(schema: dict[str, Any]) -> None:
        schema["enum"] = registry.names()

    return Annotated[str, AfterValidator(registry.check), Field(json_schema_extra=add_enum)]


# Bounds that keep a value usable by what consumes it, so `validate` refuses what `train` could not run.
# Seeds feed numpy, torch and Python generators; all of them take [0, 2**32).
Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
# Python's threading waits refuse timeouts past ~292 years; nothing megarl waits for is longer than a month.
MAX_SECONDS = 30 * 24 * 3600.0
Seconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS)]
# torch.optim.Adam refuses betas outside [0, 1).
Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
# One engine or scorer process per thread/worker; beyond this it is a typo, not a machine.
MAX_THREADS = 1024
# Generated data sets are built in memory before they are written.
MAX_SYNTHETIC_ROWS = 1_000_000
# SGLang samples greedily below this temperature (its _SAMPLING_EPS), with log-probs at temperature 1.
GREEDY_BELOW = 1e-6


def _greedy_or_sampling(value: float) -> float:
    if 0.0 < value < GREEDY_BELOW:
        raise ValueError(f"must be 0 (greedy) or at least {GREEDY_BELOW:g}: SGLang samples greedily below that, "
                         "while the trainer would divide the logits by it")
    return value


Temperature = Annotated[float, Field(ge=0.0), AfterValidator(_greedy_or_sampling)]
INT64 = (-(2**63), 2**63 - 1)

AdvantageEstimator = registered(ADVANTAGE_ESTIMATORS)
KLPenalty = registered(KL_PENALTIES)
LossAggMode = registered(LOSS_AGG_MODES)
PolicyLoss = registered(POLICY_LOSSES)


def _accepts_bool(annotation: Any) -> bool:
    """Whether a field's type admits a real bool (through Optional, unions, Annotated and containers' own types);
    a sub-section checks its own fields."""
    if annotation is bool or annotation is Any or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return True
    return any(_accepts_bool(arg) for arg in get_args(annotation) if not isinstance(arg, (str, int, float)))


def _holds_section(annotation: Any) -> bool:
    """Whether a field's type is (or holds) a sub-section, which checks its own values."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_section(arg) for arg in get_args(annotation))


def _scalars(value: Any) -> list[Any]:
    """`value` itself, or the items of a list/tuple or the values of a mapping (one level: what a field holds)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]


class Section(BaseModel):
    """Base of every recipe model: unknown keys are errors, not silent no-ops, and a bool is never a number."""

    # coerce_numbers_to_str: `name: 2024` in YAML is a run name, not a type error.
    # protected_namespaces=(): `model_path` is a recipe key, not a pydantic method.
    # allow_inf_nan=False: no setting means anything with .inf or .nan (an infinite learning rate or timeout).
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, protected_namespaces=(),
                              allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _bools_are_only_bools(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `rollout.n: true` as 1 and `balance_batch: 1` as true; a recipe that
        # writes one where the other belongs has a mistake in it.
        annotation = cls.model_fields[info.field_name].annotation
        if annotation in (bool, bool | None):
            if not isinstance(value, bool) and value is not None:
                raise ValueError("expected true or false")
        elif not _accepts_bool(annotation) and any(isinstance(item, bool) for item in _scalars(value)):
            raise ValueError("expected a number or a string, not a boolean")
        # Counts and sizes end up in torch, numpy and C code, where an integer past 64 bits overflows.
        if not _holds_section(annotation) and any(
                isinstance(item, int) and not INT64[0] <= item <= INT64[1] for item in _scalars(value)):
            raise ValueError("an integer outside the 64-bit range")
        return value


class KLControl(Section):
    type: Literal["fixed", "adaptive"] = Field("fixed", description="fixed coefficient, or adaptive toward target_kl")
    kl_coef: NonNegativeFloat = Field(0.001, description="KL coefficient (the initial one when adaptive)")
    target_kl: PositiveFloat = Field(0.1, description="adaptive controller: the KL the coefficient steers toward")
    horizon: PositiveInt = Field(
        10000, description="adaptive controller: horizon in samples of the proportional update"
    )


class AlgorithmConfig(Section):
    adv_estimator: AdvantageEstimator = Field(
        description="advantage estimator; 'gae' needs a critic, the others do not"
    )
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="discount factor (GAE)")
    lam: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda")
    norm_adv_by_std_in_grpo: bool = Field(
        True, description="GRPO: divide by the group std; false gives Dr.GRPO (mean-centred only)"
    )
    use_kl_in_reward: bool = Field(False, description="subtract a KL penalty against the reference from the reward")
    kl_penalty: KLPenalty = Field("kl", description="KL estimator used for the in-reward penalty")
    kl_ctrl: KLControl = Field(default_factory=KLControl, description="in-reward KL coefficient controller")


class Parallel(Section):
    tp: PositiveInt = Field(1, description="tensor-parallel size")
    pp: PositiveInt = Field(1, description="pipeline-parallel size")
    vpp: PositiveInt | None = Field(None, description="virtual pipeline stages per rank (interleaved); needs pp > 1")
    ep: PositiveInt = Field(1, description="expert-parallel size (MoE models only)")
    dp: PositiveInt | None = Field(
        None,
        description="data-parallel size; null = world size / (tp*pp). load_recipe fills it in for active roles",
    )
    sequence_parallel: bool = Field(False, description="Megatron sequence parallelism; needs tp > 1")


# The optimizer multiplies float32 tensors by these: past float32's range (~3.4e38) torch refuses the step, and
# long before that the update is meaningless. The bounds leave every sane setting far inside.
MAX_LR = 10.0


class Optim(Section):
    lr: PositiveFloat = Field(le=MAX_LR, description="peak learning rate (at most 10)")
    weight_decay: NonNegativeFloat = Field(0.0, le=MAX_LR, description="decoupled weight decay (AdamW), at most 10")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="Adam betas, each in [0, 1)")
    eps: PositiveFloat = Field(1e-8, le=1.0, description="Adam epsilon (at most 1)")
    clip_grad: NonNegativeFloat = Field(1.0, description="global gradient-norm clip; 0 disables clipping")
    warmup_steps: NonNegativeInt = Field(
        0, description="linear learning-rate warm-up, in optimizer steps (fewer than the run's optimizer steps)"
    )
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="decay after warm-up")
    min_lr: NonNegativeFloat = Field(0.0, le=MAX_LR, description="floor of the cosine/linear decay (at most lr)")


LoraTarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_TARGETS = get_args(LoraTarget)
# The HF linears each Megatron target stands for, in the order the fused weight stacks them.
LORA_HF_LINEARS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                   "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}


class LoraConfig(Section):
    rank: PositiveInt = Field(16, description="LoRA rank r of every adapter")
    alpha: PositiveFloat = Field(32.0, description="LoRA alpha: an adapter adds (alpha / rank) * B A x")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on each adapter's input (training only)")
    target_modules: list[LoraTarget] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="Megatron linears that get adapters: linear_qkv (q/k/v_proj), linear_proj (o_proj), linear_fc1 "
        "(gate/up_proj), linear_fc2 (down_proj); in an MoE model linear_fc1/linear_fc2 adapt every expert",
    )
    init: Literal["kaiming", "gaussian"] = Field(
        "kaiming", description="A's initialisation (B starts at 0): kaiming-uniform as peft's default, or "
        "gaussian N(0, 1/rank)"
    )

    @field_validator("target_modules")
    @classmethod
    def _no_repeats(cls, targets: list[str]) -> list[str]:
        repeated = sorted({name for name in targets if targets.count(name) > 1})
        if repeated:
            raise ValueError(f"each module at most once (repeated: {repeated})")
        return targets


class ActorConfig(Section):
    parallel: Parallel = Field(default_factory=Parallel, description="Megatron layout of the actor")
    optim: Optim = Field(description="actor optimizer")
    ppo_mini_batch_size: PositiveInt = Field(
        description="samples (responses) per optimizer step, global across DP ranks"
    )
    ppo_micro_batch_size: PositiveInt = Field(description="samples per forward/backward pass on one DP rank")
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None, description="pack micro-batches by token count instead of sample count; null = by samples"
    )
    ppo_epochs: PositiveInt = Field(1, description="passes over each step's batch")
    shuffle: bool = Field(True, description="shuffle samples before splitting into mini-batches")
    policy_loss: PolicyLoss = Field(
        "ppo_clip",
        description="the policy loss: ppo_clip (the clipped PPO surrogate with dual clip), gspo (one ratio per "
        "sequence, the geometric mean of its token ratios, clipped per sequence; its paper uses clip_ratio_low "
        "3e-4 and clip_ratio_high 4e-4) or cispo (a clipped, detached importance weight times the log-prob; no "
        "token's gradient is dropped). All read clip_ratio_low/high; only ppo_clip reads clip_ratio_c",
    )
    clip_ratio_low: NonNegativeFloat = Field(0.2, description="PPO clip: ratio lower bound is 1 - clip_ratio_low")
    clip_ratio_high: NonNegativeFloat = Field(0.2, description="PPO clip: ratio upper bound is 1 + clip_ratio_high")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="dual-clip bound for negative advantages (> 1)")
    loss_agg_mode: LossAggMode = Field("token-mean", description="how token losses are averaged into one scalar")
    entropy_coeff: float = Field(0.0, description="entropy bonus coefficient (0 = off)")
    use_kl_loss: bool = Field(False, description="add a KL-to-reference term to the actor loss (GRPO style)")
    kl_loss_coef: NonNegativeFloat = Field(0.001, description="coefficient of the KL loss term")
    kl_loss_type: KLPenalty = Field("low_var_kl", description="KL estimator used in the actor loss")
    logprob_micro_batch_size: PositiveInt | None = Field(
        None, description="samples per rank for log-prob forwards; null = ppo_micro_batch_size"
    )
    lora: LoraConfig | None = Field(
        None, description="train LoRA adapters on a frozen base instead of every weight; the reference policy is "
        "then the actor with its adapters off (no reference engine runs); null = full fine-tuning"
    )


class CriticConfig(Section):
    parallel: Parallel = Field(default_factory=Parallel, description="Megatron layout of the critic")
    optim: Optim = Field(description="critic optimizer")
    model_path: str | None = Field(
        None, description="HF checkpoint for the value model; null = initialise from the actor's weights"
    )
    ppo_mini_batch_size: PositiveInt = Field(description="samples per optimizer step, global across DP ranks")
    ppo_micro_batch_size: PositiveInt = Field(description="samples per forward/backward pass on one DP rank")
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None,
        description="dynamic micro-batching: pack sequences into micro-batches of at most this many tokens "
        "(ppo_micro_batch_size is then ignored); null = fixed micro-batches",
    )
    ppo_epochs: PositiveInt = Field(1, description="passes over each step's batch")
    cliprange_value: PositiveFloat = Field(0.5, description="value clipping range around the old values")
    loss_agg_mode: LossAggMode | None = Field(
        None, description="how token value losses are averaged; null = actor.loss_agg_mode (load_recipe fills it in)"
    )
    warmup_steps: NonNegativeInt = Field(
        0,
        description="the first warmup_steps steps train only the critic; the actor is frozen and no weights "
        "are synced. N freezes the actor for exactly N steps (verl's trainer.critic_warmup: N freezes it for N-1)",
    )


class ReferenceConfig(Section):
    parallel: Parallel = Field(
        default_factory=Parallel,
        description="Megatron layout of the reference policy (used iff use_kl_in_reward or actor.use_kl_loss)",
    )
