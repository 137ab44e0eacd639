"""Cross-check (dev only): megarl's policy losses and KL kinds against verl 0.9.1's own functions.

`tests/test_policy_losses.py` checks megarl against a reference written from verl's
definitions, so the suite needs no verl. This script runs verl's functions
themselves (`compute_policy_loss_vanilla`, `_gspo`, `_cispo`, `kl_penalty` with
`k3+`) on the same random inputs (empty rows included, every `loss_agg_mode`) and
prints the largest differences of loss, gradient and metrics. verl 0.9.1 is a
pure-Python wheel whose `core_algos` imports only tensordict, omegaconf and
codetiming beyond what megarl has; it pins transformers < 5.11, so install it into
a separate environment that sees this one's packages:

    python -m venv --system-site-packages /tmp/verlenv
    /tmp/verlenv/bin/pip install --no-deps verl==0.9.1 && /tmp/verlenv/bin/pip install 'tensordict<=0.10' omegaconf codetiming
    PYTHONPATH=$PWD /tmp/verlenv/bin/python benchmarks/verl_policy_losses.py
"""

from __future__ import annotations

import itertools

import torch

from megarl.algorithms.kl import kl_penalty
from megarl.algorithms.losses import policy_loss
from megarl.registry import LOSS_AGG_MODES

ROWS, WIDTH = 16, 24
CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
VERL_NAMES = {"ppo_clip": "vanilla", "gspo": "gspo", "cispo": "cispo"}


def inputs(seed: int) -> dict[str, torch.Tensor]:
    """Off-policy log-probs (a per-row offset, one row 25 nats off), per-token advantages, masks with holes and
    three empty rows."""
    gen = torch.Generator().manual_seed(seed)
    old = -0.2 - 2.0 * torch.rand(ROWS, WIDTH, generator=gen)
    offsets = 0.4 * torch.randn(ROWS, 1, generator=gen)
    offsets[3] = 25.0
    mask = (torch.rand(ROWS, WIDTH, generator=gen) < 0.8).float()
    mask[[1, 5, 11]] = 0.0
    return {"old_log_prob": old, "log_prob": old + offsets + 0.3 * torch.randn(ROWS, WIDTH, generator=gen),
            "advantages": torch.randn(ROWS, WIDTH, generator=gen), "response_mask": mask}


def _loss_and_grad(fn, data: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor, dict[str, float]]:
    log_prob = data["log_prob"].clone().requires_grad_()
    loss, metrics = fn(log_prob)
    loss.backward()
    return float(loss), log_prob.grad, {key: float(value) for key, value in metrics.items()}


def main() -> None:
    from verl.trainer.ppo import core_algos
    from verl.workers.config import ActorConfig

    # Relative to max(1, |verl's value|): a row 25 nats off-policy makes some losses ~1e3.
    worst = {"loss": 0.0, "grad": 0.0, "metrics": 0.0}
    for seed, name, mode in itertools.product(range(5), VERL_NAMES, LOSS_AGG_MODES.names()):
        data = inputs(seed)
        args = (data["old_log_prob"], data["advantages"], data["response_mask"])
        config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode=mode,
                             **CLIP)
        verl_fn = core_algos.get_policy_loss_fn(VERL_NAMES[name])
        theirs = _loss_and_grad(lambda lp: verl_fn(args[0], lp, args[1], args[2], loss_agg_mode=mode,
                                                   config=config), data)
        ours = _loss_and_grad(lambda lp: policy_loss(name, args[0], lp, args[1], args[2], loss_agg_mode=mode,
                                                     **CLIP), data)
        worst["loss"] = max(worst["loss"], abs(theirs[0] - ours[0]) / max(1.0, abs(theirs[0])))
        worst["grad"] = max(worst["grad"], float(((theirs[1] - ours[1]).abs() / theirs[1].abs().clamp(min=1)).max()))
        worst["metrics"] = max(worst["metrics"], max(abs(theirs[2][k] - ours[2][k]) for k in theirs[2]))
        print(f"seed {seed} {name:8s} {mode:24s} loss {ours[0]: .6f} (verl {theirs[0]: .6f})")
    for kind in ("k3+", "low_var_kl+"):
        data = inputs(0)
        theirs = _loss_and_grad(lambda lp: (core_algos.kl_penalty(lp, data["old_log_prob"], kind).sum(), {}), data)
        ours = _loss_and_grad(lambda lp: (kl_penalty(lp, data["old_log_prob"], kind).sum(), {}), data)
        worst["loss"] = max(worst["loss"], abs(theirs[0] - ours[0]) / max(1.0, abs(theirs[0])))
        worst["grad"] = max(worst["grad"], float(((theirs[1] - ours[1]).abs() / theirs[1].abs().clamp(min=1)).max()))
        print(f"kl {kind:12s} sum {ours[0]: .6f} (verl {theirs[0]: .6f})")
    print("largest |megarl - verl| / max(1, |verl|) over all cases (float32): "
          + ", ".join(f"{key} {value:.2e}" for key, value in worst.items()))


if __name__ == "__main__":
    main()
