"""Token-in / token-out chat: the ids of the NEXT messages, never a re-tokenised history.

A multi-turn episode's sequence is ``prompt ids + generated ids + continuation ids + generated ids
...``. The continuation after a model turn (close the assistant turn, add a user / tool message,
open the next assistant turn) is rendered by the tokenizer's own chat template on a placeholder
conversation and cut at the placeholder, so only the new text is tokenised. Why not re-render the
whole conversation each turn: many templates are not prefix-stable (Qwen3 drops or inserts think
blocks in earlier assistant turns; BPE merges across a boundary), so the re-tokenised history would
not be the sequence the engine sampled and the behaviour log-probs would belong to other tokens.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ChatCodec"]

_PLACEHOLDER = "\x00SHARDFORGE_ASSISTANT\x00"


class ChatCodec:
    """Renders prompts and continuations as token ids with one tokenizer (and its chat template).

    Args:
        tokenizer: an HF tokenizer.
        chat_template: use the tokenizer's chat template (else: plain text, messages' contents
            are appended as they are).
        system_prompt: optional system message (chat template only).
        tools: JSON schemas of the tools (passed to the template as ``tools=``).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: bool,
        system_prompt: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        if chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "workflow.chat_template=true but the tokenizer has no chat_template; "
                "use a chat model's tokenizer or set workflow.chat_template=false"
            )
        self.tokenizer, self.chat_template, self.tools = tokenizer, chat_template, tools or None
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self._close = self._assistant_close() if chat_template else ""

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _assistant_close(self) -> str:
        """The template's text after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
        base = self._render([*self.system, {"role": "user", "content": "u"}], True)
        full = self._render([*self.system, {"role": "user", "content": "u"}, _assistant()], False)
        return full[full.rindex(_PLACEHOLDER) + len(_PLACEHOLDER) :] if full.startswith(base) else ""

    def prompt_ids(self, prompt: str, plain_ids: list[int]) -> list[int]:
        """The first prompt: the chat template around a user message, or the plain ids as they are."""
        if not self.chat_template:
            return list(plain_ids)
        return self._encode(self._render([*self.system, {"role": "user", "content": prompt}], True))

    def continuation_ids(self, messages: list[dict[str, Any]], *, finished: bool) -> list[int]:
        """Ids that follow a model turn: close it, add ``messages`` and open the next assistant turn.

        ``finished``: the turn ended on EOS (then the EOS the model emitted already is the start of
        the template's turn close, and only the rest is added).
        """
        if not self.chat_template:
            return self._encode("".join(str(m["content"]) for m in messages))
        history = [*self.system, {"role": "user", "content": "u"}, _assistant()]
        before = self._render(history, False)
        after = self._render(history + messages, True)
        if not after.startswith(before):
            raise ValueError(
                "the chat template renders a conversation differently once messages follow it, so the next "
                "turn cannot be appended token-in/token-out; use a template that only appends"
            )
        close = self._close
        eos = self.tokenizer.eos_token
        if finished and eos and close.startswith(eos):
            close = close[len(eos) :]
        return self._encode(close + after[len(before) :])


def _assistant() -> dict[str, Any]:
    return {"role": "assistant", "content": _PLACEHOLDER}
