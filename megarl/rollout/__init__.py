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
"""

from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.dispatch import FleetError
from megarl.rollout.fleet import GenerationInterrupted, RolloutFleet
from megarl.rollout.results import GenerationResult, results_to_tensors
from megarl.rollout.server import ServerHandle, ServerStartError, start_cpu_engine
from megarl.rollout.server_host import ServerSpec

__all__ = [
    "FleetError",
    "GenerationInterrupted",
    "GenerationResult",
    "RolloutClient",
    "RolloutError",
    "RolloutFleet",
    "ServerHandle",
    "ServerSpec",
    "ServerStartError",
    "results_to_tensors",
    "start_cpu_engine",
]
