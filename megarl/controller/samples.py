"""Decoded rollouts on disk: `runs/<name>/samples/{val,train}_step_<N>.jsonl`.

One JSON object per row: the step, data_source, prompt and response text (special
tokens kept, padding dropped), the outcome score and the ground truth, so a person can
read what the policy answers at each validation (and, when enabled, in training). A
multi-turn row also lists its turns: who spoke (assistant, tool, user), the text and its
token count.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megarl.protocol import Batch


def decode_rows(batch: Batch, scores: torch.Tensor, tokenizer, *, limit: int) -> list[dict]:
    """The first `limit` rows of a scored rollout batch as readable dicts (`scores` [B]: outcome per row)."""
    prompt_width = batch["prompts"].shape[1]
    rows = []
    for row in range(min(limit, len(batch))):
        mask = batch["attention_mask"][row].bool()
        prompt = batch["prompts"][row][mask[:prompt_width]]
        response = batch["responses"][row][mask[prompt_width:]]
        reward_model = batch["reward_model"][row]
        rows.append({
            "data_source": str(batch["data_source"][row]),
            "prompt": tokenizer.decode(prompt.tolist()),
            "response": tokenizer.decode(response.tolist()),
            "score": float(scores[row]),
            "ground_truth": str(reward_model.get("ground_truth")) if isinstance(reward_model, dict) else None,
            # Episodes: each turn's speaker, text and token count.
            **({"turns": list(batch["turns"][row])} if "turns" in batch else {}),
        })
    return rows


def write_samples(run_dir: Path, kind: str, step: int, rows: list[dict]) -> Path:
    """Write `rows` to `samples/<kind>_step_<step>.jsonl` (replacing a file a resumed run redoes)."""
    path = Path(run_dir) / "samples" / f"{kind}_step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": step, **row}) + "\n" for row in rows))
    return path
