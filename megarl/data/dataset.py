"""Prompts for RL: `RLDataset` (parquet rows -> chat-templated token ids) and `PromptLoader`
(deterministic, resumable, endless batches ready for `Batch.from_dict`).

The loader's position is two integers (epoch, samples consumed in it) plus the
seed: each epoch's order is a pure function of seed + epoch, so a run resumed
from `state_dict()` sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from megarl.data.padding import left_pad, position_ids_from_mask
from megarl.data.rows import preview, read_checked_rows
from megarl.errors import InputError

NON_TENSOR_KEYS = ("data_source", "reward_model", "extra_info", "raw_prompt", "index")


def _message_problem(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"is not a non-empty list of messages (got {preview(messages)})"
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            return f"has a message without string 'role' and 'content' (got {preview(message)})"
    return None


# data_source -> check of one ground truth (None when it is usable, else what is wrong with it).
GroundTruthChecks = Mapping[str, Callable[[Any], "str | None"]]


def _row_problems(row: dict, prompt_key: str, ground_truth_checks: GroundTruthChecks) -> list[str]:
    problems = []
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        problems.append(f"data_source is missing or empty (got {preview(row.get('data_source'))})")
    message_problem = _message_problem(row.get(prompt_key))
    if message_problem:
        problems.append(f"{prompt_key} {message_problem}")
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        problems.append(f"reward_model.ground_truth is missing (reward_model = {preview(reward_model)})")
    elif (check := ground_truth_checks.get(row.get("data_source"))) is not None:
        problem = check(reward_model["ground_truth"])
        if problem is not None:
            problems.append(f"reward_model.ground_truth {problem} (got {preview(reward_model['ground_truth'])})")
    return problems


def read_prompt_rows(paths: Sequence[Path], prompt_key: str,
                     ground_truth_checks: GroundTruthChecks | None = None) -> list[dict]:
    """All rows of the parquet files; InputError naming the file and row of every unusable one (a ground truth
    the scorer of its data source could never match, too: `ground_truth_checks`)."""
    if not paths:
        raise InputError("data files: the list is empty")
    return read_checked_rows(paths, what="data file",
                             row_problems=lambda row: _row_problems(row, prompt_key, ground_truth_checks or {}))


def tokenize_prompts(tokenizer: Any, conversations: Sequence[list[dict]],
                     tools: Sequence[dict] | None = None) -> list[list[int]]:
    """Token ids of each conversation under the tokenizer's chat template, ending with the generation prompt;
    `tools` (function schemas) are shown the way the template shows tools (Qwen: in the system prompt)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "")
        raise InputError(f"tokenizer {name!r} has no chat template to format the prompts with")
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                      **({"tools": list(tools)} if tools else {}))
        for messages in conversations
    ]
    # The template already holds every special token the model needs.
    return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


