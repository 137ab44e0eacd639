"""A recipe's plan: every role's memory per GPU, the KV pool, each phase's peak, step times, the verdict.

`plan_recipe(recipe, gpu=...)` reads nothing but the recipe and the model's
config.json (`model.path`, else the inline `model.config`): no weights, no data.
Colocated roles share every GPU of the pool, one rank of each role per GPU; with
`placement.offload` they take turns (`megarl.cluster.memory`): while the fleet
generates the engines hold nothing, while one role trains or runs forwards the
fleet has released its memory and the other roles are offloaded, and during the
sync the actor's weights meet the fleet's. Without offload everything stays
resident. Disaggregated pools are planned one by one. An LLM judge (`reward.judge`)
keeps its weights and KV pool on its GPUs the whole run (it is never released), and
starts after the rollout fleet: on a pool it shares with the fleet, its
`mem_fraction` is a share of what the fleet left free. The search for the largest
micro-batch and the smallest TP re-plans with that one value changed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megarl.config import Recipe, resolve_layout
from megarl.config.layout import FLEET_ROLES, reference_fused
from megarl.config.schema import read_hf_config
from megarl.models.lora import adapter_shapes
from megarl.models.spec import Arch, arch_from_hf
from megarl.plan.gpus import GIB, GpuSpec
from megarl.plan.kv_cache import CONTEXT_BYTES, KvPool, kv_pool
from megarl.plan.memory import DTYPE_BYTES, Layout, RoleMemory, role_memory
from megarl.plan.params import model_params
from megarl.plan.timing import DEFAULT_MFU, PhaseTime, compute_time, generation_time, sync_time

TRAINABLE = ("actor", "critic")


@dataclass(frozen=True)
class Options:
    """What the plan assumes beyond the recipe (command-line flags)."""

    gpu: GpuSpec
    mfu: float = DEFAULT_MFU
    recompute: str = "none"
    distributed_optimizer: bool = False


@dataclass(frozen=True)
class RolePlan:
    role: str
    pool: str
    layout: Layout
    micro_batch: int
    seq_len: int
    memory: RoleMemory

    def describe_layout(self) -> str:
        layout = self.layout
        text = f"tp{layout.tp} pp{layout.pp} dp{layout.dp}"
        text += f" vpp{layout.vpp}" if layout.vpp and layout.vpp > 1 else ""
        text += f" ep{layout.ep}" if layout.ep > 1 else ""
        return text + (" sp" if layout.sequence_parallel else "")


@dataclass(frozen=True)
class Peak:
    """The most one GPU of `pool` holds during `phase`, and by what."""

    phase: str
    pool: str
    bytes: int
    parts: str


@dataclass
class Plan:
    recipe: str
    options: Options
    arch: Arch
    dtype: str
    roles: list[RolePlan]
    fleet_tp: int
    pool: KvPool | None
    judge_pool: KvPool | None
    peaks: list[Peak]
    times: list[PhaseTime]
    problems: list[str]
    largest_micro_batch: dict[str, int | None] = dataclasses.field(default_factory=dict)
    smallest_tp: int | None = None
    judge_tp: int | None = None

    @property
    def fits(self) -> bool:
        return not self.problems


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


@dataclass(frozen=True)
class _Shape:
    """The recipe values the memory model reads, with the two the search changes (`micro`, `tp`)."""

    recipe: Recipe
    arch: Arch
    options: Options
    micro: dict[str, int]
    tp: int | None


def _role_micro(recipe: Recipe, role: str) -> tuple[int, int | None]:
    """(samples per micro-batch, tokens per packed micro-batch or None) of a role's largest pass."""
    actor = recipe.actor
    if role == "actor":
        return actor.ppo_micro_batch_size, actor.max_tokens_per_microbatch
    if role == "critic":
        return recipe.critic.ppo_micro_batch_size, recipe.critic.max_tokens_per_microbatch
    if role == "reward_model":
        return recipe.reward_model.micro_batch_size, recipe.reward_model.max_tokens_per_microbatch
    return actor.logprob_micro_batch_size or actor.ppo_micro_batch_size, None


def _mini_batch(recipe: Recipe, role: str) -> int:
    return (recipe.critic if role == "critic" else recipe.actor).ppo_mini_batch_size


def _lora_params_per_rank(recipe: Recipe, arch: Arch, layout: Layout) -> int:
    lora = recipe.actor.lora
    shapes = adapter_shapes(arch, rank=lora.rank, targets=lora.target_modules)
    return sum(a * b for a, b in shapes.values()) // (layout.tp * layout.pp)


