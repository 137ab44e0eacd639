"""The environment registry: the built-in environments, and the user's by Python path.

A recipe names the environment of `rollout.multi_turn` by registered name or by the Python
path of the user's `Environment` subclass, `"package.module:Class"` (`megarl validate`
imports it); `rollout.multi_turn.environment_options` are its keyword arguments. The
interface is `megarl.agent.env_base.Environment`.

| name | what |
|---|---|
| `tool_use` | GSM8K-style rows solved with the run's tools; the answer's rule score ends the episode |
| `guessing` | a number-guessing game with state, per-turn penalties and a final reward |
| `remote` | the user's HTTP service plays the episodes (`megarl.agent.envs.remote`) |
"""

from __future__ import annotations

from megarl.agent.envs.guessing import GuessingEnvironment
from megarl.agent.envs.remote import RemoteEnvironment
from megarl.agent.envs.tool_use import ToolUseEnvironment
from megarl.registry import ENVIRONMENTS

ENVIRONMENTS.add("tool_use", ToolUseEnvironment, uses_tools=True)
ENVIRONMENTS.add("guessing", GuessingEnvironment, uses_tools=False)
ENVIRONMENTS.add("remote", RemoteEnvironment, uses_tools=False)
