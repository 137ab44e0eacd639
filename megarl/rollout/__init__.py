"""Rollout: generation servers and the client that drives them (the only package that knows SGLang).

- `fleet.RolloutFleet`: N servers (Ray actors or local), client-side or
  sglang-router routing, generation of a Batch, restart + re-sync of dead servers.
- `client.RolloutClient`: async HTTP client (blocking facade) for a fleet of
  SGLang-protocol servers: generation and weight updates.
- `dispatch`: sending prompt groups with retries, every row exactly once.
- `sampling`: the `/generate` body from the run's `SamplingSettings`, with per-sample seeds.
- `batching`: prompts out of a generation Batch, responses back into one.
- `results`: `GenerationResult` and `results_to_tensors` for the controller.
- `server`: launching a server subprocess (`start_cpu_engine`) and waiting for health.
- `server_host`: the owner of one server process (`ServerSpec`, `ServerHost`).
- `sglang_launcher`: the `sglang.launch_server` command line.
- `router`: an sglang-router subprocess and its worker API.
- `cpu_engine`: the CPU engine itself (SGLang's HTTP protocol on an HF model).
- `weight_wire`: the weight-update wire formats (tensor payloads, digests, update groups), shared with `weightsync`.

Importing the package imports none of them: a Ray actor that hosts a server (`server_host`) or the CPU
engine's own process would otherwise load torch, aiohttp, the fleet and the recipe settings it never uses
(seconds of start-up each). The names below are loaded from their module on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the names are, for readers and type checkers; never run
    from megarl.rollout.client import RolloutClient, RolloutError
    from megarl.rollout.dispatch import FleetError
    from megarl.rollout.fleet import GenerationInterrupted, RolloutFleet
    from megarl.rollout.results import GenerationResult, results_to_tensors
    from megarl.rollout.server import ServerHandle, ServerStartError, start_cpu_engine
    from megarl.rollout.server_host import ServerSpec

_HOMES = {
    "FleetError": "megarl.rollout.dispatch",
    "GenerationInterrupted": "megarl.rollout.fleet",
    "GenerationResult": "megarl.rollout.results",
    "RolloutClient": "megarl.rollout.client",
    "RolloutError": "megarl.rollout.client",
    "RolloutFleet": "megarl.rollout.fleet",
    "ServerHandle": "megarl.rollout.server",
    "ServerSpec": "megarl.rollout.server_host",
    "ServerStartError": "megarl.rollout.server",
    "results_to_tensors": "megarl.rollout.results",
    "start_cpu_engine": "megarl.rollout.server",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
