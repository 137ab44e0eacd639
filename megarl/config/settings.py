"""Frozen settings the step, the fleets, the engines and the weight sync run with, built once from a validated
recipe: the one road from recipe to runtime settings.

The recipe is the only place defaults live; these objects carry resolved values
(per-rank mini-batch sizes, optimizer steps of the whole run, token ids) to the
controller, to the fleets and across Ray to the engines, which take them whole.
Nothing here has a default of its own, and nothing past this module reads the
recipe for these settings.

`rollout.temperature` is read once, into the run's `SamplingSettings`: the fleet
samples with it, and the log-prob pass (`StepSettings.sampling`) and the loss
(`PolicyUpdateSettings.temperature`) take it from that object, so the engines score
the distribution the responses were drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megarl.config.layout import training_layout
from megarl.config.schema import Recipe
from megarl.config.training import LORA_HF_LINEARS


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
class LoraSettings:
    """The actor's LoRA adapters (`actor.lora`): rank r, alpha (the update is scaled by alpha / r), dropout on
    the adapter's input, the Megatron linears adapted, how A is initialised (B starts at 0) and from which seed."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    init: str
    seed: int


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
    DP rank, one optimizer step each; the log-probs at the rollout's sampling `temperature`."""

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
    """How the actor's weights reach the rollout fleet (`weight_sync` in the recipe): buckets of at most
    `bucket_bytes` (the recipe's `bucket_mb` MiB); `disk_dir` is the run-local directory the disk transport
    writes to; `pause_mode` how a sync meets running requests (SGLang's `pause_generation` mode, or None)."""

    transport: str
    bucket_bytes: int
    verify: str
    timeout_s: float
    disk_dir: str
    lora: str  # with LoRA: "merged" weights, or "adapter" only
    # How a sync meets running requests: pause them "in_place" (they go on under the new weights), "abort" them
    # (partial rollouts re-send them), or None: the update waits for them to finish.
    pause_mode: str | None = "in_place"


@dataclass(frozen=True)
class SamplingSettings:
    """How a fleet samples, in SGLang's `sampling_params` terms (less the per-sample seed, which each request
    derives from the call's seed): at most `max_new_tokens` per response, `temperature` (0: greedy), `top_p`,
    `top_k` (-1: off); a response ends at one of `stop_token_ids` unless `ignore_eos`."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool


@dataclass(frozen=True)
class AsyncSettings:
    """Asynchronous RL (`rollout.async`): generation up to `max_staleness` weight versions ahead; weight syncs
    while requests are paused in place (`in_flight_updates`) or, with `partial_rollouts`, after aborting them
    and re-sending what they generated; stale tokens corrected with `correction_mode` ("truncate", "mask" or
    "off") at `correction_level` ("token" or "sequence") with the cap `correction_cap`."""

    max_staleness: int
    in_flight_updates: bool
    partial_rollouts: bool
    correction_mode: str
    correction_level: str
    correction_cap: float


@dataclass(frozen=True)
class StepSettings:
    """The per-step knobs of `Trainer.step`: `rollout_n` responses per prompt drawn with `sampling` (whose
    temperature the log-prob pass uses too), the advantage estimator and its options, the KL-in-reward
    penalty, batch balancing, the critic's warm-up steps and `num_devices`, every device of the placement
    (perf/throughput is per device); `async_rollout` for asynchronous RL (None: synchronous)."""

    rollout_n: int
    sampling: SamplingSettings
    max_prompt_length: int
    max_response_length: int
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std: bool
    use_kl_in_reward: bool
    kl_penalty: str
    balance_batch: bool
    critic_warmup: int
    num_devices: int
    async_rollout: AsyncSettings | None = None


@dataclass(frozen=True)
class FleetSettings:
    """A fleet of generation servers: `num_servers` of `backend` ("cpu" or "sglang") over `tp` devices each,
    bound to `bind` (from `port` up, or free ports), with `threads` torch threads (CPU engine) or
    `mem_fraction` of the device and `sglang_args` (SGLang); `enable_memory_saver` lets it release memory
    between phases. Requests: `max_concurrency` per server, spread by `routing` ("client" or "router" with
    `router_policy`), seeded from `seed` (honoured with `deterministic`: --enable-deterministic-inference); a
    CPU engine takes at most `max_sequences` sequences per request (None: its default); a server has
    `startup_timeout_s` to come up. `model_path` and `tokenizer_path`: fixed weights (the judge), or None for
    the run's initial weights (the policy)."""

    backend: str
    num_servers: int
    tp: int
    bind: str
    port: int | None
    threads: int
    mem_fraction: float
    sglang_args: dict[str, Any]
    enable_memory_saver: bool
    enable_weights_cpu_backup: bool  # released weights come back from a host copy (a LoRA policy's frozen base)
    max_concurrency: int
    routing: str
    router_policy: str
    seed: int
    startup_timeout_s: float
    model_path: str | None
    tokenizer_path: str | None
    # With the adapter-only LoRA sync: the servers serve LoRA adapters of at most this rank on these HF modules,
    # and every generation names the current version's adapter (None / (): no LoRA serving).
    lora_max_rank: int | None
    lora_target_modules: tuple[str, ...]
    deterministic: bool = False
    max_sequences: int | None = None


