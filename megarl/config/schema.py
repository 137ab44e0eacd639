"""The recipe schema: the root `Recipe` and its non-training sections (model, data, rollout, reward, placement, ...).

Each model states types, defaults and single-field bounds; a `description` on
every field feeds `megarl schema` and editor completion. Cross-field rules live
in `megarl.config.checks`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from megarl.config.async_rollout import ALIAS_CONFIG, ASYNC_FIELD, AsyncRolloutConfig
from megarl.config.multi_turn import MultiTurnConfig
from megarl.config.reward import RewardConfig, RewardModelConfig
from megarl.config.training import (
    MAX_LR,
    MAX_SYNTHETIC_ROWS,
    MAX_THREADS,
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    ReferenceConfig,
    Seconds,
    Section,
    Seed,
    Temperature,
    registered,
)
from megarl.errors import InputError
from megarl.userfiles import directory_problem, file_problem, read_bounded
from megarl.registry import WEIGHT_SYNC_TRANSPORTS

WeightSyncTransport = registered(WEIGHT_SYNC_TRANSPORTS)
Role = Literal["actor", "critic", "reference", "rollout", "reward_model", "judge"]
# An HF config.json is a few KiB; one far larger is not a config.
MAX_CONFIG_BYTES = 16 << 20
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ModelConfig(Section):
    path: str | None = Field(None, description="HF checkpoint dir (config.json + safetensors)")
    config: dict[str, Any] | None = Field(
        None,
        description="inline HF config dict (model_type, hidden_size, ...): alone, a randomly initialised model; "
        "with path, the checkpoint's config (checked against <path>/config.json when that exists, "
        "used for validation where it does not)",
    )
    tokenizer: str = Field("builtin", description="tokenizer dir, or 'builtin' for megarl's in-repo tokenizer")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("bfloat16", description="parameter/compute dtype")
    transformer_impl: Literal["auto", "transformer_engine", "local"] = Field(
        "auto", description="Megatron layer spec: auto = Transformer Engine when it imports and CUDA is present, "
        "else megatron's local layers"
    )

    def hf_config(self) -> dict[str, Any]:
        """The HF config dict: `<path>/config.json` when it exists, else the inline one.

        With both, every key of the inline config must equal the checkpoint's (InputError
        naming each key that differs). InputError when neither is given or readable.
        """
        if self.path is not None and (self.config is None or _config_file(self.path).exists()):
            loaded = read_hf_config(self.path, key="model.path")
            if self.config is not None:
                _check_agrees(self.config, loaded, _config_file(self.path))
            return loaded
        if self.config is not None:
            return dict(self.config)
        raise InputError("model.path: give model.path or model.config (got None)")


def _config_file(checkpoint_dir: str) -> Path:
    return Path(checkpoint_dir).expanduser() / "config.json"


def _check_agrees(inline: dict[str, Any], loaded: dict[str, Any], config_file: Path) -> None:
    """InputError with one line per key of `model.config` that `config_file` does not match."""
    problems = [
        f"model.config.{key}: {config_file} has {loaded.get(key, '<missing>')!r} (got {value!r})"
        for key, value in inline.items()
        if key not in loaded or loaded[key] != value
    ]
    if problems:
        raise InputError(problems)


def read_hf_config(checkpoint_dir: str, *, key: str) -> dict[str, Any]:
    """`<checkpoint_dir>/config.json` as a dict; InputError lines name `key` (the recipe key holding the dir)."""
    config_file = _config_file(checkpoint_dir)
    problem = directory_problem(Path(checkpoint_dir).expanduser())
    if problem not in (None, "no such directory"):
        raise InputError(f"{key}: {problem} (got {checkpoint_dir!r})")
    if file_problem(config_file) == "no such file":
        raise InputError(f"{key}: {config_file} not found (got {checkpoint_dir!r})")
    try:
        loaded = json.loads(read_bounded(config_file, MAX_CONFIG_BYTES))
    except InputError as error:  # not a regular file, or too large for a config
        raise InputError(f"{key}: {error.problems[0]} (got {checkpoint_dir!r})") from None
    except (OSError, ValueError, RecursionError) as error:
        raise InputError(f"{key}: cannot read {config_file}: {error} (got {checkpoint_dir!r})") from None
    if not isinstance(loaded, dict):
        raise InputError(f"{key}: {config_file} is not a JSON object (got {type(loaded).__name__})")
    return loaded


class SyntheticData(Section):
    task: Literal["addition", "random_digits", "guessing"] = Field(
        description="generated task family: addition problems, random digit strings of a fixed token length "
        "(`megarl bench --synthetic`), or number-guessing games for rollout.multi_turn.environment: guessing "
        "(max_operand is the largest secret)"
    )
    num_train: PositiveInt = Field(le=MAX_SYNTHETIC_ROWS, description="training prompts to generate")
    num_val: NonNegativeInt = Field(le=MAX_SYNTHETIC_ROWS, description="validation prompts to generate")
    seed: Seed = Field(0, description="generator seed (independent of the run seed)")
    max_operand: PositiveInt = Field(99, description="largest operand of the generated problems")
    solution: Literal["answer", "worked"] = Field(
        "answer", description="addition: the reference solution (what sft_warmup teaches), `#### <sum>` alone or the "
        "sum worked column by column first (~30 tokens a column, builtin tokenizer), for long responses"
    )
    prompt_length: PositiveInt | None = Field(
        None, description="random_digits: tokens in every prompt after the chat template; null = data.max_prompt_length"
    )


class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list, description="training parquet files (rows as in docs/data.md)")
    val_files: list[str] = Field(default_factory=list, description="validation parquet files")
    synthetic: SyntheticData | None = Field(None, description="generate data into the run dir instead of reading files")
    prompt_key: str = Field("prompt", description="column holding the chat-format prompt")
    max_prompt_length: PositiveInt = Field(description="most tokens in one prompt (after the chat template)")
    max_response_length: PositiveInt = Field(
        description="tokens per response at most; with rollout.multi_turn, the budget of all turns together (the "
        "model's tokens and the tools' and environment's replies)"
    )
    train_batch_size: PositiveInt = Field(description="prompts per training step (before rollout.n repetition)")
    val_batch_size: PositiveInt | None = Field(None, description="prompts per validation batch; null = all at once")
    shuffle: bool = Field(True, description="reshuffle the training set every epoch")


class RolloutConfig(Section):
    model_config = Section.model_config | ALIAS_CONFIG

    backend: Literal["cpu", "sglang"] = Field("sglang", description="SGLang servers, or megarl's CPU engine")
    n: PositiveInt = Field(1, description="responses sampled per prompt")
    temperature: Temperature = Field(
        1.0, description="sampling temperature for training rollouts; 0 = greedy, else at least 1e-6"
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    top_k: int = Field(-1, description="top-k sampling; -1 = off")
    ignore_eos: bool = Field(
        False, description="generate max_response_length tokens every time: neither EOS nor a stop token ends a "
        "response (SGLang's ignore_eos; fixed response lengths for benchmarks)"
    )
    val_temperature: Temperature = Field(0.0, description="temperature for validation; 0 = greedy")
    num_servers: PositiveInt = Field(1, description="inference servers (engines) in the fleet")
    tp: PositiveInt = Field(1, description="tensor-parallel size of one server")
    max_concurrency: PositiveInt = Field(256, description="in-flight requests per server")
    host: str = Field("127.0.0.1", description="address servers bind to")
    port: int | None = Field(
        None, ge=1, le=65535,
        description="port of the first server, the others count up from it; null = free ports picked by the OS "
        "(safe when several runs share a machine)",
    )
    mem_fraction: float = Field(0.8, gt=0.0, le=1.0, description="share of accelerator memory a server may take")
    startup_timeout_s: PositiveFloat = Field(
        900.0,
        description="seconds a starting (or restarted) server may take to answer /health, rollout and judge "
        "servers alike; a server that exits fails at once. 900: SGLang's own tests allow 600 s to launch their "
        "8B model (Llama-3.1-8B) with CUDA-graph capture from a local disk; a fleet reads its checkpoint from a "
        "shared filesystem, every server at once",
    )
    sglang: dict[str, Any] = Field(default_factory=dict, description="extra SGLang server arguments, passed through")
    deterministic: bool = Field(
        False,
        description="start the servers with --enable-deterministic-inference, so each sample's sampling_seed is "
        "honoured: a sample retried on another server, or after a resume, is the same sample. Without it SGLang "
        "ignores the seed. Cost on SGLang: batch-invariant kernels, slower decoding, and only the FlashInfer, FA3 "
        "and Triton attention backends; measure it with megarl bench",
    )
    engine_threads: PositiveInt = Field(1, le=MAX_THREADS, description="torch threads of one CPU engine")
    routing: Literal["client", "router"] = Field(
        "client", description="spread generation requests in megarl's client, or through sglang-router"
    )
    router_policy: Literal["random", "round_robin", "cache_aware", "power_of_two"] = Field(
        "cache_aware", description="sglang-router load-balancing policy (routing: router)"
    )
    multi_turn: MultiTurnConfig | None = Field(
        None, description="episodes of several turns with tools and an environment, rewarded by the environment; "
        "null = one response per prompt"
    )
    async_: AsyncRolloutConfig | None = ASYNC_FIELD

    @field_validator("top_k")
    @classmethod
    def _top_k_off_or_positive(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError("must be -1 (off) or >= 1")
        return value


class PoolSpec(Section):
    nodes: PositiveInt = Field(1, description="nodes in this pool")
    gpus_per_node: PositiveInt = Field(1, description="devices (on CPU: processes) per node in this pool")


class PlacementConfig(Section):
    device: Literal["cuda", "cpu"] = Field("cuda", description="accelerator kind")
    nodes: PositiveInt = Field(1, description="nodes of the allocation")
    gpus_per_node: PositiveInt = Field(1, description="devices per node (on CPU: processes per node)")
    colocate: bool = Field(
        True,
        description="every role (actor, critic, reference, rollout, reward_model, judge) shares one pool of "
        "nodes*gpus_per_node"
    )
    pools: dict[str, PoolSpec] = Field(
        default_factory=dict, description="named resource pools for disaggregated placement (colocate: false)"
    )
    roles: dict[Role, str] = Field(default_factory=dict, description="role -> pool name (colocate: false)")
    offload: bool = Field(
        True,
        description="colocated roles take turns on the devices: the rollout fleet releases its memory while the "
        "engines train, and the engines move optimizer state, gradients and idle weights to host memory while the "
        "fleet generates (only with colocate: true)",
    )


class WeightSyncConfig(Section):
    transport: WeightSyncTransport = Field(
        "tensor", description="tensor: same-device handles (colocated); distributed: broadcast group; disk: files"
    )
    bucket_mb: PositiveInt = Field(512, description="size of one transfer bucket in MiB")
    verify: Literal["none", "checksum"] = Field("none", description="checksum every synced tensor (debugging)")
    timeout_s: Seconds = Field(600.0, description="one sync may take at most this long")
    lora: Literal["merged", "adapter"] = Field(
        "merged", description="with actor.lora: merged = W + (alpha/r) B A of the adapted weights through the "
        "transport (the servers need no LoRA support); adapter = only the adapters, loaded as a LoRA adapter that "
        "every generation names (transport tensor: /load_lora_adapter_from_tensors on colocated servers; disk: "
        "/load_lora_adapter from the run directory, which the servers must see)"
    )


class WandbConfig(Section):
    enabled: bool = Field(False, description="also log metrics to Weights & Biases (needs the `wandb` extra)")
    mode: Literal["offline", "online"] = Field(
        "offline", description="offline: files under <run dir>/wandb only, nothing leaves the machine; online: upload"
    )
    project: str = Field("megarl", description="W&B project")
    entity: str | None = Field(None, description="W&B entity (team or user); null = the account's default")


class LoggingConfig(Section):
    jsonl: bool = Field(True, description="metrics.jsonl in the run dir")
    tensorboard: bool = Field(True, description="TensorBoard event files in the run dir")
    console: bool = Field(True, description="progress on stderr: a bar on a terminal, one line per step "
                          "in a file or pipe (a Slurm log)")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="optional Weights & Biases sink")


class SamplesConfig(Section):
    val_rows: NonNegativeInt = Field(
        32, description="(prompt, response, score, data_source) rows written per validation to "
        "samples/val_step_<N>.jsonl (the first rows of the validation set, the same every time); 0 = none"
    )
    train_rows: NonNegativeInt = Field(
        0, description="training rollouts written per step to samples/train_step_<N>.jsonl; 0 = none"
    )


class CheckpointConfig(Section):
    enabled: bool = Field(
        True, description="write checkpoints (every save_every steps, after the last step, on a stop); false: none "
        "at all (`megarl bench`)"
    )
    save_every: NonNegativeInt = Field(0, description="save every this many steps; 0 = only at the end")
    keep_last: NonNegativeInt = Field(2, description="complete checkpoints kept on disk; 0 = keep all")
    resume: Literal["auto", "never"] = Field(
        "auto", description="auto: continue from the newest complete checkpoint of the run dir; never: start over "
        "(an existing run dir is moved aside, never deleted)"
    )
    weights_only: bool = Field(
        False, description="save weights without optimizer and LR-schedule state (smaller; a resume from such a "
        "checkpoint starts the optimizers afresh, so it is not exact)"
    )
    preempt_timeout_s: Seconds = Field(
        300.0, description="after SIGTERM/SIGINT the run checkpoints and exits within this many seconds; past "
        "that it stops without a new checkpoint"
    )


class TrainerConfig(Section):
    total_steps: PositiveInt = Field(description="RL steps to run")
    val_every: NonNegativeInt = Field(0, description="validate every this many steps; 0 = never")
    val_before_train: bool = Field(True, description="validate once before the first step (when val data exists)")
    output_dir: str = Field("runs", description="run dir is <output_dir>/<name>")
    balance_batch: bool = Field(True, description="reorder samples so DP ranks get equal token counts")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metric sinks")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="checkpoints, resume, preemption")
    samples: SamplesConfig = Field(default_factory=SamplesConfig, description="decoded rollouts written to samples/")


class ClusterConfig(Section):
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment variables set on every node of a launched job (megarl submit, launch/local.sh), "
        "e.g. NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_TIMEOUT, GLOO_SOCKET_IFNAME",
    )

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        bad = sorted(name for name in env if not _ENV_NAME.match(name))
        if bad:
            raise ValueError(f"environment variable names must match [A-Za-z_][A-Za-z0-9_]*: {bad}")
        return env


class SftWarmupConfig(Section):
    steps: NonNegativeInt = Field(
        0, description="most supervised steps on reference solutions before RL; 0 = none"
    )
    stop_loss: PositiveFloat | None = Field(
        None,
        description="end the warm-up early once the mean loss of the last 10 steps falls below this",
    )
    stop_accuracy: float | None = Field(
        None, gt=0.0, le=1.0,
        description="end the warm-up early once this fraction of held-out problems (the first 512 of the "
        "validation set, checked every 5 steps, every step from half the target) has its reference solution "
        "written with every token at a probability above 1/2, so that greedy decoding writes it: a stop at the "
        "competence greedy validation measures, where a loss target is met at another accuracy on another CPU",
    )
    lr: PositiveFloat = Field(1e-3, le=MAX_LR, description="learning rate of the warm-up (at most 10)")
    batch_size: PositiveInt = Field(64, description="samples per warm-up step")


_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class Recipe(Section):
    name: str = Field(
        description="run name: letters, digits, '.', '_' and '-' (a plain directory name); the run dir is "
        "trainer.output_dir/name",
    )
    seed: Seed = Field(0, description="global seed (data order, init, sampling), in [0, 2**32)")
    model: ModelConfig = Field(description="policy model")
    data: DataConfig = Field(description="datasets and lengths")
    algorithm: AlgorithmConfig = Field(description="advantage estimator and in-reward KL")
    actor: ActorConfig = Field(description="policy training")
    critic: CriticConfig | None = Field(None, description="value model; required iff adv_estimator is 'gae'")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="reference policy")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation fleet")
    reward: RewardConfig = Field(
        default_factory=RewardConfig, description="rule scorers, the model-side score and how they combine"
    )
    reward_model: RewardModelConfig | None = Field(
        None, description="model side: a Megatron reward model scoring every row (and `megarl train-rm`)"
    )
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="devices and resource pools")
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig, description="trainer -> rollout sync")
    trainer: TrainerConfig = Field(description="step loop, validation, logging, checkpoints")
    sft_warmup: SftWarmupConfig = Field(default_factory=SftWarmupConfig, description="optional supervised warm-up")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="environment of launched multi-node jobs")

    @field_validator("name")
    @classmethod
    def _plain_directory_name(cls, name: str) -> str:
        # The run dir is output_dir/name: a separator or `..` would put it (and its deletions) elsewhere.
        if not _RUN_NAME.match(name):
            raise ValueError("must be a plain directory name of at most 128 letters, digits, '.', '_' or '-', "
                             "starting with a letter or digit")
        return name
