"""`LoRAConfig`: which Linear layers get adapters, their rank, scaling and initialisation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["LoRAConfig"]

_INITS = ("kaiming", "gaussian", "random")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters ``W x + scaling * B (A dropout(x))`` on chosen ``nn.Linear`` modules (Hu et al., 2021).

    Field names and semantics follow PEFT's ``LoraConfig`` so an exported adapter means the same thing there.
    """

    r: int = 8
    """Adapter rank (A is [r, in_features], B is [out_features, r])."""
    alpha: float = 16.0
    """Scaling numerator: scaling = alpha / r (alpha / sqrt(r) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input (training only; the base path never sees it)."""
    target_modules: tuple[str, ...] | str = ("q_proj", "v_proj")
    """Module names to adapt, matched like PEFT: a tuple matches a module whose qualified name equals an
    entry or ends with ``"." + entry``; a single string is a regex that must match the whole qualified
    name (``re.fullmatch``). Only ``nn.Linear`` modules can be targets."""
    use_rslora: bool = False
    """Rank-stabilised LoRA (Kalajdzievski, 2023): scaling = alpha / sqrt(r)."""
    init: Literal["kaiming", "gaussian", "random"] = "kaiming"
    """kaiming: A kaiming-uniform(a=sqrt(5)), B zeros (PEFT's default: the adapter starts as a no-op).
    gaussian: A ~ N(0, 1/r), B zeros. random: A and B both kaiming-uniform (not a no-op; for tests)."""
    base_model_name_or_path: str | None = None
    """What an exported adapter's ``adapter_config.json`` names as its base model (PEFT's field of the same
    name), stored as given. None: the model the run started from, a local directory as an absolute path (PEFT
    resolves a relative one against the current directory, so it would load only from where you trained). Set
    a hub id (``Qwen/Qwen3-0.6B``) when you trained from a local copy of it and will publish the adapter."""

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA rank r={self.r!r} must be an integer >= 1 (typical: 8, 16, 64)")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be > 0 (typical: r or 2 * r)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} must be in [0, 1)")
        if self.init not in _INITS:
            raise ValueError(f"LoRA init={self.init!r} is not one of {list(_INITS)}")
        if isinstance(self.target_modules, str):
            try:
                re.compile(self.target_modules)
            except re.error as exc:
                raise ValueError(f"LoRA target_modules={self.target_modules!r} is not a valid regex: {exc}") from exc
        elif not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
            raise ValueError(
                f"LoRA target_modules={self.target_modules!r} must be a non-empty tuple of module names "
                "(e.g. ('q_proj', 'v_proj')) or one regex string"
            )
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))

    @property
    def scaling(self) -> float:
        """The factor the adapter's output is multiplied by."""
        return float(self.alpha / (self.r**0.5 if self.use_rslora else self.r))

    def matches(self, name: str) -> bool:
        """True when the module with qualified name ``name`` is a target (PEFT's matching rule)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        return any(name == t or name.endswith("." + t) for t in self.target_modules)
