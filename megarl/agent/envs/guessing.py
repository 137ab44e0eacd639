"""`guessing`: a number-guessing game, the made-up environment with state that shows the interface.

The row's ground truth is the secret (an integer between 1 and `high`). Each model turn is
read for its last integer: the game answers "higher", "lower" or "correct" as a `user`
message and remembers the guesses. A correct guess ends the episode with reward 1; every
wrong or unreadable guess costs `step_penalty` at that turn's last token (a per-turn reward),
so a model that halves the interval earns more than one that walks it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from megarl.agent.env_base import Environment, EpisodeRow, Reply, Turn

_INTEGER = re.compile(r"-?\d+")


@dataclass
class _Game:
    secret: int
    guesses: list[int] = field(default_factory=list)


class GuessingEnvironment(Environment):
    """Higher / lower / correct; reward 1 for the right number, `-step_penalty` per other turn."""

    def __init__(self, *, tools=None, step_penalty: float = 0.05, high: int = 100):
        super().__init__(tools=tools)
        self.step_penalty, self.high = float(step_penalty), int(high)

    async def start(self, row: EpisodeRow) -> _Game:
        return _Game(int(str(row.ground_truth)))

    async def step(self, game: _Game, turn: Turn) -> Reply:
        numbers = _INTEGER.findall(turn.text)
        if not numbers:
            return Reply([{"role": "user", "content": f"Say a number between 1 and {self.high}."}],
                         reward=-self.step_penalty)
        guess = int(numbers[-1])
        game.guesses.append(guess)
        if guess == game.secret:
            return Reply([{"role": "user", "content": "correct"}], reward=1.0, done=True)
        hint = "higher" if guess < game.secret else "lower"
        return Reply([{"role": "user", "content": hint}], reward=-self.step_penalty)

    def demonstration(self, row: EpisodeRow) -> list[str] | None:
        """Bisection: the guesses a perfect player makes for this secret."""
        secret, low, high, guesses = int(str(row.ground_truth)), 1, self.high, []
        while True:
            guess = (low + high) // 2
            guesses.append(str(guess))
            if guess == secret:
                return guesses
            low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
