"""Rule rewards (GSM8K, MATH), dispatch by `data_source`, the reward manager, and the parts of the model side
that need no engine: `reward.combine` modes (`combine`), the LLM judge's template and parsers (`judge`), the
remote reward client (`remote`).

The reward manager lives in `megarl.rewards.manager` and is not imported here:
reward worker processes import this package and should not pay for torch.
"""

from megarl.rewards.registry import build_scorers, check_data_sources, import_scorer

__all__ = ["build_scorers", "check_data_sources", "import_scorer"]