def _role_plans(shape: _Shape) -> list[RolePlan]:
    recipe, arch, options = shape.recipe, shape.arch, shape.options
    seq = recipe.data.max_prompt_length + recipe.data.max_response_length
    plans = []
    for role, resolved in resolve_layout(recipe).items():
        if role in FLEET_ROLES:
            continue
        layout = Layout(tp=shape.tp or resolved.tp, pp=resolved.pp, dp=resolved.dp or 1, vpp=resolved.vpp,
                        ep=resolved.ep, sequence_parallel=resolved.sequence_parallel)
        if shape.tp:
            layout = dataclasses.replace(layout, dp=max(1, resolved.pool.size // (shape.tp * resolved.pp)))
        micro, packed = _role_micro(recipe, role)
        micro = shape.micro.get(role, micro)
        micro_batch, seq_len = (1, packed) if packed else (micro, seq)
        trainable = role in TRAINABLE
        microbatches = max(1, _mini_batch(recipe, role) // (layout.dp * micro)) if trainable else 1
        lora = role == "actor" and recipe.actor.lora is not None
        memory = role_memory(arch, layout=layout, dtype=recipe.model.dtype, trainable=trainable and not lora,
                             value_head=role in ("critic", "reward_model"), micro_batch=micro_batch, seq_len=seq_len,
                             microbatches=microbatches, flash=recipe.placement.device == "cuda",
                             recompute=options.recompute, distributed_optimizer=options.distributed_optimizer)
        if lora:
            adapters = _lora_params_per_rank(recipe, arch, layout)
            trained = role_memory(arch, layout=layout, dtype=recipe.model.dtype, trainable=True, value_head=False,
                                  micro_batch=micro_batch, seq_len=seq_len, microbatches=microbatches,
                                  flash=recipe.placement.device == "cuda", recompute=options.recompute)
            memory = RoleMemory(memory.weights + adapters * DTYPE_BYTES[recipe.model.dtype], adapters * 4,
                                adapters * 12, trained.activations)
        plans.append(RolePlan(role, resolved.pool.name, layout, micro_batch, seq_len, memory))
    return plans


def _engines_left(recipe: Recipe, roles: list[RolePlan], pool_name: str) -> int:
    """What the engines on `pool_name` hold on one of its GPUs while a fleet starts there: their CUDA contexts (none
    for a reference fused into the actor's processes), and their state unless the colocated cycle has offloaded it
    (`megarl.controller.run` puts them to sleep first)."""
    members = [plan for plan in roles if plan.pool == pool_name]
    processes = [plan for plan in members if not (plan.role == "reference" and reference_fused(recipe))]
    offloaded = recipe.placement.colocate and recipe.placement.offload
    return len(processes) * CONTEXT_BYTES + (0 if offloaded else sum(plan.memory.state for plan in members))


def _fleet_pool(recipe: Recipe, arch: Arch, options: Options, roles: list[RolePlan]) -> KvPool:
    rollout = recipe.rollout
    free = options.gpu.memory_bytes - CONTEXT_BYTES - _engines_left(recipe, roles, _pool_of(recipe, "rollout"))
    sequences = math.ceil(recipe.data.train_batch_size * rollout.n / rollout.num_servers)
    return kv_pool(arch, tp=rollout.tp, dtype=recipe.model.dtype, free_bytes=free, mem_fraction=rollout.mem_fraction,
                   sequences=sequences, sequence_tokens=recipe.data.max_prompt_length + recipe.data.max_response_length,
                   max_running=rollout.max_concurrency)


def _pool_of(recipe: Recipe, role: str) -> str:
    return resolve_layout(recipe)[role].pool.name


def _judge_pool(recipe: Recipe, options: Options, roles: list[RolePlan], fleet: KvPool) -> KvPool | None:
    """The judge servers' pool (None without `reward.judge`): from the judge model's config.json, in its checkpoint's
    dtype (SGLang loads it with `--dtype auto`), started after the rollout fleet."""
    judge = recipe.reward.judge
    if judge is None:
        return None
    config = read_hf_config(judge.model_path, key="reward.judge.model_path")
    pool_name = _pool_of(recipe, "judge")
    free = options.gpu.memory_bytes - CONTEXT_BYTES - _engines_left(recipe, roles, pool_name)
    if pool_name == _pool_of(recipe, "rollout"):
        free -= CONTEXT_BYTES + fleet.weight_bytes + fleet.bytes
    dtype = config.get("torch_dtype") or config.get("dtype") or recipe.model.dtype
    data = recipe.data
    sequences = math.ceil(data.train_batch_size * recipe.rollout.n / judge.num_servers)
    # A verdict's prompt holds the row's prompt and response inside the template (its own tokens not counted).
    return kv_pool(arch_from_hf(config), tp=judge.tp, dtype=dtype if dtype in DTYPE_BYTES else recipe.model.dtype,
                   free_bytes=free, mem_fraction=judge.mem_fraction, sequences=sequences,
                   sequence_tokens=data.max_prompt_length + data.max_response_length + judge.max_new_tokens,
                   max_running=judge.max_concurrency)


def _peaks(recipe: Recipe, roles: list[RolePlan], pool: KvPool, judge: KvPool | None) -> list[Peak]:
    """Each phase's per-GPU peak on each pool, with the judge's servers (resident throughout) on theirs."""
    peaks = _engine_and_fleet_peaks(recipe, roles, pool)
    if judge is None:
        return peaks
    judge_pool = _pool_of(recipe, "judge")
    judge_bytes = judge.weight_bytes + judge.bytes + CONTEXT_BYTES
    parts = f" + judge weights {_gib(judge.weight_bytes)} + judge KV pool {_gib(judge.bytes)}"
    with_judge = [dataclasses.replace(peak, bytes=peak.bytes + judge_bytes, parts=peak.parts + parts)
                  if peak.pool == judge_pool else peak for peak in peaks]
    if not any(peak.pool == judge_pool for peak in peaks):
        with_judge.append(Peak("reward:judge", judge_pool, judge_bytes, parts.removeprefix(" + ")))
    return with_judge


def _engine_and_fleet_peaks(recipe: Recipe, roles: list[RolePlan], pool: KvPool) -> list[Peak]:
    fleet_static = pool.weight_bytes + pool.bytes
    peaks = []
    by_pool: dict[str, list[RolePlan]] = {}
    for plan in roles:
        by_pool.setdefault(plan.pool, []).append(plan)
    fleet_pool = _pool_of(recipe, "rollout")
    offload = recipe.placement.colocate and recipe.placement.offload
    for name, members in by_pool.items():
        contexts = (len(members) + (name == fleet_pool)) * CONTEXT_BYTES
        fleet = fleet_static if name == fleet_pool and not offload else 0
        for plan in members:
            others = 0 if offload else sum(other.memory.state for other in members if other is not plan)
            parts = f"{plan.role} {_gib(plan.memory.total)}" + (f" + other roles {_gib(others)}" if others else "")
            parts += f" + fleet {_gib(fleet)}" if fleet else ""
            peaks.append(Peak(f"train:{plan.role}", name, plan.memory.total + others + fleet + contexts, parts))
    if recipe.placement.colocate:
        resident = 0 if offload else sum(plan.memory.state for plan in roles)
        peaks.append(Peak("rollout", fleet_pool, fleet_static + resident + (len(roles) + 1) * CONTEXT_BYTES,
                          f"fleet weights {_gib(pool.weight_bytes)} + KV pool {_gib(pool.bytes)}"
                          + (f" + engines resident {_gib(resident)}" if resident else "")))
        actor = next(plan for plan in roles if plan.role == "actor")
        bucket = recipe.weight_sync.bucket_mb << 20
        sync = actor.memory.weights + pool.weight_bytes + bucket + (len(roles) + 1) * CONTEXT_BYTES
        peaks.append(Peak("update_weights", fleet_pool, sync if offload else max(sync, resident + fleet_static),
                          f"actor weights {_gib(actor.memory.weights)} + fleet weights {_gib(pool.weight_bytes)} "
                          f"+ one bucket {_gib(bucket)}"))
    else:
        peaks.append(Peak("rollout", fleet_pool, fleet_static + CONTEXT_BYTES,
                          f"fleet weights {_gib(pool.weight_bytes)} + KV pool {_gib(pool.bytes)}"))
    return peaks


def _problems(recipe: Recipe, pool: KvPool, judge: KvPool | None, peaks: list[Peak], options: Options) -> list[str]:
    capacity, gpu = options.gpu.memory_bytes, options.gpu.name
    problems = [f"{peak.phase}: {_gib(peak.bytes)} per GPU of pool {peak.pool!r} ({peak.parts}) exceeds the "
                f"{_gib(capacity)} of a {gpu} by {_gib(peak.bytes - capacity)}"
                for peak in peaks if peak.bytes > capacity]
    if pool.tokens < pool.sequence_tokens:
        problems.append(
            f"rollout.mem_fraction: the KV pool of a server GPU holds {pool.tokens} tokens "
            f"({_gib(pool.bytes)} = {recipe.rollout.mem_fraction} x {_gib(pool.free_bytes)} free at its start "
            f"- weights {_gib(pool.weight_bytes)}), less than one sequence of {pool.sequence_tokens} "
            f"(got mem_fraction {recipe.rollout.mem_fraction}, rollout.tp {recipe.rollout.tp})")
    if judge is not None and judge.tokens < judge.sequence_tokens:
        problems.append(
            f"reward.judge.mem_fraction: the KV pool of a judge GPU holds {judge.tokens} tokens "
            f"({_gib(judge.bytes)} = {recipe.reward.judge.mem_fraction} x {_gib(judge.free_bytes)} free at its start "
            f"- weights {_gib(judge.weight_bytes)}), less than one verdict of {judge.sequence_tokens} "
            f"(got mem_fraction {recipe.reward.judge.mem_fraction}, reward.judge.tp {recipe.reward.judge.tp})")
    return problems


def _times(recipe: Recipe, arch: Arch, roles: list[RolePlan], pool: KvPool, options: Options) -> list[PhaseTime]:
    gpu, data = options.gpu, recipe.data
    seq = data.max_prompt_length + data.max_response_length
    tokens = data.train_batch_size * recipe.rollout.n * seq
    times = [generation_time(arch, pool, prompt_tokens=data.max_prompt_length, response_tokens=data.max_response_length,
                             tp=recipe.rollout.tp, bandwidth_gbs=gpu.bandwidth_gbs, tflops=gpu.tflops, mfu=options.mfu)]
    devices = {plan.role: plan.layout.tp * plan.layout.pp * plan.layout.dp for plan in roles}
    common = dict(tokens=tokens, seq_len=seq, tflops=gpu.tflops, mfu=options.mfu)
    forward = dict(backward=False, value_head=False, **common)
    times.append(compute_time("old_log_prob", arch, devices=devices["actor"], **forward))
    if "reference" in devices:
        times.append(compute_time("ref", arch, devices=devices["reference"], **forward))
    if "critic" in devices:
        times.append(compute_time("values", arch, backward=False, value_head=True, devices=devices["critic"], **common))
        times.append(compute_time("update_critic", arch, backward=True, value_head=True, devices=devices["critic"],
                                  passes=recipe.critic.ppo_epochs, **common))
    times.append(compute_time("update_actor", arch, backward=True, value_head=False, devices=devices["actor"],
                              passes=recipe.actor.ppo_epochs, **common))
    model_bytes = model_params(arch) * DTYPE_BYTES[recipe.model.dtype]
    times.append(sync_time(model_bytes=model_bytes, transport=recipe.weight_sync.transport, link_gbs=gpu.link_gbs,
                           bandwidth_gbs=gpu.bandwidth_gbs))
    return times


def _evaluate(shape: _Shape) -> tuple[list[RolePlan], KvPool, KvPool | None, list[Peak], list[str]]:
    roles = _role_plans(shape)
    pool = _fleet_pool(shape.recipe, shape.arch, shape.options, roles)
    judge = _judge_pool(shape.recipe, shape.options, roles, pool)
    peaks = _peaks(shape.recipe, roles, pool, judge)
    return roles, pool, judge, peaks, _problems(shape.recipe, pool, judge, peaks, shape.options)


def _largest_micro_batch(shape: _Shape, role: str, plan: RolePlan) -> int | None:
    """The largest micro-batch of `role` (samples per DP rank, up to its mini-batch share) whose peaks fit."""
    limit = max(1, _mini_batch(shape.recipe, role) // plan.layout.dp)
    best = None
    for micro in sorted({2**k for k in range(limit.bit_length())} | {limit}):
        trial = dataclasses.replace(shape, micro={**shape.micro, role: micro})
        if any(problem.startswith(f"train:{role}") for problem in _evaluate(trial)[4]):
            break
        best = micro
    return best


def _smallest_tp(shape: _Shape) -> int | None:
    """The smallest TP (a divisor of the GPUs per node that the heads and the pool allow) at which it all fits."""
    arch, pool_size = shape.arch, shape.recipe.placement.gpus_per_node
    for tp in range(1, pool_size + 1):
        if pool_size % tp or arch.num_attention_heads % tp or arch.num_query_groups % tp:
            continue
        plans = resolve_layout(shape.recipe)
        if any(layout.pool.size % (tp * layout.pp) for role, layout in plans.items() if role not in FLEET_ROLES):
            continue
        if not _evaluate(dataclasses.replace(shape, tp=tp))[4]:
            return tp
    return None


def plan_recipe(recipe: Recipe, options: Options) -> Plan:
    """The plan of a loaded recipe (`megarl.config.load_recipe`) on `options.gpu`."""
    arch = arch_from_hf(recipe.model.hf_config())
    shape = _Shape(recipe, arch, options, micro={}, tp=None)
    roles, pool, judge, peaks, problems = _evaluate(shape)
    plan = Plan(recipe.name, options, arch, recipe.model.dtype, roles, recipe.rollout.tp, pool, judge, peaks,
                _times(recipe, arch, roles, pool, options), problems,
                judge_tp=None if recipe.reward.judge is None else recipe.reward.judge.tp)
    for role_plan in roles:
        if role_plan.role in TRAINABLE and role_plan.seq_len == recipe.data.max_prompt_length + \
                recipe.data.max_response_length:
            plan.largest_micro_batch[role_plan.role] = _largest_micro_batch(shape, role_plan.role, role_plan)
    plan.smallest_tp = _smallest_tp(shape)
    return plan