@dataclass(frozen=True)
class EngineSettings:
    """One Megatron engine group: `kind` ("policy": actor or reference, "value": critic, "reward": reward
    model), its `parallel` layout (tp, pp, vpp, ep, ...), `seed`, `params_dtype`, `transformer_impl`, and its
    `optimizer` (None: frozen)."""

    kind: str
    parallel: dict[str, Any]
    seed: int
    params_dtype: str
    transformer_impl: str
    optimizer: OptimizerSettings | None
    lora: LoraSettings | None  # a policy of LoRA adapters on a frozen base (the actor with `actor.lora`)


@dataclass(frozen=True)
class EpisodeSettings:
    """The episodes of `rollout.multi_turn`: `budget` response tokens over all turns (model and environment),
    `max_tokens_per_turn` of one turn (None: the budget left), the reward of a truncated episode
    (`on_truncation`: fixed = `truncation_reward`, or environment)."""

    max_turns: int
    budget: int
    on_truncation: str
    truncation_reward: float
    max_tokens_per_turn: int | None


@dataclass(frozen=True)
class SandboxSettings:
    """The tool sandbox: `workers` processes; per call `wall_s` and `cpu_s` seconds, `memory_mb` of address space,
    `max_output_bytes` of output, `max_processes` processes, files of `max_file_mb`."""

    workers: int
    wall_s: float
    cpu_s: int
    memory_mb: int
    max_output_bytes: int
    max_processes: int
    max_file_mb: int


@dataclass(frozen=True)
class MultiTurnSettings:
    """`rollout.multi_turn` resolved: the environment (registered name or Python path) and its keyword
    options, the tools, the tool-call format, the longest tool or environment message in tokens, the
    sandbox, and how episodes run."""

    environment: str
    environment_options: dict[str, Any]
    tools: tuple[str, ...]
    tool_call_format: str
    max_tool_response_tokens: int
    sandbox: SandboxSettings
    episodes: EpisodeSettings


def multi_turn_settings(recipe: Recipe) -> MultiTurnSettings | None:
    """The run's multi-turn settings, or None when every rollout is one response. The budget of all turns of an
    episode is `data.max_response_length`."""
    multi_turn = recipe.rollout.multi_turn
    if multi_turn is None:
        return None
    sandbox = multi_turn.sandbox
    return MultiTurnSettings(
        environment=multi_turn.environment,
        environment_options=dict(multi_turn.environment_options),
        tools=tuple(multi_turn.tools),
        tool_call_format=multi_turn.tool_call_format,
        max_tool_response_tokens=multi_turn.max_tool_response_tokens,
        sandbox=SandboxSettings(workers=sandbox.workers, wall_s=sandbox.wall_s, cpu_s=sandbox.cpu_s,
                                memory_mb=sandbox.memory_mb, max_output_bytes=sandbox.max_output_bytes,
                                max_processes=sandbox.max_processes, max_file_mb=sandbox.max_file_mb),
        episodes=EpisodeSettings(max_turns=multi_turn.max_turns, budget=recipe.data.max_response_length,
                                 on_truncation=multi_turn.on_truncation,
                                 truncation_reward=multi_turn.truncation_reward,
                                 max_tokens_per_turn=multi_turn.max_tokens_per_turn),
    )


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


