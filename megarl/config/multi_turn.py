"""Recipe section `rollout.multi_turn`: episodes of several turns with tools and an environment.

Present, it turns every rollout (training and validation) into episodes: the model's
turns, the tools' and the environment's replies in between, and the environment's reward.
The response budget over all turns is `data.max_response_length`: model and environment
tokens together fill one response window. Names resolve through the registries
(`megarl.registry.TOOLS`, `ENVIRONMENTS`, `TOOL_CALL_FORMATS`); a user's tool or environment is
named by its Python path, which validation imports.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from megarl.config.training import Section, registered
from megarl.registry import ENVIRONMENTS, TOOL_CALL_FORMATS, TOOLS


class SandboxConfig(Section):
    """The sandbox pool the tools run in: its size and the limits of one call."""

    workers: PositiveInt = Field(4, description="sandbox worker processes: tool calls that can run at once")
    wall_s: PositiveFloat = Field(10.0, description="wall-clock limit of one tool call, seconds")
    cpu_s: PositiveInt = Field(5, description="CPU-time limit of one tool call, seconds (RLIMIT_CPU)")
    memory_mb: PositiveInt = Field(1024, description="address-space limit of one tool call, MiB (RLIMIT_AS)")
    max_output_bytes: PositiveInt = Field(
        65536, description="a call that prints more than this (stdout, stderr and its result together) is stopped"
    )
    max_processes: PositiveInt = Field(
        32, description="processes a call's user may have (RLIMIT_NPROC; binds where calls run as their own user)"
    )
    max_file_mb: PositiveInt = Field(16, description="largest file a call may write in its scratch dir, MiB")


class MultiTurnConfig(Section):
    environment: str = Field(
        description="the environment that plays each episode: a registered name (tool_use, guessing, remote) or "
        "'package.module:Class' (a megarl.agent.env_base.Environment subclass)"
    )
    environment_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the environment (e.g. remote: url, timeout_s, "
        "retries, backoff_s, max_concurrency, headers)"
    )
    tools: list[str] = Field(
        default_factory=list, description="tools the model may call: registered names (calculator, python) or "
        "'package.module:function'"
    )
    tool_call_format: registered(TOOL_CALL_FORMATS) = Field(
        "hermes", description="how the chat template writes tool calls: hermes (alias qwen): "
        "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    )
    max_turns: PositiveInt = Field(4, description="model turns per episode at most; more is truncation")
    max_tokens_per_turn: PositiveInt | None = Field(
        None, description="tokens one model turn may generate; null = what is left of the response budget"
    )
    max_tool_response_tokens: PositiveInt = Field(
        256, description="a tool's or the environment's message longer than this many tokens is shortened"
    )
    on_truncation: Literal["fixed", "environment"] = Field(
        "fixed", description="reward of an episode cut off by the budget or max_turns: fixed = truncation_reward; "
        "environment = the environment scores it (the cut-off turn included)"
    )
    truncation_reward: float = Field(0.0, description="the reward of a truncated episode with on_truncation: fixed")
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig, description="the tool sandbox pool")

    @field_validator("environment")
    @classmethod
    def _environment_imports(cls, spec: str) -> str:
        return ENVIRONMENTS.check_spec(spec)

    @field_validator("tools")
    @classmethod
    def _tools_import(cls, specs: list[str]) -> list[str]:
        for spec in specs:
            TOOLS.check_spec(spec)
        names = [spec.rpartition(":")[2] for spec in specs]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"two tools would have the same name: {repeated}")
        return specs
