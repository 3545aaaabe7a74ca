"""The service's models: one base HF model loaded once, and per training client a LoRA module tree that
shares the base weights by reference (`copy.deepcopy` with the base parameters in its memo), with its own
adapters and its own AdamW. Different ranks and different tenants therefore coexist on one base model; the
base weights are frozen and never copied. A full fine-tuning client (``lora_config`` absent) gets a full
copy of the base weights of its own, all trainable, and an AdamW over all of them.

First slice: a training client is trained with plain torch on that tree (`shardforge.lora` adapters), not
through `shardforge.engine.TrainEngine`, whose step API (a whole packed batch, loss and optimizer step in
one call) does not fit Tinker's separate ``forward_backward`` / ``optim_step`` requests yet.
"""

from __future__ import annotations

import copy
import itertools
import random
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.algorithms.serve.futures import UserError
from shardforge.lora import LoRAConfig, LoRALinear, lora_modules

__all__ = [
    "LORA_TARGETS", "ModelRegistry", "SamplerWeights", "TrainingModel", "adapter_optimizer", "lora_config_for",
]  # fmt: skip

LORA_TARGETS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}
"""Which Linear names each of Tinker's LoraConfig switches adapts (Llama/Qwen module names)."""


def lora_config_for(lora: dict[str, Any], *, alpha: float) -> LoRAConfig:
    """Our `LoRAConfig` for a Tinker ``LoraConfig`` JSON object."""
    rank = lora.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UserError(f"lora_config.rank={rank!r} must be an integer >= 1 (typical: 8, 16, 32)")
    targets = tuple(name for key, names in LORA_TARGETS.items() if lora.get(key, True) for name in names)
    if not targets:
        raise UserError("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
    return LoRAConfig(r=rank, alpha=alpha, target_modules=targets)


def adapter_optimizer(params: list[nn.Parameter]) -> torch.optim.AdamW:
    """A training model's AdamW (its hyper-parameters are set by each ``optim_step``)."""
    # foreach: one fused kernel per step over all tensors (~2x faster than a loop over them on CPU)
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, foreach=True)


