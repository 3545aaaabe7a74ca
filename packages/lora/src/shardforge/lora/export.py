"""Adapter state, PEFT-format export, and merging adapters into the base weights.

Every function here that reads a sharded model is collective: all ranks call it in the same order
(each DTensor is gathered with ``full_tensor()``); files are written by rank 0 only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardforge.lora.config import LoRAConfig
from shardforge.lora.layer import ADAPTER_KEYS, LoRALinear, lora_modules

__all__ = [
    "PEFT_PREFIX",
    "lora_state_dict",
    "merge_lora",
    "merged_lora",
    "merged_state_dict",
    "save_peft_adapter",
]

PEFT_PREFIX = "base_model.model."
"""PEFT saves adapter keys as ``base_model.model.<our name>`` (its wrapper's path to the HF model)."""


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter parameters only (``<module>.lora_A.weight`` / ``.lora_B.weight``), full tensors on CPU."""
    out: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(model):
        out[f"{name}.lora_A.weight"] = _full(module.lora_A.weight).detach().cpu().clone()
        out[f"{name}.lora_B.weight"] = _full(module.lora_B.weight).detach().cpu().clone()
    return out


def _peft_config(config: LoRAConfig, base_model_name_or_path: str | None) -> dict[str, object]:
    targets = config.target_modules if isinstance(config.target_modules, str) else list(config.target_modules)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path or config.base_model_name_or_path,
        "r": config.r,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": targets,
        "use_rslora": config.use_rslora,
        "init_lora_weights": {"kaiming": True, "gaussian": "gaussian", "random": False}[config.init],
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def save_peft_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    config: LoRAConfig,
    *,
    base_model_name_or_path: str | None = None,
) -> None:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` that ``peft.PeftModel.from_pretrained``
    loads onto the base model. Collective; rank 0 writes (atomically: a temp dir renamed into place)."""
    from safetensors.torch import save_file

    tensors = {PEFT_PREFIX + k: v.contiguous() for k, v in lora_state_dict(model).items()}
    if not tensors:
        raise ValueError("the model has no LoRA adapters (call apply_lora first)")
    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()
        return
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    (tmp / "adapter_config.json").write_text(json.dumps(_peft_config(config, base_model_name_or_path), indent=2))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    if dist.is_initialized():
        dist.barrier()


def _delta(module: LoRALinear) -> torch.Tensor:
    """scaling * B @ A as a full tensor (fp32 product, like PEFT's merge for fp32 weights)."""
    a, b = _full(module.lora_A.weight).detach(), _full(module.lora_B.weight).detach()
    return (b.float() @ a.float()) * module.lora_scaling


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state dict with adapters folded in (``W + scaling * B @ A``) and adapter keys dropped:
    what PEFT's ``merge_and_unload()`` leaves, loadable into the plain HF model. Full tensors on CPU."""
    with merged_lora(model):
        return {k: _full(v).detach().cpu().clone() for k, v in model.state_dict().items()}


def _reshard_fsdp(model: nn.Module) -> None:
    # FSDP2 leaves a unit gathered after forward when reshard_after_forward=False (e.g. the last decoder
    # layer): its modules then expose temporary unsharded weights. Merge into the sharded ones instead.
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def merged_lora(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block the model *is* the merged model: base weights hold ``W + scaling * B @ A`` and the
    adapters are hidden (not in ``state_dict()`` / ``named_parameters()``); forward uses the merged weights.
    On exit the original base weights are restored exactly (copies, not a subtraction) and adapters come back.

    Works on sharded models (each rank adds its shard of the delta). Use it around anything that reads
    HF-named weights: HF export, weight publishing to inference engines, full state dicts.
    """
    saved: list[tuple[LoRALinear, torch.Tensor, dict[str, nn.Module | None]]] = []
    _reshard_fsdp(model)
    try:
        with torch.no_grad():
            for _, module in lora_modules(model):
                if "lora_A" not in module._modules:
                    continue
                delta = _delta(module)
                weight = module.weight
                if isinstance(weight, DTensor):
                    # Every rank holds the same full delta: src_data_rank=None slices it locally.
                    local_delta = distribute_tensor(
                        delta, weight.device_mesh, weight.placements, src_data_rank=None
                    ).to_local()
                    local = weight.to_local()
                else:
                    local_delta, local = delta, weight.data
                original = local.clone()
                local.add_(local_delta.to(device=local.device, dtype=local.dtype))
                hidden = {k: module._modules.pop(k) for k in ADAPTER_KEYS if k in module._modules}
                saved.append((module, original, hidden))
        yield model
    finally:
        with torch.no_grad():
            for module, original, hidden in saved:
                weight = module.weight
                (weight.to_local() if isinstance(weight, DTensor) else weight.data).copy_(original)
                module._modules.update(hidden)


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold the adapters into the base weights for good and turn adapted modules back into ``nn.Linear``
    (like PEFT's ``merge_and_unload``); returns ``model``. Trainability flags are left as they are."""
    for _, module in lora_modules(model):
        weight = module.weight
        if isinstance(weight, DTensor):
            raise ValueError("merge_lora needs an unsharded model; use merged_lora(...) or merged_state_dict(...)")
        if "lora_A" in module._modules:
            weight.add_(_delta(module).to(weight.dtype))
        for key in ADAPTER_KEYS:
            module._modules.pop(key, None)
        del module.lora_scaling
        module.__class__ = nn.Linear  # type: ignore[assignment]
    return model
