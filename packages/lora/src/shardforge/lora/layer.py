"""`apply_lora`: turn the targeted ``nn.Linear`` modules into `LoRALinear` in place.

Each target keeps its identity and its parameters (``...q_proj.weight`` / ``.bias`` keep their
names, so HF loading, base checkpoints and weight sync are unaffected); only its class changes to
`LoRALinear`, which gains two child Linears ``lora_A`` [r, in] and ``lora_B`` [out, r]
(``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``). Swapping the class instead of wrapping
the module in a new parent is what keeps the base names unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.lora.config import LoRAConfig

__all__ = ["LoRALinear", "apply_lora", "lora_modules", "reset_lora_parameters"]

ADAPTER_KEYS = ("lora_A", "lora_B", "lora_dropout")
"""Child-module names `LoRALinear` adds to its base Linear."""


class LoRALinear(nn.Linear):
    """``y = W x + b + scaling * B(A(dropout(x)))``; made by `apply_lora` (never constructed directly).

    Under tensor parallelism the adapters' params are DTensors placed by `shardforge.lora.tp`, and the
    whole sum is computed in DTensor form inside this forward, so the parent's TP hooks reduce base and
    adapter outputs together (one collective, as without LoRA).
    """

    lora_A: nn.Linear
    lora_B: nn.Linear
    lora_dropout: nn.Module
    lora_scaling: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if "lora_A" not in self._modules:  # merged (see `merged_lora`): the base weight holds the adapter
            return out
        adapter: torch.Tensor = self.lora_B(self.lora_A(self.lora_dropout(x)))
        # Same operation order as PEFT's LoRA Linear, so fp32 results match it bit for bit.
        return out + adapter * self.lora_scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lora_scaling={self.lora_scaling}"


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(qualified name, module) of every adapted Linear, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _unmatched_error(model: nn.Module, config: LoRAConfig) -> ValueError:
    names = _linear_names(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    return ValueError(
        f"LoRA target_modules={config.target_modules!r} match no nn.Linear of {type(model).__name__}; "
        f"its Linear module names end with {suffixes} (e.g. {names[:4]}). Pass names such as "
        "('q_proj', 'v_proj') or a regex over full names like r'.*\\.(q|v)_proj'"
    )


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int | None = None) -> list[str]:
    """Add adapters to the targeted Linears of ``model`` in place; freeze everything else.

    Apply before tensor parallelism and FSDP (their plans then treat adapters as described in
    `shardforge.lora.tp`). Works on a meta-device model: the adapters are then empty too and get
    their values from the state dict that fills the model (or from `reset_lora_parameters`).

    Args:
        seed: initialise the adapters from a generator seeded with this value (identical on every
            process, whatever else used the global RNG); None uses the global RNG like PEFT.

    Returns:
        the qualified names of the adapted modules.
    """
    matched = [(name, m) for name, m in model.named_modules() if name and config.matches(name)]
    if not matched:
        raise _unmatched_error(model, config)
    # Exactly nn.Linear: the class swap below would drop a subclass's own forward.
    not_linear = [f"{name} ({type(m).__name__})" for name, m in matched if type(m) not in (nn.Linear, LoRALinear)]
    if not_linear:
        raise ValueError(
            f"LoRA target_modules={config.target_modules!r} match modules that are not nn.Linear: "
            f"{not_linear[:8]}; only nn.Linear can be adapted (fused MoE experts are 3-D parameters, not "
            f"Linears). Linear modules of this model: {_linear_names(model)[:8]}..."
        )
    already = [name for name, m in matched if isinstance(m, LoRALinear)]
    if already:
        raise ValueError(f"modules {already[:8]} already have LoRA adapters; apply_lora once per model")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "apply_lora must run before tensor parallelism / FSDP (the model already has DTensor parameters); "
            "apply LoRA first, then TP with shardforge.lora.lora_tp_plan(plan), then FSDP"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    for _, module in matched:
        weight = module.weight
        module.__class__ = LoRALinear
        kw = {"bias": False, "device": weight.device, "dtype": weight.dtype}
        module.lora_A = nn.Linear(module.in_features, config.r, **kw)  # type: ignore[arg-type]
        module.lora_B = nn.Linear(config.r, module.out_features, **kw)  # type: ignore[arg-type]
        module.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        module.lora_scaling = config.scaling  # type: ignore[assignment]
    reset_lora_parameters(model, config, seed=seed)
    return [name for name, _ in matched]


@torch.no_grad()
def reset_lora_parameters(model: nn.Module, config: LoRAConfig, *, seed: int | None = None) -> None:
    """(Re)initialise every adapter as ``config.init`` says (PEFT's schemes). Meta tensors are skipped.

    With ``seed`` the values come from a CPU generator seeded with it, so every process (and every
    layout) gets the same adapters. Parameters must not be sharded yet: initialise before TP/FSDP,
    or let the full state dict that fills a sharded model carry the values.
    """
    generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def kaiming(param: torch.Tensor) -> None:
        if generator is None:
            nn.init.kaiming_uniform_(param, a=math.sqrt(5))
            return
        value = torch.empty(param.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=generator)
        param.copy_(value)

    for name, module in lora_modules(model):
        a, b = module.lora_A.weight, module.lora_B.weight
        if isinstance(a, DTensor) or isinstance(b, DTensor):
            raise ValueError(f"{name}: adapters are already sharded; reset them before TP/FSDP")
        if a.is_meta or b.is_meta:
            continue
        if config.init == "gaussian":
            value = torch.randn(a.shape, generator=generator) if generator is not None else torch.randn(a.shape)
            a.copy_(value / config.r)
        else:
            kaiming(a)
        if config.init == "random":
            kaiming(b)
        else:
            b.zero_()
