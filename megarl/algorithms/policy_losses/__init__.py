"""The built-in policy losses, one module each, registered in `megarl.registry.POLICY_LOSSES` (`actor.policy_loss`).

- `ppo_clip` (default): the clipped PPO surrogate with dual clip, per token.
- `gspo`: one importance ratio per sequence (the geometric mean of its token ratios), clipped per sequence.
- `cispo`: a clipped, detached importance weight times the log-probability; no token's gradient is dropped.

Each is a per-token loss `[B, R]`; `megarl.algorithms.losses.policy_loss` aggregates
it with the recipe's `loss_agg_mode`. A new loss is one module here, decorated with
`policy_loss_fn(name)` and imported below.
"""

from megarl.algorithms.policy_losses.cispo import cispo
from megarl.algorithms.policy_losses.gspo import gspo
from megarl.algorithms.policy_losses.ppo_clip import ppo_clip

__all__ = ["cispo", "gspo", "ppo_clip"]