class RLDataset:
    """Rows in the format of docs/data.md (read from parquet files, or generated), with chat-templated prompt token ids
    (showing `tools`, the function schemas of a multi-turn run, where the template shows tools).

    Prompts longer than `max_prompt_length` tokens are dropped (counted in `num_dropped`).
    Item `i` is a dict: input_ids (list[int]), data_source, reward_model, extra_info,
    raw_prompt (the messages) and index (= i, the prompt's id within this dataset).
    `source` names where the rows came from in messages; `num_rows` counts them before the length filter.
    """

    @classmethod
    def from_files(cls, files: Sequence[str | Path], tokenizer: Any, *, max_prompt_length: int,
                   prompt_key: str = "prompt", ground_truth_checks: GroundTruthChecks | None = None,
                   tools: Sequence[dict] | None = None) -> RLDataset:
        """The rows of parquet files, each checked (InputError naming the file and row of every unusable one)."""
        paths = [Path(file) for file in files]
        rows = read_prompt_rows(paths, prompt_key, ground_truth_checks)
        return cls(rows, tokenizer, max_prompt_length=max_prompt_length, prompt_key=prompt_key,
                   source=", ".join(map(str, paths)), tools=tools)

    def __init__(self, rows: Sequence[dict], tokenizer: Any, *, max_prompt_length: int, prompt_key: str = "prompt",
                 source: str = "generated rows", tools: Sequence[dict] | None = None):
        self.source, self.num_rows = source, len(rows)
        token_ids = tokenize_prompts(tokenizer, [row[prompt_key] for row in rows], tools)
        kept = [position for position, ids in enumerate(token_ids) if len(ids) <= max_prompt_length]
        self.num_dropped = len(rows) - len(kept)
        self.input_ids: list[list[int]] = [token_ids[position] for position in kept]
        self.data_sources: list[str] = [rows[position]["data_source"] for position in kept]
        self.reward_models: list[dict] = [rows[position]["reward_model"] for position in kept]
        self.extra_infos: list[dict] = [rows[position].get("extra_info") or {} for position in kept]
        self.raw_prompts: list[list[dict]] = [rows[position][prompt_key] for position in kept]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_id is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad prompts with")

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict:
        return {
            "input_ids": self.input_ids[index],
            "data_source": self.data_sources[index],
            "reward_model": self.reward_models[index],
            "extra_info": self.extra_infos[index],
            "raw_prompt": self.raw_prompts[index],
            "index": index,
        }


def _object_array(values: Sequence[Any]) -> np.ndarray:
    # Element by element: a list of equal-length message lists must stay 1-D.
    array = np.empty(len(values), dtype=object)
    for position, value in enumerate(values):
        array[position] = value
    return array


def collate_prompts(items: Sequence[dict], pad_id: int) -> dict[str, Any]:
    """Dataset items -> {input_ids, attention_mask, position_ids} [B, P] (left-padded) + 1-D object arrays."""
    input_ids, attention_mask = left_pad([item["input_ids"] for item in items], pad_id)
    batch: dict[str, Any] = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
    }
    for key in NON_TENSOR_KEYS:
        batch[key] = _object_array([item[key] for item in items])
    return batch


class PromptLoader:
    """Endless batches of `batch_size` prompts; `next(loader)` gives a dict for `Batch.from_dict`.

    Each epoch visits the dataset in order (shuffle=False) or in a permutation seeded
    with `seed + epoch`. With drop_last, the incomplete tail batch of an epoch is skipped.
    """

    def __init__(self, dataset: RLDataset, batch_size: int, *, shuffle: bool, seed: int, drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0 or (drop_last and len(dataset) < batch_size):
            raise InputError(
                f"data: {len(dataset)} prompts (after length filtering) is fewer than one batch of {batch_size}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0  # samples of the current epoch already handed out
        self._order_epoch: int | None = None
        self._order = np.arange(0)

    @property
    def epoch(self) -> int:
        """The epoch the most recent batch came from (0 before the first batch)."""
        return self._epoch

    @property
    def batches_per_epoch(self) -> int:
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.batches_per_epoch

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self._epoch:
            size = len(self.dataset)
            self._order = (
                np.random.default_rng(self.seed + self._epoch).permutation(size) if self.shuffle else np.arange(size)
            )
            self._order_epoch = self._epoch
        return self._order

    def __iter__(self) -> PromptLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        remaining = len(self.dataset) - self._position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self._epoch += 1
            self._position = 0
        indices = self._epoch_order()[self._position : self._position + self.batch_size]
        self._position += len(indices)
        return collate_prompts([self.dataset[int(index)] for index in indices], self.dataset.pad_id)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue exactly where the loader that produced `state` stopped (its seed included)."""
        epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        if epoch < 0 or not 0 <= position <= len(self.dataset):
            raise ValueError(f"loader state out of range for {len(self.dataset)} prompts: {state}")
        self._epoch, self._position, self.seed = epoch, position, seed
        self._order_epoch = None
