"""AdamW with low-precision moments and Kahan-compensated low-precision weights.

Training in pure bf16 (bf16 parameters, no fp32 master copy) saves the 4 B/param of a
master weight, but plain AdamW then loses its small updates: bf16 keeps 8 significant
bits, so adding an update smaller than half a unit in the last place (ulp) of a weight
rounds it away and the weight never moves. `AnyPrecisionAdamW` keeps what rounding
loses in a per-parameter compensation buffer (Kahan summation) and adds it back on the
next step, so the bf16 weight follows the fp32 trajectory to within one bf16 rounding.
The idea is the one of torchdistx's / torchtune's ``AnyPrecisionAdamW``; this is our own
implementation with two differences:

* every step is computed in fp32 from the stored (possibly bf16) state and rounded only
  when stored back; torchdistx computes in the storage dtype;
* weight decay goes through the compensated update too (torchdistx multiplies the bf16
  weight by ``1 - lr * wd`` directly, which rounds away small decays like any small update).

With every dtype float32 and Kahan off it performs exactly the operations of
``torch.optim.AdamW(foreach=False)`` in the same order, so the results are bit-identical.

Memory per parameter (state + the parameter itself): fp32 AdamW 8 + 4 B; this optimizer
with bf16 params, bf16 moments and a bf16 compensation buffer 2 + 2 + 2 + 2 B.

Works on FSDP2 / TP DTensor parameters: the state is made with ``torch.zeros_like(param)``,
so it is a DTensor with the parameter's placements (``get_optimizer_state_dict`` and DCP
save, load and reshard it like AdamW's), while the arithmetic runs on the local shards
(the update is elementwise, so the shards are independent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from shardforge.memory import fused_adamw

__all__ = ["AnyPrecisionAdamW"]

logger = logging.getLogger(__name__)

# Param groups store the dtype *name* ("bfloat16"): torch.distributed.checkpoint's state-dict
# helpers and DCP only accept tensors, numbers, strings and containers in an optimizer state dict.
_STATE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_DTYPE_KEYS = ("momentum_dtype", "variance_dtype", "compensation_buffer_dtype")
# Optimizer state key -> the param-group key naming its dtype.
_STATE_DTYPE_KEY = {
    "exp_avg": "momentum_dtype",
    "exp_avg_sq": "variance_dtype",
    "compensation": "compensation_buffer_dtype",
}


def _dtype_name(name: str, value: object) -> str:
    """Canonical name ("float32" / "bfloat16") of a state dtype given as a torch.dtype or a name such as "bf16"."""
    if isinstance(value, torch.dtype) and value in _STATE_DTYPES.values():
        return str(value).removeprefix("torch.")
    if isinstance(value, str) and value.lower() in _STATE_DTYPES:
        return str(_STATE_DTYPES[value.lower()]).removeprefix("torch.")
    raise ValueError(
        f"{name}={value!r} is not supported; valid: torch.float32, torch.bfloat16 or the names "
        f"{sorted(_STATE_DTYPES)} (float16 state under- and overflows: exp_avg_sq holds squared gradients)"
    )


def _check_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    if isinstance(lr, torch.Tensor):
        raise TypeError("lr must be a Python float; a tensor lr is not supported by AnyPrecisionAdamW")
    if not lr >= 0.0:
        raise ValueError(f"lr={lr} must be >= 0")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"betas={betas} must be two numbers in [0, 1), e.g. (0.9, 0.999)")
    if not eps >= 0.0:
        raise ValueError(f"eps={eps} must be >= 0 (typically 1e-8)")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay={weight_decay} must be >= 0")


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under no_grad, DTensor.to_local() returns the local shard itself (no copy), so in-place
    # updates of it update the DTensor.
    return t.to_local() if isinstance(t, DTensor) else t


def _as_fp32(t: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """``t`` in float32: a new tensor if ``t`` is low precision (or ``copy``), else ``t`` itself."""
    if t.dtype != torch.float32:
        return t.float()
    return t.clone() if copy else t


def _adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    compensation: torch.Tensor | None,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step on plain (local) tensors, computed in fp32, stored in each tensor's dtype."""
    g = _as_fp32(grad, copy=False)
    m = _as_fp32(exp_avg, copy=False)
    m.lerp_(g, 1 - beta1)
    if m is not exp_avg:
        exp_avg.copy_(m)
    v = _as_fp32(exp_avg_sq, copy=False)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    # Same scalar arithmetic and op order as torch.optim.adam._single_tensor_adam.
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    if compensation is None:
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        param.addcdiv_(m, denom, value=-step_size)
        return
    # Kahan summation: the update plus what earlier roundings lost, added to the weight in
    # fp32; whatever rounding to the weight's dtype loses now is carried to the next step.
    update = _as_fp32(compensation, copy=True)
    update.addcdiv_(m, denom, value=-step_size)
    if weight_decay != 0:
        update.add_(param, alpha=-lr * weight_decay)
    exact = _as_fp32(param, copy=True).add_(update)
    param.copy_(exact)
    compensation.copy_(exact.sub_(param))  # exact in fp32: both are within one ulp of each other


