"""Token ids of what an environment says between two model turns, rendered once with the chat template.

A trajectory never re-tokenizes the conversation: it is the prompt's ids, the ids the model
generated, and, between turns, the ids of the environment's messages. Those are the text the
tokenizer's own chat template puts after a finished assistant turn for them (a `tool` message
in the template's tool role, a `user` message in the user's), through the generation prompt
of the next assistant turn, tokenized once. The text is cut out of a rendering of a probe
conversation: everything after the probe's assistant message and its end-of-turn token. So
whatever a template wraps around tool results (Qwen's `<tool_response>`, grouping of
consecutive tool messages) is what the model reads, exactly as a full rendering would show it.

An environment message longer than `max_tokens` tokens is shortened (its first tokens, then
"... [truncated]") before rendering.
"""

from __future__ import annotations

from typing import Any

_PROBE_USER, _PROBE_ASSISTANT = "megarl-probe-question", "megarl-probe-answer"


class ChatSegments:
    """Renders environment messages for one tokenizer (its chat template and end-of-turn token)."""

    def __init__(self, tokenizer: Any, *, max_tokens: int):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template")
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        self.eos_id = tokenizer.eos_token_id
        self._probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        rendered = self._render(self._probe, generation_prompt=False)
        end = rendered.rindex(_PROBE_ASSISTANT) + len(_PROBE_ASSISTANT)
        eos_text = tokenizer.eos_token or ""
        if not eos_text or not rendered.startswith(eos_text, end):
            raise ValueError(f"chat template: an assistant turn does not end with the EOS token {eos_text!r}; "
                             "megarl cannot tell where the model's turn ends")
        self._before_eos, self._after_eos = end, end + len(eos_text)
        self._probe_prefix = rendered[: self._after_eos]

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, messages: list[dict[str, str]], *, turn_ended_with_eos: bool) -> list[int]:
        """The ids that follow a model turn when the environment says `messages`, through the next assistant
        prompt. When the turn did not end with the end-of-turn token (a stop string ended it), the ids start
        with that token, as the template closes every assistant turn with it."""
        messages = [{**message, "content": self.shorten(message["content"])} for message in messages]
        rendered = self._render(self._probe + messages, generation_prompt=True)
        if not rendered.startswith(self._probe_prefix):
            raise ValueError("chat template: adding messages changed how the earlier turns render")
        text = rendered[self._after_eos if turn_ended_with_eos else self._before_eos:]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def shorten(self, content: str) -> str:
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if len(ids) <= self.max_tokens:
            return content
        return self.tokenizer.decode(ids[: self.max_tokens]) + " ... [truncated]"
