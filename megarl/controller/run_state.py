"""The controller's part of a checkpoint: the step it reached and every piece of its state the future depends on.

`capture` records the step, the weight version the fleet serves, the prompt loader's
position (epoch, samples consumed, shuffle seed), the in-reward KL controller and the
controller process's RNG states (Python, NumPy, torch) as plain JSON; `restore` puts
them back. The engines keep their own state in their checkpoints. The rollout servers
keep none: every sample's seed is a pure function of the run seed, the step and the row
(`megarl.rollout.sampling.sample_seed`), so restoring the step restores them.
"""

from __future__ import annotations

import base64
import random

import numpy as np
import torch


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), position, has_gauss, cached],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["torch"])), dtype=torch.uint8))


def capture(*, step: int, weight_version: int, loader, kl_ctrl) -> dict:
    """Everything the controller needs to continue after `step` completed steps, as JSON-ready data."""
    return {
        "step": step,
        "weight_version": weight_version,
        "loader": loader.state_dict(),
        "kl_ctrl": kl_ctrl.state_dict(),
        "rng": _rng_state(),
    }


def restore(state: dict, *, loader, kl_ctrl) -> None:
    """Put the loader, the KL controller and the RNGs back where `capture` found them."""
    loader.load_state_dict(state["loader"])
    kl_ctrl.load_state_dict(state["kl_ctrl"])
    _set_rng_state(state["rng"])
