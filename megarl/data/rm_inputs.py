"""The reward model's input sequences: the policy's own tokens, or the conversation re-templated for the RM.

When the reward model tokenizes like the policy (same vocabulary, chat template and
EOS) it reads the generated row as it is: prompt ids + response ids. Otherwise, as
verl does, each response is decoded with the policy's tokenizer (special tokens
skipped) and the conversation (the row's prompt messages + an assistant message
holding the response) is rendered with the reward model's chat template and
tokenized by it. Preference pairs for `megarl train-rm` go through the same two
paths from text, so the model is trained on exactly the sequences it will score.
Sequences longer than `max_length` keep their last `max_length` tokens: the score is
read at the end. Rows come back left-padded with positions counting real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megarl.data.padding import left_pad, position_ids_from_mask

Tensor = torch.Tensor


def same_tokenization(rm_tokenizer: Any, policy_tokenizer: Any) -> bool:
    """Whether the reward model can read the policy's token ids as they are."""
    return (
        rm_tokenizer.get_vocab() == policy_tokenizer.get_vocab()
        and rm_tokenizer.chat_template == policy_tokenizer.chat_template
        and rm_tokenizer.eos_token_id == policy_tokenizer.eos_token_id
    )


class RewardModelInputs:
    """Builds reward-model rows (`input_ids`, `attention_mask`, `position_ids` [B, L]) from generated rows or text."""

    def __init__(self, rm_tokenizer: Any, policy_tokenizer: Any, *, max_length: int):
        self.rm_tokenizer, self.policy_tokenizer, self.max_length = rm_tokenizer, policy_tokenizer, max_length
        self.retemplate = not same_tokenization(rm_tokenizer, policy_tokenizer)
        self.pad_id = rm_tokenizer.pad_token_id if rm_tokenizer.pad_token_id is not None else rm_tokenizer.eos_token_id

    def from_generation(self, *, prompt_ids: Sequence[list[int]], response_ids: Sequence[list[int]],
                        messages: Sequence[list[dict]]) -> dict[str, Tensor]:
        """Rows for generated responses: `prompt_ids` (the policy's templated prompt), `response_ids` (as generated,
        EOS included when it stopped) and the prompt `messages` (for re-templating)."""
        if not self.retemplate:
            return self._rows([list(p) + list(r) for p, r in zip(prompt_ids, response_ids)])
        texts = self.policy_tokenizer.batch_decode([list(r) for r in response_ids], skip_special_tokens=True)
        return self.from_text(messages=messages, responses=texts)

    def from_text(self, *, messages: Sequence[list[dict]], responses: Sequence[str]) -> dict[str, Tensor]:
        """Rows for responses given as text: what generation would have produced (shared tokenization, the
        response ending with EOS), or the reward model's chat template over the whole conversation."""
        tokenizer = self.rm_tokenizer
        if self.retemplate:
            texts = [tokenizer.apply_chat_template([*conversation, {"role": "assistant", "content": response}],
                                                   tokenize=False)
                     for conversation, response in zip(messages, responses)]
            return self._rows(tokenizer(texts, add_special_tokens=False)["input_ids"])
        prompts = [tokenizer.apply_chat_template(list(conversation), add_generation_prompt=True, tokenize=False)
                   for conversation in messages]
        prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else []
        response_ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"] if responses else []
        eos = [tokenizer.eos_token_id]  # once: each read of the attribute is a vocabulary lookup (~50 us)
        return self._rows([p + r + eos for p, r in zip(prompt_ids, response_ids)])

    def _rows(self, sequences: list[list[int]]) -> dict[str, Tensor]:
        kept = [sequence[-self.max_length :] for sequence in sequences]
        input_ids, attention_mask = left_pad(kept, self.pad_id)
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "position_ids": position_ids_from_mask(attention_mask)}