def policy_update_settings(recipe: Recipe, *, sampling: SamplingSettings) -> PolicyUpdateSettings:
    """The actor's update; its log-probs at the temperature of `sampling`, the run's `rollout_sampling`."""
    actor = recipe.actor
    return PolicyUpdateSettings(
        epochs=actor.ppo_epochs,
        mini_batch_size=_per_rank(recipe, "actor", actor.ppo_mini_batch_size),
        batching=Batching(actor.ppo_micro_batch_size, actor.max_tokens_per_microbatch),
        shuffle=actor.shuffle,
        seed=recipe.seed,
        temperature=sampling.temperature,
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
        bucket_bytes=sync.bucket_mb << 20,
        verify=sync.verify,
        timeout_s=sync.timeout_s,
        disk_dir=str(Path(run_dir) / "weight_sync"),
        lora=sync.lora,
        pause_mode=_pause_mode(recipe),
    )


def _pause_mode(recipe: Recipe) -> str | None:
    """The synchronous loop syncs between generations (nothing runs: in place, as ever); asynchronous RL pauses in
    place only with in-flight updates, aborts with partial rollouts, else lets the update wait."""
    section = recipe.rollout.async_
    if section is None or section.in_flight_updates:
        return "in_place"
    return "abort" if section.partial_rollouts else None


def lora_settings(recipe: Recipe) -> LoraSettings | None:
    """The actor's LoRA adapters (None: full fine-tuning); adapters are initialised from the run seed."""
    lora = recipe.actor.lora
    if lora is None:
        return None
    return LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=tuple(lora.target_modules),
                        init=lora.init, seed=recipe.seed)


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


def rollout_sampling(recipe: Recipe, *, eos_token_id: int) -> SamplingSettings:
    """How training rollouts sample: `rollout.temperature`, `top_p`, `top_k`, `ignore_eos`, at most
    `data.max_response_length` tokens, ending at the policy tokenizer's `eos_token_id`."""
    rollout = recipe.rollout
    return SamplingSettings(max_new_tokens=recipe.data.max_response_length, temperature=rollout.temperature,
                            top_p=rollout.top_p, top_k=rollout.top_k, stop_token_ids=(eos_token_id,),
                            ignore_eos=rollout.ignore_eos)


def validation_sampling(recipe: Recipe, *, eos_token_id: int) -> SamplingSettings:
    """The training rollouts' sampling at `rollout.val_temperature` (0: greedy)."""
    return replace(rollout_sampling(recipe, eos_token_id=eos_token_id), temperature=recipe.rollout.val_temperature)


def judge_sampling(recipe: Recipe, *, eos_token_id: int) -> SamplingSettings:
    """The LLM judge's verdicts: `reward.judge.max_new_tokens` at `reward.judge.temperature`, no top-p or top-k,
    ending at the judge tokenizer's `eos_token_id`."""
    judge = recipe.reward.judge
    return SamplingSettings(max_new_tokens=judge.max_new_tokens, temperature=judge.temperature, top_p=1.0, top_k=-1,
                            stop_token_ids=(eos_token_id,), ignore_eos=False)


def step_settings(recipe: Recipe, *, sampling: SamplingSettings, num_devices: int) -> StepSettings:
    """`Trainer.step`'s settings; `sampling` is the run's `rollout_sampling`."""
    algo = recipe.algorithm
    return StepSettings(
        rollout_n=recipe.rollout.n,
        sampling=sampling,
        max_prompt_length=recipe.data.max_prompt_length,
        max_response_length=recipe.data.max_response_length,
        adv_estimator=algo.adv_estimator,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_adv_by_std=algo.norm_adv_by_std_in_grpo,
        use_kl_in_reward=algo.use_kl_in_reward,
        kl_penalty=algo.kl_penalty,
        balance_batch=recipe.trainer.balance_batch,
        critic_warmup=recipe.critic.warmup_steps if recipe.critic else 0,
        num_devices=num_devices,
        async_rollout=async_settings(recipe),
    )


def async_settings(recipe: Recipe) -> AsyncSettings | None:
    """`rollout.async`'s settings, None for the synchronous loop."""
    section = recipe.rollout.async_
    if section is None:
        return None
    correction = section.correction
    return AsyncSettings(max_staleness=section.max_staleness, in_flight_updates=section.in_flight_updates,
                         partial_rollouts=section.partial_rollouts, correction_mode=correction.mode,
                         correction_level=correction.level, correction_cap=correction.cap)


def sleeps_between_phases(recipe: Recipe) -> bool:
    """Whether the fleet and the engines take turns on the devices (colocated and `placement.offload`)."""
    return recipe.placement.colocate and recipe.placement.offload


