"""Between a generation `Batch` and the fleet: prompts out, generated samples back in as batch columns.

Pure functions (no network): the unpadded prompt of each row, the groups of
rows that share a prompt (the `rollout.n` interleaved copies), and the
assembly of responses into full sequences with masks, positions and engine
log-probs. The controller's phase helpers re-use `prompt_token_lists` and
`assemble_rollout` from here.
"""

from __future__ import annotations

import torch

from megarl.protocol import Batch
from megarl.rollout.results import GenerationResult, results_to_tensors


def prompt_token_lists(gen_batch: Batch) -> list[list[int]]:
    """The unpadded prompt ids of each row (left padding removed by the mask)."""
    ids, mask = gen_batch["input_ids"], gen_batch["attention_mask"].bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


def prompt_groups(prompts: list[list[int]]) -> list[list[int]]:
    """Row indices grouped by runs of identical consecutive prompts.

    A batch repeated `rollout.n` times interleaved has its n copies next to each
    other, so each run is one prompt's samples; the fleet sends a run as one
    request so the server prefills the shared prompt once.
    """
    groups: list[list[int]] = []
    for row, prompt in enumerate(prompts):
        if groups and prompts[groups[-1][0]] == prompt:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def assemble_rollout(
    gen_batch: Batch,
    *,
    responses: torch.Tensor,
    response_lengths: torch.Tensor,
    rollout_log_probs: torch.Tensor,
) -> Batch:
    """prompt [B, P] + response [B, R] -> full sequences with masks and positions continuing the prompt's."""
    prompts, prompt_mask = gen_batch["input_ids"], gen_batch["attention_mask"]
    width = responses.shape[1]
    steps = torch.arange(width).unsqueeze(0)
    response_mask = (steps < response_lengths.unsqueeze(1)).to(prompt_mask.dtype)
    last_position = gen_batch["position_ids"][:, -1:]
    response_positions = last_position + 1 + steps
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "position_ids": torch.cat([gen_batch["position_ids"], response_positions], dim=1),
            "rollout_log_probs": rollout_log_probs * response_mask,
        },
        meta=dict(gen_batch.meta),
    )


def rollout_batch(
    gen_batch: Batch, results: list[GenerationResult], *, pad_id: int, max_response_length: int
) -> Batch:
    """The generated Batch: one row per row of `gen_batch`, in its order.

    Adds `finish_reasons` (non-tensor, "stop"/"length") so `response_length/clip_ratio`
    can be cross-checked, and carries `gen_batch`'s non-tensor columns (e.g. `uid`).
    """
    if len(results) != len(gen_batch):
        raise ValueError(f"rollout_batch: {len(results)} results for a batch of {len(gen_batch)} rows")
    packed = results_to_tensors(results, pad_id=pad_id, max_response_length=max_response_length)
    out = assemble_rollout(
        gen_batch,
        responses=packed["responses"],
        response_lengths=packed["response_lengths"],
        rollout_log_probs=packed["rollout_log_probs"],
    )
    out["finish_reasons"] = packed["finish_reasons"]
    for key, column in gen_batch.non_tensors.items():
        out[key] = column
    return out
