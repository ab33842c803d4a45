"""Messages to tokens, a turn at a time, with the tokenizer's own chat template.

A trajectory is token ids end to end: the prompt (the first messages with their generation
prompt), then each turn of the model exactly as it was sampled (never decoded and encoded
again), then the environment's messages and the next generation prompt, and so on. So the
template is applied to the environment's messages alone (`continuation`): the template's text
of a fixed short conversation is rendered with and without them, and the difference is what
follows an assistant turn. What the template writes after an assistant's content (Qwen's
``<|im_end|>\\n``) is added where the model's turn did not already end with it.

Tools: where the template takes them (``apply_chat_template(..., tools=schemas)``; the template
refers to ``tools``), it renders them itself. Otherwise the fallback: their schemas go into the
system message with the instructions Qwen2.5's template writes (`toolcalls.FALLBACK_TOOLS_PROMPT`),
the first message's content gaining them or a system message put first; tool results are
``role: tool`` messages, however the template renders that role.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlhf_trainer.environments.base import Message
from rlhf_trainer.environments.toolcalls import tools_system_prompt

_USER, _ASSISTANT = "Hi.", "Hello."
"""The fixed conversation the environment's messages are rendered after."""


def _ids(rendered: Any) -> list[int]:
    ids = rendered["input_ids"] if isinstance(rendered, Mapping) else rendered
    return [int(token) for token in ids]


class ChatFormat:
    """Renders an environment's messages as token ids for one tokenizer and set of tools."""

    def __init__(self, tokenizer: Any, schemas: list[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.schemas = schemas
        template = tokenizer.chat_template
        text = " ".join(template.values()) if isinstance(template, dict) else str(template or "")
        self.native_tools = bool(schemas) and "tools" in text
        """Whether the template renders the tools itself."""
        base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        self._base = self._with_tools(base)
        self._base_text = self._render(self._base, generation_prompt=False)
        end = self._base_text.rfind(_ASSISTANT)
        if end < 0:
            raise ValueError("the chat template drops an assistant message's content")
        self.turn_end = self._base_text[end + len(_ASSISTANT) :]
        """What the template writes after an assistant turn's content."""

    def _with_tools(self, messages: list[Message]) -> list[Message]:
        if not self.schemas or self.native_tools:
            return messages
        tools = tools_system_prompt(self.schemas)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0])
            first["content"] = f"{first.get('content', '')}\n\n{tools}".lstrip()
            return [first, *messages[1:]]
        return [{"role": "system", "content": tools}, *messages]

    def _render(
        self, messages: list[Message], generation_prompt: bool, tokenize: bool = False
    ) -> Any:
        extra = {"tools": self.schemas} if self.native_tools else {}
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=tokenize, **extra
        )

    def prompt(self, messages: list[Message]) -> list[int]:
        """The first messages (with the tools) and the generation prompt, as token ids."""
        return _ids(self._render(self._with_tools(messages), True, tokenize=True))

    def continuation(self, messages: list[Message], stop_token: int | None) -> list[int]:
        """The tokens after a model turn (that ended with `stop_token`, if it did): the rest
        of the template's turn end, `messages`, and the next generation prompt."""
        full = self._render([*self._base, *messages], generation_prompt=True)
        if not full.startswith(self._base_text):
            raise ValueError(
                "the chat template renders earlier messages differently once more follow; "
                "spec.environment cannot append to a trajectory with it"
            )
        ending = self.turn_end
        if stop_token is not None:
            produced = self.tokenizer.decode([stop_token], skip_special_tokens=False)
            if produced and ending.startswith(produced):
                ending = ending[len(produced) :]
        text = ending + full[len(self._base_text) :]
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, token_ids: list[int]) -> str:
        """A turn's text, as the environment reads it (special tokens left out)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
