"""An advantage estimator of your own, and a launcher that makes `megarl` know it.

An estimator is one function decorated with `@estimator(name)`. Its parameter names say what
it reads (see `megarl.algorithms.advantages.ESTIMATOR_INPUTS`): `token_level_rewards` and
`response_mask` ([B, R]), `index` ([B], the prompt each sample answers: reading it makes the
estimator need groups, so `rollout.n >= 2`), `values` (reading it makes the run start a critic),
and the settings `gamma`, `lam`, `norm_by_std`. It returns `(advantages, returns)`, both [B, R]
and zero outside the response.

The estimator runs in the driver, so the module that registers it must be imported before
the recipe is read: this file is also a launcher with the `megarl` command line:

    python examples/custom_estimator.py validate recipes/quickstart-grpo-cpu.yaml \\
        --set algorithm.adv_estimator=group_median
    python examples/custom_estimator.py train recipes/quickstart-grpo-cpu.yaml \\
        --set algorithm.adv_estimator=group_median
"""

from __future__ import annotations

import torch

from megarl.algorithms import estimator


@estimator("group_median")
@torch.no_grad()
def group_median(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """A_i = score_i - median of the scores of its group (the responses to the same prompt), on every response
    token; returns = advantages. The median is a baseline that one lucky or broken response cannot move."""
    scores = token_level_rewards.sum(-1)
    groups: dict[object, list[int]] = {}
    for row, uid in enumerate(index):
        groups.setdefault(uid, []).append(row)
    baseline = torch.empty_like(scores)
    for rows in groups.values():
        baseline[rows] = scores[rows].median()  # the lower middle value for an even group, as torch defines it
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


if __name__ == "__main__":
    from megarl.cli import main

    raise SystemExit(main())