def rollout_fleet_settings(recipe: Recipe) -> FleetSettings:
    """The policy's fleet (`rollout`): it starts from the run's initial weights and takes every sync."""
    rollout = recipe.rollout
    return FleetSettings(
        backend=rollout.backend, num_servers=rollout.num_servers, tp=rollout.tp, bind=rollout.host,
        port=rollout.port, threads=rollout.engine_threads, mem_fraction=rollout.mem_fraction,
        sglang_args=dict(rollout.sglang), enable_memory_saver=sleeps_between_phases(recipe),
        # A LoRA sync moves only what the adapters change: the servers keep the frozen rest in host memory while
        # they release their weights for the trainer.
        enable_weights_cpu_backup=sleeps_between_phases(recipe) and recipe.actor.lora is not None,
        max_concurrency=rollout.max_concurrency, routing=rollout.routing, router_policy=rollout.router_policy,
        seed=recipe.seed, startup_timeout_s=rollout.startup_timeout_s, model_path=None, tokenizer_path=None,
        **_lora_serving(recipe),
        # One request carries one prompt's group of samples: a larger one is no request of this run's.
        deterministic=rollout.deterministic, max_sequences=rollout.n,
    )


def _lora_serving(recipe: Recipe) -> dict[str, Any]:
    """The policy fleet's LoRA serving: on with the adapter-only sync, sized by the adapters' rank and targets."""
    lora = recipe.actor.lora
    if lora is None or recipe.weight_sync.lora != "adapter":
        return {"lora_max_rank": None, "lora_target_modules": ()}
    modules = sorted(linear for target in lora.target_modules for linear in LORA_HF_LINEARS[target])
    return {"lora_max_rank": lora.rank, "lora_target_modules": tuple(modules)}


def judge_fleet_settings(recipe: Recipe) -> FleetSettings:
    """The LLM judge's fleet (`reward.judge`): the rollout's backend, address and start-up time, fixed weights,
    client-side routing, never released between phases."""
    judge, rollout = recipe.reward.judge, recipe.rollout
    return FleetSettings(
        backend=rollout.backend, num_servers=judge.num_servers, tp=judge.tp, bind=rollout.host, port=None,
        threads=judge.engine_threads, mem_fraction=judge.mem_fraction, sglang_args=dict(judge.sglang),
        enable_memory_saver=False, max_concurrency=judge.max_concurrency, routing="client",
        router_policy=rollout.router_policy, seed=recipe.seed, startup_timeout_s=rollout.startup_timeout_s,
        model_path=judge.model_path, tokenizer_path=judge.tokenizer or judge.model_path,
        deterministic=rollout.deterministic, enable_weights_cpu_backup=False, lora_max_rank=None,
        lora_target_modules=(),
    )


_ENGINE_KINDS = {"actor": "policy", "reference": "policy", "critic": "value", "reward_model": "reward"}


def engine_settings(recipe: Recipe, role: str, *, train_pairs: int | None = None) -> EngineSettings:
    """The engine group of `role` ("actor", "reference", "critic", "reward_model") on the role's layout: the
    actor and the critic with their optimizers, the reference and the reward model frozen, unless
    `train_pairs` (`megarl train-rm`) gives the reward model its optimizer over that many pairs."""
    if role in ("actor", "critic"):
        optimizer = optimizer_settings(recipe, role)
    elif role == "reward_model" and train_pairs is not None:
        optimizer = reward_model_optimizer_settings(recipe, train_pairs=train_pairs)
    else:
        optimizer = None
    dtype = recipe.model.dtype
    if role == "reward_model":
        dtype = recipe.reward_model.dtype or dtype
    return EngineSettings(kind=_ENGINE_KINDS[role], parallel=getattr(recipe, role).parallel.model_dump(),
                          seed=recipe.seed, params_dtype=dtype, transformer_impl=recipe.model.transformer_impl,
                          optimizer=optimizer, lora=lora_settings(recipe) if role == "actor" else None)


def warmup_engine_settings(recipe: Recipe, *, layout_of: str) -> EngineSettings:
    """The SFT warm-up's engine: the actor's (policy kind, model dtype, optimizer) on the layout of role
    `layout_of` (the actor's in `megarl train` and `megarl warmup`, the reward model's for its backbone)."""
    # The warm-up trains the whole model: a LoRA run starts from its output (model.path), never from inside it.
    return replace(engine_settings(recipe, "actor"), parallel=getattr(recipe, layout_of).parallel.model_dump(),
                   lora=None)
