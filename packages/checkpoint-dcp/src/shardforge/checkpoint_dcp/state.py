"""`TrainState`: everything a resumed run needs, as one `Stateful` for DCP.

Keys are the model's fully qualified parameter names (from
`torch.distributed.checkpoint.state_dict.get_state_dict`), never rank-local names, so a
checkpoint saved under one layout loads under another: DCP reshards DTensors on load.

RNG states are per rank. They are gathered so the checkpoint holds one list indexed by
global rank; a run resumed with the same world size restores each rank's generators
exactly, and a run resumed with a different one keeps its freshly seeded generators
(warning once) since there is no meaningful mapping between old and new ranks.
"""

from __future__ import annotations

import json
import pickle
import random
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

__all__ = ["TrainState", "capture_rng_state", "restore_rng_state"]


def capture_rng_state() -> bytes:
    """This rank's python, numpy, torch CPU and CUDA generator states, pickled."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return pickle.dumps(state)


def restore_rng_state(blob: bytes) -> None:
    """Inverse of `capture_rng_state`."""
    state = pickle.loads(blob)
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainState(Stateful):
    """Model, optimizer(s), LR scheduler(s), step, data position and RNG, for `Checkpointer`.

    Args:
        model: the (possibly sharded) model.
        optimizers: one optimizer or a sequence of them (may be empty for inference state).
        schedulers: LR schedulers (anything with ``state_dict``/``load_state_dict``).
        step: the number of completed optimizer steps.
        data_state: a small JSON-like dict describing the data position (e.g. the
            sampler's seed and step); it must not depend on the data-parallel size.
        trainable_only: save and load only parameters with ``requires_grad`` (and the optimizer
            state, which only they have). For adapter fine-tuning (e.g. LoRA): the frozen base is
            re-loaded from its own files on resume, so the checkpoint holds only what training changed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
        schedulers: Any | Sequence[Any] = (),
        *,
        step: int = 0,
        data_state: dict[str, Any] | None = None,
        trainable_only: bool = False,
    ) -> None:
        self.model = model
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        self.schedulers: list[Any] = list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
        self.step = step
        self.data_state: dict[str, Any] = dict(data_state or {})
        self.rng_restored = False
        self.trainable_only = trainable_only

    def _model_and_optim(self) -> tuple[dict[str, Any], dict[str, Any]]:
        options = StateDictOptions(full_state_dict=False, ignore_frozen_params=self.trainable_only)
        if not self.optimizers:
            model_sd, _ = get_state_dict(self.model, [], options=options)
            return model_sd, {}
        return get_state_dict(self.model, self.optimizers, options=options)  # type: ignore[return-value]

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._model_and_optim()
        rng = [capture_rng_state()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, rng[0])
            rng = gathered
        return {
            "model": model_sd,
            "optimizer": optim_sd,
            "schedulers": pickle.dumps([s.state_dict() for s in self.schedulers if s is not None]),
            "step": self.step,
            # Opaque blobs: DCP only loads keys present in the loading side's template, and
            # the number of schedulers, the data dict's keys or the number of ranks may
            # differ between runs.
            "data": json.dumps(self.data_state, sort_keys=True),
            "rng": pickle.dumps(rng),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # trainable_only: the frozen params are absent on purpose (DCP itself still requires every
        # trainable param the template names, so nothing that was saved can go missing silently).
        options = StateDictOptions(ignore_frozen_params=True, strict=False) if self.trainable_only else None
        if self.optimizers:
            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optimizer"],
                options=options,
            )
        else:
            set_state_dict(self.model, [], model_state_dict=state_dict["model"], optim_state_dict={}, options=options)
        schedulers = [s for s in self.schedulers if s is not None]
        saved = pickle.loads(state_dict["schedulers"])
        if schedulers and len(saved) != len(schedulers):  # none given (inference): schedule not needed
            raise ValueError(f"checkpoint has {len(saved)} LR scheduler state(s) but {len(schedulers)} were given")
        for scheduler, value in zip(schedulers, saved):
            scheduler.load_state_dict(value)
        self.step = int(state_dict["step"])
        self.data_state = json.loads(state_dict["data"])
        rng = pickle.loads(state_dict["rng"])
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if len(rng) == world:
            restore_rng_state(rng[rank])
            self.rng_restored = True
        else:
            self.rng_restored = False
            if rank == 0:
                warnings.warn(
                    f"checkpoint holds RNG states of {len(rng)} ranks but this run has {world}; "
                    "keeping this run's RNG seeding (model, optimizer, schedule and data position are restored)",
                    stacklevel=2,
                )


class TrainableState(Stateful):
    """A model's trained parameters and its optimizer's state as one DCP `Stateful`, frozen parameters left out, no
    RNG, schedulers or step (what a service that trains many models on one shared frozen base saves per model:
    `shardforge serve`'s ``save_state``; its generators are shared, so restoring RNG would be wrong). Keys are fully
    qualified parameter names, so a checkpoint saved sharded over N ranks loads on M.

    Args:
        model: the model (plain, or sharded with FSDP).
        optimizer: its optimizer; None: the weights alone (a load that leaves the optimizer as it is).
    """

    trainable_only = True
    """What `check_compatible` compares: the trained parameters only."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizers = [] if optimizer is None else [optimizer]

    def state_dict(self) -> dict[str, Any]:
        options = StateDictOptions(ignore_frozen_params=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=options)
        return {"model": model_sd, "optimizer": optim_sd} if self.optimizers else {"model": model_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # strict=False: the frozen weights are absent on purpose (DCP itself still requires every key of the
        # template, so no trained weight can go missing silently)
        options = StateDictOptions(ignore_frozen_params=True, strict=False)
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optimizer", {}),
            options=options,
        )
