"""A multi-turn trajectory as one response of interleaved segments, and a batch of them as tensors.

The response is the model's turns, token ids exactly as generated (`response_mask` 1, with the
engine's log-probs), interleaved with the environment's replies (`response_mask` 0, log-prob 0:
never in the loss, the KL or the entropy). Rewards sit on tokens: a turn's reward on that
turn's last token, the episode's reward on the last token of the model's last turn. Nothing in
a trajectory is ever decoded and encoded again; the text kept per segment is for samples only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

MODEL = "assistant"


@dataclass(frozen=True)
class Segment:
    """One turn: who spoke (`assistant` for the model, else the role the environment used), its text (for
    samples) and its token count."""

    who: str
    text: str
    tokens: int


@dataclass
class Trajectory:
    """Prompt ids plus the growing response; `truncated` is None, "budget" or "max_turns"."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0
    truncated: str | None = None

    @property
    def ids(self) -> list[int]:
        """Everything so far: what the next turn continues from."""
        return self.prompt_ids + self.response_ids

    def add_model_turn(self, ids: list[int], logprobs: list[float], text: str) -> None:
        if len(ids) != len(logprobs):
            raise ValueError(f"a model turn of {len(ids)} tokens came with {len(logprobs)} log-probs")
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs
        self.segments.append(Segment(MODEL, text, len(ids)))
        self.turns += 1

    def add_environment(self, ids: list[int], who: str, text: str) -> None:
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.segments.append(Segment(who, text, len(ids)))

    def reward_last_model_token(self, reward: float) -> None:
        """`reward` on the last token the model generated so far (a turn's or the episode's reward)."""
        last = max((index for index, bit in enumerate(self.mask) if bit), default=None)
        if last is None:
            raise ValueError("a reward before the model generated anything")
        self.rewards.append((last, float(reward)))

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)


def to_tensors(trajectories: list[Trajectory], *, pad_id: int, width: int) -> dict[str, Any]:
    """Right-padded [N, width] `responses`, `response_mask` (model tokens), `response_lengths` [N] (all tokens),
    `rollout_log_probs`, `env_scores` (rewards on their tokens), and per row `num_turns`, `truncated` (bool) and
    `turns` (the segments as {who, text, tokens} dicts, for samples)."""
    too_long = [index for index, t in enumerate(trajectories) if len(t.response_ids) > width]
    if too_long:
        raise ValueError(f"trajectories {too_long[:5]} are longer than the response window of {width} tokens")
    count = len(trajectories)
    responses = torch.full((count, width), pad_id, dtype=torch.long)
    mask = torch.zeros(count, width, dtype=torch.long)
    log_probs = torch.zeros(count, width, dtype=torch.float32)
    scores = torch.zeros(count, width, dtype=torch.float32)
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.response_ids)
        responses[row, :length] = torch.tensor(trajectory.response_ids, dtype=torch.long)
        mask[row, :length] = torch.tensor(trajectory.mask, dtype=torch.long)
        log_probs[row, :length] = torch.tensor(trajectory.logprobs, dtype=torch.float32)
        for position, reward in trajectory.rewards:
            scores[row, position] += reward
    return {
        "responses": responses,
        "response_mask": mask,
        "response_lengths": torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long),
        "rollout_log_probs": log_probs,
        "env_scores": scores,
        "num_turns": [t.turns for t in trajectories],
        "truncated": [t.truncated is not None for t in trajectories],
        "turns": [[asdict(segment) for segment in t.segments] for t in trajectories],
    }
