"""Token-in / token-out chat: the ids of the NEXT messages, never a re-tokenised history.

A multi-turn episode's sequence is ``prompt ids + generated ids + continuation ids + generated ids
...``. The continuation after a model turn (close the assistant turn, add a user / tool message,
open the next assistant turn) is rendered by the tokenizer's own chat template on a placeholder
conversation and cut after the placeholder's content, so only the new text is tokenised. Why not re-render the
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

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, prompt: str, plain_ids: list[int], *, rendered: bool = False) -> list[int]:
        """The first prompt: the chat template around a user message, or the plain ids as they are.
        ``rendered``: the ids already are a rendered chat (an image prompt's, `rlvr.load_image_prompts`)."""
        if not self.chat_template or rendered:
            return list(plain_ids)
        return self._encode(self._render([*self.system, {"role": "user", "content": prompt}], True))

    def continuation_ids(self, messages: list[dict[str, Any]], *, finished: bool) -> list[int]:
        """Ids that follow a model turn: close it, add ``messages`` and open the next assistant turn.

        ``finished``: the turn ended on EOS (then the EOS the model emitted already is the start of
        the template's turn close, and only the rest is added).
        """
        if not self.chat_template:
            return self._encode("".join(str(m["content"]) for m in messages))
        # Everything the template writes after the assistant's content: its turn close, the new
        # messages, the next generation prompt. What it does to the history before the content (Qwen3
        # drops the think block of a turn once another follows) is no concern: those ids are fixed.
        after = self._render([*self.system, {"role": "user", "content": "u"}, _assistant(), *messages], True)
        if after.count(_PLACEHOLDER) != 1:
            raise ValueError(
                "the chat template does not render an earlier assistant message's content as it is, so the next "
                "turn cannot be appended token-in/token-out; use a template that keeps assistant contents"
            )
        tail = after[after.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        eos = self.tokenizer.eos_token
        if finished and eos and tail.startswith(eos):
            tail = tail[len(eos) :]
        return self._encode(tail)


def _assistant() -> dict[str, Any]:
    return {"role": "assistant", "content": _PLACEHOLDER}
