"""Next-token sampling for a batch of rows, each with its own sampling parameters.

Log-probs are `log_softmax(logits / temperature)` of the chosen token (raw
logits for greedy rows), computed before top-k/top-p/min-p filtering: the
trainer recomputes exactly this quantity, so the two agree right after a weight
sync. Filtering only changes which token is drawn.

Sampling is an exponential race, `argmax(p / E)` with `E ~ Exp(1)` per token,
which draws token i with probability p_i. A row with its own `torch.Generator`
(a request with `sampling_seed`) draws its noise from that generator alone, so
its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# SGLang treats temperatures below this as greedy decoding (top_k = 1).
GREEDY_TEMPERATURE = 1e-6


@dataclass
class BatchSamplingParams:
    """Per-row sampling parameters as tensors; rows follow the batch order."""

    temperatures: torch.Tensor  # [B] float32; greedy rows hold 1.0
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; vocab size when disabled
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    generators: list[torch.Generator | None]

    @classmethod
    def build(
        cls,
        *,
        temperatures: list[float],
        top_k: list[int],
        top_p: list[float],
        min_p: list[float],
        generators: list[torch.Generator | None],
        vocab_size: int,
    ) -> BatchSamplingParams:
        greedy = torch.tensor([t < GREEDY_TEMPERATURE for t in temperatures])
        return cls(
            temperatures=torch.tensor([1.0 if g else t for t, g in zip(temperatures, greedy.tolist())]),
            greedy=greedy,
            top_k=torch.tensor([vocab_size if k < 0 else min(k, vocab_size) for k in top_k], dtype=torch.long),
            top_p=torch.tensor(top_p, dtype=torch.float32),
            min_p=torch.tensor(min_p, dtype=torch.float32),
            generators=list(generators),
        )

    def concat(self, other: BatchSamplingParams) -> BatchSamplingParams:
        """These rows followed by `other`'s (used when new sequences join the batch)."""
        return BatchSamplingParams(
            temperatures=torch.cat([self.temperatures, other.temperatures]),
            greedy=torch.cat([self.greedy, other.greedy]),
            top_k=torch.cat([self.top_k, other.top_k]),
            top_p=torch.cat([self.top_p, other.top_p]),
            min_p=torch.cat([self.min_p, other.min_p]),
            generators=self.generators + other.generators,
        )

    def select(self, rows: torch.Tensor) -> BatchSamplingParams:
        """Keep only `rows` (used when finished sequences leave the batch)."""
        index = rows.tolist()
        return BatchSamplingParams(
            temperatures=self.temperatures[rows],
            greedy=self.greedy[rows],
            top_k=self.top_k[rows],
            top_p=self.top_p[rows],
            min_p=self.min_p[rows],
            generators=[self.generators[i] for i in index],
        )


def token_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """`log_softmax(logits / temperature)` over the vocabulary; logits [..., V], temperatures broadcastable to [...]."""
    return torch.log_softmax(logits.float() / temperatures.unsqueeze(-1), dim=-1)


def sample_next_tokens(
    logits: torch.Tensor, params: BatchSamplingParams, *, fallback_generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits [B, V] -> (tokens [B] int64, logprobs [B, V] float32)."""
    logprobs = token_logprobs(logits, params.temperatures)
    tokens = logits.argmax(dim=-1)
    sampled_rows = (~params.greedy).nonzero().flatten()
    if sampled_rows.numel() == 0:
        return tokens, logprobs
    probs = _filtered_probs(
        logprobs[sampled_rows],
        top_k=params.top_k[sampled_rows],
        top_p=params.top_p[sampled_rows],
        min_p=params.min_p[sampled_rows],
    )
    noise = _exponential_noise([params.generators[i] for i in sampled_rows.tolist()], probs.shape, fallback_generator)
    tokens[sampled_rows] = (probs / noise).argmax(dim=-1)
    return tokens, logprobs


def _filtered_probs(
    logprobs: torch.Tensor, *, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p, each judged on the unfiltered distribution (as SGLang does)."""
    probs = logprobs.exp()
    vocab_size = probs.shape[-1]
    if bool((top_k >= vocab_size).all()) and bool((top_p >= 1.0).all()) and bool((min_p <= 0.0).all()):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab_size).unsqueeze(0)
    remove = rank >= top_k.unsqueeze(-1)
    # A token survives top-p when the mass strictly before it is below top_p,
    # so the most likely token always survives.
    remove |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p.unsqueeze(-1)
    remove |= sorted_probs < (min_p * sorted_probs[:, 0]).unsqueeze(-1)
    remove[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(remove, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _exponential_noise(
    generators: list[torch.Generator | None], shape: torch.Size, fallback_generator: torch.Generator
) -> torch.Tensor:
    noise = torch.empty(shape).exponential_(generator=fallback_generator)
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # A zero draw would turn 0/0 into NaN for a filtered-out token.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
