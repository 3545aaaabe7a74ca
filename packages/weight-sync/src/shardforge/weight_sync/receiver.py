"""`WeightReceiver`: stage a whole version, verify it, then switch the model to it at once."""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch
from torch import nn

from shardforge.weight_sync.disk import WeightVersionError
from shardforge.weight_sync.manifest import Manifest, checksum_matches

__all__ = ["WeightReceiver"]


def _swappable(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    return (
        target.device == tensor.device
        and target.dtype == tensor.dtype
        and target.shape == tensor.shape
        and tensor.is_contiguous()
    )


def _materialised(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, swap: bool) -> torch.Tensor:
    """``tensor`` as a released weight's new storage: itself when it already fits and may be kept (``swap``),
    else a dense copy on ``device`` in ``dtype``."""
    moved = tensor.to(device=device, dtype=dtype)
    if moved is tensor and not swap:
        return tensor.clone(memory_format=torch.contiguous_format)
    return moved.contiguous()


class WeightReceiver:
    """Holds a serving model and its weight version.

    `apply` reads every tensor of a version into a staging area first; only when the
    whole version arrived and matches the manifest (names, shapes, dtypes) and the model
    (every name exists, shapes agree) does it copy the weights in, under a lock. Any
    failure leaves the model serving the previous version.

    `release` frees the serving weights (a colocated rollout engine between its generation
    phases: the trainer needs the memory); the next `apply` re-materialises them from the
    version it brings, which must then carry every released tensor.
    """

    def __init__(
        self, model: nn.Module, *, version: int = 0, verify_checksums: bool = True, swap_storage: bool = True
    ) -> None:
        self.model = model
        self.version = version
        self.verify_checksums = verify_checksums
        """Check each tensor against the manifest's checksum (when the manifest has one)."""
        self.swap_storage = swap_storage
        """Where a staged tensor already has the weight's device, dtype, shape and a dense layout, make it
        the weight's storage instead of copying it (the staging buffer was freshly received and is not
        reused). Set False if the source tensors must stay independent of the model (e.g. a caller
        that reuses them)."""
        self.lock = threading.Lock()
        self._released: set[str] = set()  # state-dict names of the released tensors

    @property
    def released(self) -> bool:
        """Whether the weights are released (`release`) and no version was applied since."""
        return bool(self._released)

    def release(self) -> int:
        """Free every parameter and persistent buffer of the model until the next `apply`; return the bytes
        released (the memory goes back when nothing else references it, e.g. a KV cache built from the
        weights). Each keeps its shape, dtype and device but holds a single element shared by all of them,
        expanded to its shape (NaN for floating-point tensors: a forward computes NaN, not plausible
        values; a serving engine refuses to generate while released). Non-persistent buffers (rotary tables),
        which no version carries, stay. The version stays too: the next `apply` must bring a newer one."""
        if self._released:
            return 0
        freed = 0
        with self.lock, torch.no_grad():
            state = self.model.state_dict(keep_vars=True)
            unique: dict[int, torch.Tensor] = {}  # tied weights: one tensor under several names
            for name, tensor in state.items():
                if id(tensor) not in unique:
                    unique[id(tensor)] = tensor
                    freed += tensor.numel() * tensor.element_size()
                self._released.add(name)
            fills: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
            for tensor in unique.values():
                key = (tensor.dtype, tensor.device)
                if key not in fills:
                    fill = float("nan") if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 0
                    fills[key] = torch.full((), fill, dtype=tensor.dtype, device=tensor.device)
                tensor.data = fills[key].expand(tensor.shape)
        return freed

    def apply(self, manifest: Manifest, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if manifest.version <= self.version:
            kind = "duplicate" if manifest.version == self.version else "stale"
            raise WeightVersionError(
                f"{kind} version {manifest.version}: this receiver already serves version {self.version}"
            )
        expected = {t.name: t for t in manifest.tensors}
        staged: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            info = expected.get(name)
            if info is None:
                raise WeightVersionError(f"version {manifest.version}: unexpected tensor {name}")
            if tuple(tensor.shape) != tuple(info.shape) or str(tensor.dtype) != info.dtype:
                raise WeightVersionError(
                    f"version {manifest.version}: {name} arrived as {tuple(tensor.shape)} {tensor.dtype}, "
                    f"manifest says {info.shape} {info.dtype}"
                )
            if self.verify_checksums and info.checksum and not checksum_matches(tensor, info.checksum):
                raise WeightVersionError(f"version {manifest.version}: checksum mismatch for {name}")
            staged[name] = tensor
        missing = sorted(set(expected) - set(staged))
        if missing:
            raise WeightVersionError(
                f"version {manifest.version} is incomplete: missing {missing[:10]} ({len(missing)})"
            )
        state = self.model.state_dict(keep_vars=True)  # the live parameters/buffers, not detached aliases
        unknown = sorted(set(staged) - set(state))
        if unknown:
            raise WeightVersionError(f"version {manifest.version} has tensors the model lacks: {unknown[:10]}")
        wrong = [n for n, t in staged.items() if tuple(state[n].shape) != tuple(t.shape)]
        if wrong:
            raise WeightVersionError(f"version {manifest.version}: shape mismatch for {wrong[:10]}")
        if self._released:  # every released tensor (or a tied alias of it) must come back
            carried = {id(state[n]) for n in staged}
            lacking = sorted(n for n in self._released if id(state[n]) not in carried)
            if lacking:
                raise WeightVersionError(
                    f"version {manifest.version} lacks released weights {lacking[:10]} ({len(lacking)}): the "
                    "weights were released (release()), so the next version must carry every tensor"
                )
        with self.lock, torch.no_grad():
            for name, tensor in staged.items():
                target = state[name]
                if name in self._released:  # the version becomes the weight's storage
                    target.data = _materialised(tensor, target.device, target.dtype, self.swap_storage)
                elif self.swap_storage and _swappable(target, tensor):
                    target.data = tensor  # O(1): the staged tensor becomes the weight (no second copy)
                else:
                    target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._released.clear()
            self.version = manifest.version
