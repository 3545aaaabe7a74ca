"""The SFT datums the `shardforge serve` tests train on, and their training steps (needs the ``tinker`` SDK)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["sft_datums", "train_steps"]


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


def train_steps(
    trainer: Any, batches: Sequence[Sequence[Any]], adam: Any, *, loss: str = "cross_entropy", timeout: float = 120
) -> list[tuple[float, float]]:
    """One ``forward_backward`` (``loss``) + ``optim_step`` (``adam``) per batch, both sent before either is awaited,
    as tinker-cookbook does; per step its ``loss:sum`` and the step's ``grad_norm:mean``."""
    out = []
    for batch in batches:
        fwdbwd = trainer.forward_backward(list(batch), loss)
        step = trainer.optim_step(adam)
        value = fwdbwd.result(timeout=timeout).metrics["loss:sum"]
        out.append((value, step.result(timeout=timeout).metrics["grad_norm:mean"]))
    return out
