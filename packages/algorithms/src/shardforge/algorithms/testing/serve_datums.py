"""The SFT datums the `shardforge serve` tests train on (needs the ``tinker`` SDK)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["sft_datums"]


def sft_datums(tokenizer: Any, texts: Sequence[str], *, prompt_targets: int = 2) -> list[Any]:
    """One ``tinker.types.Datum`` per text: the text's ids shifted by one (inputs ``ids[:-1]``, targets ``ids[1:]``),
    weight 0 on the first ``prompt_targets`` targets (a prompt) and 1 on the rest."""
    from tinker import types

    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        weights = [0.0] * prompt_targets + [1.0] * (len(ids) - 1 - prompt_targets)
        inputs: dict[str, Any] = {"target_tokens": ids[1:], "weights": weights}  # the SDK converts the lists
        out.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs))
    return out
