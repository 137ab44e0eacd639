"""Rule rewards (GSM8K, MATH), dispatch by `data_source`, and the reward manager.

The reward manager lives in `megarl.rewards.manager` and is not imported here:
reward worker processes import this package and should not pay for torch.
"""

from megarl.rewards.registry import build_scorers, check_data_sources, import_scorer

__all__ = ["build_scorers", "check_data_sources", "import_scorer"]
