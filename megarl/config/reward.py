"""Recipe sections of the reward phase: rule scorers, the model-side score (reward model, LLM judge or remote
service), how the two combine, and `megarl train-rm`.

A step's reward has two sides (docs/data.md, the README's Rewards). The rule side is the scorer of each
row's `data_source` and is always computed. The model side is at most one of: the
Megatron reward model (`reward_model`), an LLM judge served by its own fleet
(`reward.judge`) or the user's HTTP service (`reward.remote`); its per-row score goes
into the batch as `rm_scores`. `reward.combine` turns the two into the outcome reward
that the reward manager places at the last valid response token
(`token_level_scores`). Validation (`val/score/*`) always reports the rule side.
Cross-field rules are in `megarl.config.checks`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, field_validator

from megarl.config.training import (
    MAX_SYNTHETIC_ROWS,
    MAX_THREADS,
    Optim,
    Parallel,
    Seconds,
    Section,
    Seed,
    Temperature,
    registered,
)
from megarl.registry import JUDGE_PARSERS, REWARD_COMBINE_MODES

_SCORER_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_TEMPLATE_FIELDS = ("prompt", "response", "ground_truth", "data_source")

CombineMode = registered(REWARD_COMBINE_MODES)
JudgeParser = registered(JUDGE_PARSERS)


class CombineWeights(Section):
    rule: float = Field(1.0, description="reward.combine: sum -- weight of the rule score")
    rm: float = Field(1.0, description="reward.combine: sum -- weight of the model-side score (rm_scores)")


class RewardGate(Section):
    pass_threshold: float = Field(
        1.0, description="reward.combine: rule_gated -- a row passes when its rule score is at least this"
    )
    fail_score: float | None = Field(
        None,
        description="reward.combine: rule_gated -- the reward of a row that fails the rule (required with "
        "rule_gated); choose it below every score the model side gives, so any passing response outranks "
        "any failing one",
    )


class JudgeConfig(Section):
    """An LLM judge (generative reward model) on a fleet of its own: the same fleet code and backend as the
    rollout (`rollout.backend`), fixed weights, greedy by default."""

    model_path: str = Field(description="HF causal-LM checkpoint dir of the judge")
    tokenizer: str | None = Field(None, description="tokenizer dir of the judge; null = model_path")
    prompt_template: str = Field(
        description="the judge's user message, a Python format string over {prompt} (the last user message of "
        "the row's prompt), {response} (the decoded response), {ground_truth} and {data_source}; the "
        "judge's chat template is applied to it",
    )
    parser: JudgeParser = Field(
        "score_tag",
        description="how the judge's output becomes a score: score_tag (the number in the last "
        "<score>...</score>; ask for it in prompt_template), last_number (the last number; a verdict ending on a "
        "fraction such as 7/10 is a parse failure), fraction (the last a/b read as a / b: 7/10 is 0.7), yes_no "
        "(a final yes 1, no 0)",
    )
    score_range: tuple[float, float] = Field(
        (0.0, 10.0), description="[lowest, highest] score the judge may give; a parsed score outside is a parse failure"
    )
    parse_fail_score: float | None = Field(
        None,
        description="score of a row whose judge output cannot be parsed (counted in reward/judge_parse_fail, "
        "first output logged); null = the lowest score of score_range: unreadable is the worst grade, so "
        "the policy gains nothing by confusing the judge",
    )
    max_new_tokens: PositiveInt = Field(64, description="tokens the judge may generate per verdict")
    temperature: Temperature = Field(0.0, description="judge sampling temperature; 0 = greedy")
    num_servers: PositiveInt = Field(1, description="servers in the judge fleet")
    tp: PositiveInt = Field(1, description="tensor-parallel size of one judge server")
    max_concurrency: PositiveInt = Field(64, description="in-flight judge requests per server")
    mem_fraction: float = Field(
        0.3, gt=0.0, le=1.0,
        description="SGLang's mem_fraction_static of a judge server: its weights and KV cache take this share of the "
        "accelerator memory free when it starts, which on GPUs it shares with the rollout is what the rollout servers "
        "left (they start first); `megarl plan` shows the judge's KV pool and the peaks it adds")
    engine_threads: PositiveInt = Field(1, le=MAX_THREADS, description="torch threads of one CPU judge engine")
    sglang: dict[str, Any] = Field(default_factory=dict, description="extra SGLang arguments of the judge servers")

    @field_validator("prompt_template")
    @classmethod
    def _known_fields(cls, template: str) -> str:
        import string

        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
        except ValueError as error:
            raise ValueError(f"not a valid format string: {error}") from None
        unknown = sorted(fields - set(_TEMPLATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown fields {unknown}; known: {', '.join(_TEMPLATE_FIELDS)}")
        if "response" not in fields:
            raise ValueError("must contain {response}")
        return template

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if bounds[0] >= bounds[1]:
            raise ValueError("must be [lowest, highest] with lowest < highest")
        return bounds


class RemoteRewardConfig(Section):
    """The user's reward service: one `POST url` per row, JSON in and out (schema in
    `megarl.rewards.remote`). A row that still fails after the retries fails the step naming its uid, or
    leaves its group (`on_failure: drop`); it is never scored 0 in silence. The service is called only when
    `reward.combine` uses the model-side score."""

    url: str = Field(description="http(s) endpoint that scores one row per POST")
    max_concurrency: PositiveInt = Field(32, description="requests in flight at once")
    timeout_s: Seconds = Field(30.0, description="one request may take at most this long")
    # The wait doubles with each retry: 20 of them already reach days.
    retries: NonNegativeInt = Field(3, le=20, description="attempts after the first for a row whose request failed")
    backoff_s: Seconds = Field(0.5, description="wait before the first retry; doubled for each further one")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers sent with every request")
    on_failure: Literal["fail", "drop"] = Field(
        "fail",
        description="a row that still fails after the retries: fail = the step fails naming every such row; "
        "drop = the row leaves its group (no loss, not in its group's baseline, not in the step's score and "
        "length metrics), counted in reward/remote_failed",
    )

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not re.match(r"^https?://[^/\s]+", url):
            raise ValueError("must be an http:// or https:// URL")
        return url


class RewardConfig(Section):
    scorers: dict[str, str] = Field(
        default_factory=dict, description="data_source -> 'module.path:function' custom scorer"
    )
    gsm8k_method: Literal["strict", "flexible"] = Field(
        "strict", description="strict: last '#### <number>'; flexible: last number"
    )
    format_score: float = Field(0.0, description="score of a well-formed but wrong answer")
    score: float = Field(1.0, description="score of a correct answer")
    num_workers: NonNegativeInt = Field(0, le=MAX_THREADS, description="scoring processes; 0 = score in the controller")
    combine: CombineMode = Field(
        "rule",
        description="how the outcome reward is made from the rule score and the model-side score rm_scores "
        "(reward_model, reward.judge or reward.remote): rule = the rule score; rm = the model-side score; "
        "sum = weights.rule * rule + weights.rm * rm; rule_gated = the model-side score where the rule score "
        "reaches gate.pass_threshold, gate.fail_score elsewhere. With 'rule' a configured reward model or judge "
        "is still scored and logged (reward/rm_score, reward/rm_rule_corr), not trained on; a remote service is "
        "not called",
    )
    weights: CombineWeights = Field(default_factory=CombineWeights, description="weights of combine: sum")
    gate: RewardGate = Field(default_factory=RewardGate, description="the gate of combine: rule_gated")
    judge: JudgeConfig | None = Field(None, description="model side: an LLM judge on its own fleet")
    remote: RemoteRewardConfig | None = Field(None, description="model side: the user's HTTP reward service")

    @field_validator("scorers")
    @classmethod
    def _scorer_specs(cls, scorers: dict[str, str]) -> dict[str, str]:
        bad = {source: spec for source, spec in scorers.items() if not _SCORER_SPEC.match(spec)}
        if bad:
            raise ValueError(f"scorers must look like 'package.module:function': {bad}")
        return scorers


class SyntheticPairs(Section):
    task: Literal["addition"] = Field(
        description="preference pairs from the arithmetic task: the reference answer preferred over a wrong one"
    )
    num_train: PositiveInt = Field(le=MAX_SYNTHETIC_ROWS, description="training pairs to generate")
    num_val: PositiveInt = Field(le=MAX_SYNTHETIC_ROWS,
                                 description="validation pairs to generate (problems never in the training pairs)")
    seed: Seed = Field(0, description="generator seed")
    max_operand: PositiveInt = Field(99, description="largest operand of the generated problems")


class RewardModelTraining(Section):
    """`megarl train-rm`: a Bradley-Terry fit, -log sigmoid(score(chosen) - score(rejected) - margin), on
    preference pairs; writes the HF checkpoint the reward-model role loads to `reward_model.path`, with the
    tokenizer's pad id (its EOS when it has no pad token, which the log says; the score is then read before a
    trailing EOS, by HF as in training)."""

    train_files: list[str] = Field(
        default_factory=list,
        description="parquet files of pairs: prompt (chat messages), chosen, rejected (text), and optionally "
        "margin (a number per pair: the loss becomes -log sigmoid(s_c - s_r - margin), as in TRL and OpenRLHF; "
        "0 without the column)",
    )
    val_files: list[str] = Field(default_factory=list, description="validation pairs (same columns)")
    synthetic: SyntheticPairs | None = Field(None, description="generate the pairs instead of reading files")
    init_path: str | None = Field(
        None,
        description="HF checkpoint whose backbone the reward model starts from (its LM head is dropped, the "
        "score head starts at zero); null = the policy's initial weights (model.path, or model.config "
        "seeded with the run seed)",
    )
    sft_steps: NonNegativeInt = Field(
        0,
        description="supervised steps of the backbone on the reference solutions of the RL data (data.*, at "
        "sft_warmup.lr and sft_warmup.batch_size, no early stop) before the Bradley-Terry fit; 0 = none. "
        "InstructGPT starts its reward model from an SFT model: a backbone that solves the task learns to "
        "judge it from far fewer pairs, and one trained further than the policy does not share its mistakes",
    )
    optim: Optim = Field(description="optimizer of the reward model")
    epochs: PositiveInt = Field(1, description="passes over the training pairs")
    mini_batch_size: PositiveInt = Field(description="pairs per optimizer step, global across DP ranks")
    micro_batch_size: PositiveInt = Field(description="pairs per forward/backward on one DP rank")
    val_every: NonNegativeInt = Field(
        0, description="validate every this many optimizer steps (and after the last); 0 = after the last only"
    )
    shuffle: bool = Field(True, description="reshuffle the pairs every epoch")


class RewardModelConfig(Section):
    """The reward-model role: a Megatron engine (the GPT backbone plus a scalar score head read at HF's pooling
    token: the rightmost token that is not the checkpoint's pad_token_id) scoring every generated row."""

    path: str = Field(
        description="HF *ForSequenceClassification checkpoint with num_labels 1 (Skywork-Reward and the "
        "Llama/Qwen reward models are published so); `megarl train-rm` writes its result here",
    )
    tokenizer: str | None = Field(
        None,
        description="the reward model's tokenizer dir; null = the one stored with the checkpoint. When its "
        "vocabulary or chat template differs from the policy's, each response is decoded and the "
        "conversation re-templated for the reward model; otherwise the policy's token ids are scored as they are",
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="parameter/compute dtype; null = model.dtype"
    )
    parallel: Parallel = Field(default_factory=Parallel, description="Megatron layout of the reward model")
    micro_batch_size: PositiveInt = Field(16, description="rows per forward pass on one DP rank")
    max_tokens_per_microbatch: PositiveInt | None = Field(
        None, description="pack scoring micro-batches by token count instead; null = by rows"
    )
    batch_rows: PositiveInt | None = Field(
        64,
        description="rows per reward-model call while generation still runs: a call starts as soon as this many "
        "rows have finished generating, so scoring overlaps generation; null = one call after generation",
    )
    train: RewardModelTraining | None = Field(None, description="how `megarl train-rm` fits this reward model")