@dataclass(kw_only=True, slots=True)
class TrainingModel:
    """One training client's adapters and optimizer on the shared base model (``lora`` None: full fine-tuning,
    ``module`` is a full copy of its own)."""

    model_id: str
    owner: str
    base_model: str
    lora: LoRAConfig | None
    seed: int
    module: nn.Module
    optimizer: torch.optim.AdamW
    steps: int = 0
    user_metadata: dict[str, str] = field(default_factory=dict)
    """The client's ``user_metadata`` (e.g. tinker-cookbook's ``renderer_name``), shown by ``get_training_run``
    and kept in its checkpoints."""
    created: str = ""
    """When it was created (ISO 8601, UTC)."""
    adapters: dict[str, LoRALinear] = field(init=False)
    """Its LoRA layers by qualified name (empty for full fine-tuning); found once, not per batch."""
    trainable: list[nn.Parameter] = field(init=False)
    """Its trainable parameters (the adapters, or every weight); found once, not per batch."""

    def __post_init__(self) -> None:
        self.adapters = dict(lora_modules(self.module))
        self.trainable = [p for p in self.module.parameters() if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The trained parameters (CPU copies) by their qualified names: the adapters, or every weight (full FT)."""
        return {n: p.detach().cpu().clone() for n, p in self.module.named_parameters() if p.requires_grad}


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerWeights:
    """What a sampling client samples from: the base model (``lora`` None) or a frozen adapter snapshot."""

    path: str | None
    owner: str
    lora: LoRAConfig | None = None
    adapter: dict[str, torch.Tensor] | None = None
    created: str | None = None
    """When it was saved (ISO 8601, UTC)."""


class ModelRegistry:
    """The base model and every live training model, sampler snapshot and sampling session, by tenant.

    Args:
        model_dir: the HF base model directory (save_pretrained), with its tokenizer.
        base_model: the name clients pass as ``base_model`` (also accepted: ``model_dir`` itself).
        lora_alpha: LoRA alpha of every adapter (scaling = alpha / rank).
    """

    def __init__(self, model_dir: str | Path, *, base_model: str, lora_alpha: float = 32.0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_dir = str(model_dir)
        self.base_model = base_model
        self.lora_alpha = lora_alpha
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.base.eval()
        for param in self.base.parameters():
            param.requires_grad_(False)
        config = self.base.config
        self.vocab_size = int(config.vocab_size)
        self.max_context = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, SamplerWeights] = {}
        """Saved sampler weights by tinker:// path."""
        self.sessions: dict[str, SamplerWeights] = {}
        """Sampling sessions by id."""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def check_base_model(self, name: str | None) -> None:
        if name not in (self.base_model, self.model_dir):
            raise UserError(f"base_model={name!r} is not served here; this service serves {self.base_model!r}")

    def new_id(self, prefix: str) -> str:
        """A fresh id; the random part keeps ids (and checkpoint folders) unique across service restarts."""
        with self._lock:
            return f"{prefix}-{next(self._ids)}-{secrets.token_hex(4)}"

    def shared_tree(self) -> nn.Module:
        """A module tree of its own whose parameters are the base model's (no weight is copied)."""
        memo: dict[int, Any] = {id(p): p for p in self.base.parameters()}
        return copy.deepcopy(self.base, memo)

    def full_copy(self) -> nn.Module:
        """A module tree with its own copy of every base weight, all trainable (full fine-tuning)."""
        module = copy.deepcopy(self.base)
        for param in module.parameters():
            param.requires_grad_(True)
        return module

    def create_model(
        self,
        owner: str,
        model_id: str,
        lora: LoRAConfig | None,
        seed: int | None,
        user_metadata: dict[str, str] | None = None,
        *,
        module: nn.Module | None = None,
    ) -> TrainingModel:
        """A new training model ``model_id`` (the SDK derives it: ``<session_id>:train:<model_seq_id>``);
        ``lora`` None: full fine-tuning, on ``module`` when given (a multi-rank service's sharded copy, every
        weight trainable), else on a full copy of the base."""
        import datetime

        from shardforge.lora import apply_lora

        self.check_new_id(model_id)
        seed = seed if seed is not None else random.randrange(2**31)
        if lora is None:
            module = self.full_copy() if module is None else module
        else:
            module = self.shared_tree()
            apply_lora(module, lora, seed=seed)
        optimizer = adapter_optimizer([p for p in module.parameters() if p.requires_grad])
        model = TrainingModel(
            model_id=model_id, owner=owner, base_model=self.base_model, lora=lora, seed=seed,
            module=module, optimizer=optimizer, user_metadata=dict(user_metadata or {}),
            created=datetime.datetime.now(datetime.UTC).isoformat(),
        )  # fmt: skip
        with self._lock:
            self.models[model.model_id] = model
        return model

    def check_new_id(self, model_id: str) -> None:
        """UserError if a training model ``model_id`` exists."""
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists: model_seq_id values must not repeat within a session")

    def model(self, owner: str, model_id: str) -> TrainingModel:
        """The training model ``model_id`` of ``owner``; another tenant's id reads as unknown (no leak)."""
        model = self.models.get(model_id)
        if model is None or model.owner != owner:
            raise KeyError(f"model_id {model_id!r} is not a model of this API key; create_model first")
        return model

    def clients_per_tenant(self) -> dict[str, int]:
        """Live training models per tenant (the ``/metrics`` gauge)."""
        counts: dict[str, int] = {}
        with self._lock:
            for model in self.models.values():
                counts[model.owner] = counts.get(model.owner, 0) + 1
        return counts

    def sampler(self, owner: str, path: str) -> SamplerWeights:
        weights = self.samplers.get(path)
        if weights is None or weights.owner != owner:
            raise KeyError(f"model_path {path!r} is not a saved sampler of this API key (save_weights_for_sampler)")
        return weights

    def open_session(self, owner: str, weights: SamplerWeights) -> str:
        session_id = self.new_id("sampler")
        with self._lock:
            self.sessions[session_id] = weights
        return session_id

    def session(self, owner: str, session_id: str) -> SamplerWeights:
        weights = self.sessions.get(session_id)
        if weights is None or weights.owner != owner:
            raise KeyError(f"sampling_session_id {session_id!r} is not a sampling session of this API key")
        return weights
