"""Rollout: generation servers and the client that drives them (the only package that knows SGLang).

- `client.RolloutClient`: async HTTP client (blocking facade) for a fleet of
  SGLang-protocol servers: generation and weight updates.
- `results`: `GenerationResult` and `results_to_tensors` for the controller.
- `server.start_cpu_engine`: launch megarl's CPU engine as a subprocess.
- `cpu_engine`: the CPU engine itself (SGLang's HTTP protocol on an HF model).
- `tensor_transport`: the `/update_weights_from_tensor` wire format.
"""

from megarl.rollout.client import RolloutClient, RolloutError
from megarl.rollout.results import GenerationResult, results_to_tensors
from megarl.rollout.server import ServerHandle, ServerStartError, start_cpu_engine

__all__ = [
    "GenerationResult",
    "RolloutClient",
    "RolloutError",
    "ServerHandle",
    "ServerStartError",
    "results_to_tensors",
    "start_cpu_engine",
]