def _eager_update(tensors: tuple[torch.Tensor | None, ...], hyper: tuple[Any, ...]) -> None:
    """`_adamw_update_` of one parameter; ``hyper`` = (step, lr, beta1, beta2, eps, weight_decay)."""
    step, lr, beta1, beta2, eps, weight_decay = hyper
    param, grad, exp_avg, exp_avg_sq, compensation = tensors
    assert param is not None and grad is not None and exp_avg is not None and exp_avg_sq is not None
    _adamw_update_(
        param, grad, exp_avg, exp_avg_sq, compensation,
        step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )  # fmt: skip


class AnyPrecisionAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with configurable state dtypes and Kahan summation.

    Args:
        params: parameters or param-group dicts, as for ``torch.optim.AdamW``; groups may
            override any keyword below.
        lr: learning rate (>= 0).
        betas: moment decay rates, each in [0, 1).
        eps: added to the denominator.
        weight_decay: decoupled weight decay (``w -= lr * weight_decay * w``), as AdamW.
        momentum_dtype: dtype of ``exp_avg`` (float32 or bfloat16).
        variance_dtype: dtype of ``exp_avg_sq`` (float32 or bfloat16).
        compensation_buffer_dtype: dtype of the Kahan ``compensation`` buffer.
        use_kahan_summation: keep a compensation buffer per parameter and carry the bits
            that rounding the weight loses into the next step. Only useful for low-precision
            (bf16/fp16) parameters; with fp32 parameters it costs memory for no gain.
        fused: run the update as ``torch.compile``d kernels, many parameters per call
            (`shardforge.memory.fused_adamw`); None (default) = on CUDA parameters only, True =
            everywhere, False = never (the eager update, bit-identical to ``torch.optim.AdamW``
            with fp32 state). If compiling fails, the eager update is used with a warning.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        momentum_dtype: torch.dtype | str = torch.bfloat16,
        variance_dtype: torch.dtype | str = torch.bfloat16,
        compensation_buffer_dtype: torch.dtype | str = torch.bfloat16,
        use_kahan_summation: bool = False,
        fused: bool | None = None,
    ) -> None:
        self.fused = fused
        _check_hyperparameters(lr, betas, eps, weight_decay)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "momentum_dtype": _dtype_name("momentum_dtype", momentum_dtype),
            "variance_dtype": _dtype_name("variance_dtype", variance_dtype),
            "compensation_buffer_dtype": _dtype_name("compensation_buffer_dtype", compensation_buffer_dtype),
            "use_kahan_summation": bool(use_kahan_summation),
        }
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group's overrides (hyperparameters, dtypes, floating-point params), then add it."""
        for key in _DTYPE_KEYS:
            if key in param_group:
                param_group[key] = _dtype_name(key, param_group[key])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for p in group["params"]:
            if not p.is_floating_point():
                raise TypeError(f"AnyPrecisionAdamW can only optimize floating-point tensors, got {p.dtype}")

    def _init_state(self, param: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[param]
        # Host the step count on CPU as a float32 scalar, as torch.optim.AdamW does (not capturable).
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        # zeros_like keeps a DTensor parameter's mesh and placements.
        state["exp_avg"] = torch.zeros_like(
            param, dtype=_STATE_DTYPES[group["momentum_dtype"]], memory_format=torch.preserve_format
        )
        state["exp_avg_sq"] = torch.zeros_like(
            param, dtype=_STATE_DTYPES[group["variance_dtype"]], memory_format=torch.preserve_format
        )
        if group["use_kahan_summation"]:
            state["compensation"] = torch.zeros_like(
                param, dtype=_STATE_DTYPES[group["compensation_buffer_dtype"]], memory_format=torch.preserve_format
            )
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Update every parameter that has a gradient; return ``closure()``'s loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Parameters the compiled update takes, bucketed by everything their update shares; each bucket
        # is updated in a few compiled calls after the loop (one call per parameter is host-bound).
        buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor | None, ...]]] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError("AnyPrecisionAdamW does not support sparse gradients")
                state = self.state[param] or self._init_state(param, group)
                compensation = state.get("compensation")
                if group["use_kahan_summation"] and compensation is None:
                    raise RuntimeError(
                        "use_kahan_summation was turned on after this parameter's state was created; "
                        "set it when constructing the optimizer"
                    )
                if isinstance(param, DTensor) and isinstance(grad, DTensor) and grad.placements != param.placements:
                    grad = grad.redistribute(param.device_mesh, param.placements)
                state["step"] += 1
                tensors = (
                    _local(param),
                    _local(grad),
                    _local(state["exp_avg"]),
                    _local(state["exp_avg_sq"]),
                    None if compensation is None else _local(compensation),
                )
                step = float(state["step"].item())
                hyper = (step, float(group["lr"]), beta1, beta2, group["eps"], group["weight_decay"])
                if self._fuse(*tensors):
                    key = (*hyper, tensors[0].device, compensation is not None)  # type: ignore[union-attr]
                    buckets.setdefault(key, []).append(tensors)
                else:
                    _eager_update(tensors, hyper)
        for key, members in buckets.items():
            self._fused_bucket(key, members)
        return loss

    def _fused_bucket(self, key: tuple[Any, ...], members: list[tuple[torch.Tensor | None, ...]]) -> None:
        """Update one bucket with the compiled update; on a compile failure, eagerly (and never fuse again)."""
        step, lr, beta1, beta2, eps, weight_decay, device, kahan = key
        if self.fused is not False:
            scalars = fused_adamw.scalars(
                step=step, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, device=device
            )
            params, grads, exp_avgs, exp_avg_sqs, compensations = ([t for t in column if t is not None]
                                                                   for column in zip(*members))  # fmt: skip
            try:
                fused_adamw.fused_update_many_(
                    params, grads, exp_avgs, exp_avg_sqs, compensations if kahan else None, scalars,
                    beta1=beta1, beta2=beta2, eps=eps,
                )  # fmt: skip
                return
            except Exception as err:  # compilation failed (no compiler, unsupported backend)
                self.fused = False
                logger.warning(
                    "AnyPrecisionAdamW: the compiled update failed (%s: %s); using the eager update "
                    "from now on (pass fused=False to skip the attempt)",
                    type(err).__name__,
                    str(err).splitlines()[0] if str(err) else "",
                )
        for tensors in members:
            _eager_update(tensors, key[:6])

    def _fuse(self, *tensors: torch.Tensor | None) -> bool:
        if self.fused is False or not fused_adamw.can_fuse(*tensors):
            return False
        return self.fused is True or (tensors[0] is not None and tensors[0].is_cuda)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as ``torch.optim.Optimizer`` does, but keep each state tensor in its configured dtype.

        The base class casts every floating-point state tensor to its parameter's dtype
        (bf16 moments of fp32 params would come back fp32; fp32 moments of bf16 params would
        be rounded to bf16). The loaded values are re-cast from the originals instead.
        """
        originals = {pid: dict(s) for pid, s in state_dict.get("state", {}).items()}
        super().load_state_dict(state_dict)
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for pid, (param, group) in zip(saved_ids, params):
            state = self.state.get(param)
            if not state or pid not in originals:
                continue
            if isinstance(state.get("step"), torch.Tensor):
                # step() increments it in place: never share it with the caller's state dict
                # (or with the optimizer that produced it, as a full state dict in memory does).
                state["step"] = state["step"].detach().clone()
            for key, dtype_key in _STATE_DTYPE_KEY.items():
                value = originals[pid].get(key)
                if isinstance(value, torch.Tensor) and key in state:
                    # .to() keeps a DTensor a DTensor (same placements) and copies only if needed.
                    state[key] = value.to(device=state[key].device, dtype=_STATE_DTYPES[group[dtype_key]])
