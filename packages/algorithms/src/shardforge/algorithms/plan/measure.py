"""Measure the real peak memory of one `TrainEngine.train_batch` on CPU (validation of the planner).

RSS is too noisy for a 15% check on a small model, so this counts tensor storages: a
`TorchDispatchMode` sees the output of every aten op run during the step (forward,
backward, FSDP all-gather / reduce-scatter buffers, optimizer update); for DTensor outputs
it counts their local tensors (the mode does not see the ops DTensor runs on them). Every output whose
storage did not exist before is an allocation of ``storage.nbytes()``; a weakref on the
storage records when it is freed. FSDP2 frees and re-allocates gathered parameters by
*resizing* their storage (``storage.resize_(0)`` / ``resize_(n)``), which no op reports, so
those storages are polled: after every op the tracker adds their current size.

    peak = bytes alive before the step (sharded params, buffers, optimizer state)
         + max over the step of (tracked live bytes + gathered FSDP param bytes)

It does not see memory a kernel allocates and frees inside one op (e.g. a matmul's
scratch), gloo's internal buffers, or allocator caching / fragmentation.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["MemoryTracker", "measure_on_ranks", "measure_train_peak", "state_bytes"]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _fsdp_unsharded_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """The all-gather output tensors of every FSDP2 parameter (their storage is resized, not freed)."""
    out: list[torch.Tensor] = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            # Created by the first all-gather (the warm-up step); resized to 0 / full afterwards.
            out.extend(getattr(fsdp_param, "all_gather_outputs", []))
    return out


def _plain_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """``t``, or the inner tensors of a wrapper subclass (a DTensor's local shard), recursively.

    A dispatch mode is switched off while its own handler runs, so the ops DTensor runs on its
    local tensors are not seen: the bytes are found through the outputs' local tensors instead.
    """
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    else:
        yield t


class MemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages allocated inside the ``with`` block, with their peak."""

    def __init__(self, preexisting: list[torch.Tensor], polled: list[torch.Tensor], *, debug: bool = False) -> None:
        super().__init__()
        self.debug = debug
        self.alive: dict[int, tuple[int, str, tuple[int, ...], str]] = {}
        self.at_peak: list[tuple[int, str, tuple[int, ...], str]] = []
        self.known: Any = WeakIdKeyDictionary()
        for t in preexisting:
            self.known[t.untyped_storage()] = True
        self.polled = [t.untyped_storage() for t in polled]
        for st in self.polled:
            self.known[st] = True
        self.live = 0
        self.peak = 0
        self.peak_op = ""
        self.refs: dict[int, Any] = {}
        self._next = 0

    def _freed(self, idx: int, nbytes: int) -> None:
        self.live -= nbytes
        self.refs.pop(idx, None)
        self.alive.pop(idx, None)

    def _on_free(self, idx: int, nbytes: int) -> Callable[[Any], None]:
        return lambda _ref: self._freed(idx, nbytes)

    def polled_bytes(self) -> int:
        return sum(st.nbytes() for st in self.polled)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            for t in _plain_tensors(leaf):
                self._track(t, func)
        current = self.live + self.polled_bytes()
        if current > self.peak:
            self.peak, self.peak_op = current, str(func.overloadpacket)
            if self.debug:
                self.at_peak = sorted(self.alive.values(), reverse=True)
        return out

    def _track(self, t: torch.Tensor, func: Any) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st in self.known:
            return
        self.known[st] = True
        nbytes = st.nbytes()
        idx = self._next
        self._next += 1
        self.live += nbytes
        self.refs[idx] = weakref.ref(st, self._on_free(idx, nbytes))
        if self.debug:
            self.alive[idx] = (nbytes, str(func.overloadpacket), tuple(t.shape), str(t.dtype))


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the distinct storages behind this rank's params, buffers and optimizer state."""
    seen: dict[str, dict[int, int]] = {"params": {}, "buffers": {}, "optim": {}}

    def add(kind: str, t: torch.Tensor) -> None:
        st = _local(t).untyped_storage()
        seen[kind][id(st)] = st.nbytes()

    for p in model.parameters():
        add("params", p)
    for b in model.buffers():
        add("buffers", b)
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                add("optim", v)
    return {k: sum(v.values()) for k, v in seen.items()}


def _preexisting(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    tensors = [_local(p) for p in model.parameters()] + [_local(b) for b in model.buffers()]
    for state in optimizer.state.values():
        tensors.extend(_local(v) for v in state.values() if isinstance(v, torch.Tensor))
    return tensors


@contextmanager
def _tracking(model: torch.nn.Module, optimizer: torch.optim.Optimizer, debug: bool) -> Iterator[MemoryTracker]:
    gc.collect()
    tracker = MemoryTracker(_preexisting(model, optimizer), _fsdp_unsharded_tensors(model), debug=debug)
    with tracker:
        yield tracker


def measure_train_peak(
    engine: Any, batch: Any, *, warmup: Callable[[], Any] | None = None, debug: bool = False
) -> dict[str, Any]:
    """Peak bytes on this rank during ``engine.train_batch(batch)`` (after one warm-up step).

    The warm-up step (``warmup()``, default: the same batch) creates the optimizer state and
    any lazy buffers, so the measured step is a steady-state one. ``debug`` adds the largest
    allocations alive at the peak (bytes, op, shape, dtype) under ``"at_peak"``.
    """
    (warmup or (lambda: engine.train_batch(batch)))()
    engine.optimizer.zero_grad(set_to_none=True)
    before = state_bytes(engine.model, engine.optimizer)
    with _tracking(engine.model, engine.optimizer, debug) as tracker:
        stats = engine.train_batch(batch)
    baseline = sum(before.values())
    return {
        "peak_bytes": baseline + tracker.peak,
        "baseline_bytes": baseline,
        "step_peak_bytes": tracker.peak,
        "peak_op": tracker.peak_op,
        "state": before,
        "loss": stats["loss"],
        **({"at_peak": tracker.at_peak[:400], "polled_at_end": tracker.polled_bytes()} if debug else {}),
    }


def measure_layout(
    model_fields: dict[str, Any],
    layout: str,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    engine_options: dict[str, Any] | None = None,
    seed: int = 0,
    debug: bool = False,
) -> dict[str, Any]:
    """On every rank of the current process group (or alone): build a `TrainEngine` for a Qwen3
    config with ``model_fields``, and measure the peak of one steady-state ``train_batch`` of
    ``micro_batch_tokens // seq_len`` random sequences of ``seq_len`` tokens per data-parallel rank
    (one micro-batch). Returns `measure_train_peak`'s dict plus the rank."""
    import random

    import torch.distributed as dist
    from transformers import Qwen3Config

    from shardforge.engine import EngineConfig, TrainEngine, pack_sequences
    from shardforge.engine.config import OptimizerConfig

    torch.set_num_threads(1)
    options = dict(engine_options or {})
    if isinstance(options.get("optimizer"), dict):
        options["optimizer"] = OptimizerConfig(**options["optimizer"])
    if isinstance(options.get("lora"), dict):
        from shardforge.lora import LoRAConfig

        options["lora"] = LoRAConfig(**options["lora"])
    config = EngineConfig(max_tokens_per_microbatch=micro_batch_tokens, **options)
    engine = TrainEngine(Qwen3Config(**model_fields), layout, config)
    rng = random.Random(seed + engine.dp_rank)
    vocab = int(model_fields["vocab_size"])
    count = max(micro_batch_tokens // seq_len, 1)
    batch = pack_sequences([[rng.randrange(vocab) for _ in range(seq_len)] for _ in range(count)])
    result = measure_train_peak(engine, batch, debug=debug)
    result["rank"] = dist.get_rank() if dist.is_initialized() else 0
    del engine
    gc.collect()
    return result


def measure_on_ranks(
    model_fields: dict[str, Any],
    layout: str,
    world_size: int,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    engine_options: dict[str, Any] | None = None,
    timeout_s: float | None = None,
) -> list[dict[str, Any]]:
    """`measure_layout` on every rank: in this process for world 1, else on the shared gloo rank pool
    of ``world_size`` ranks; one result per rank."""
    kwargs: dict[str, Any] = {
        "seq_len": seq_len,
        "micro_batch_tokens": micro_batch_tokens,
        "engine_options": engine_options,
    }
    if world_size == 1:
        return [measure_layout(model_fields, layout, **kwargs)]
    from shardforge.mesh.testing import get_rank_pool

    if timeout_s is not None:
        kwargs["timeout_s"] = timeout_s
    return get_rank_pool(world_size).run(measure_layout, model_fields, layout, **kwargs)


def predict_engine_peak(
    model_fields: dict[str, Any],
    layout: str,
    world_size: int,
    *,
    seq_len: int,
    micro_batch_tokens: int,
    engine_options: dict[str, Any] | None = None,
    attention: Literal["flash", "cpu"] = "cpu",
) -> Any:
    """The planner's `MemoryEstimate` for the run `measure_layout` measures (same options; ``attention``
    "cpu" for the block-diagonal SDPA of CPU runs, "flash" for the CUDA varlen kernel)."""
    from transformers import Qwen3Config

    from shardforge.algorithms.plan.memory import estimate_memory
    from shardforge.algorithms.plan.options import PlanOptions
    from shardforge.algorithms.plan.stats import model_stats
    from shardforge.mesh import ParallelDims

    engine = dict(engine_options or {})
    known = {
        "param_dtype",
        "compute_dtype",
        "activation_checkpointing",
        "checkpoint_every",
        "sequence_parallel",
        "reshard_after_forward",
        "fsdp_layers_per_unit",
        "fsdp_forward_prefetch",
        "cpu_offload",
        "tiled_mlp_shards",
        "optimizer",
        "lora",
    }
    unknown = sorted(set(engine) - known)
    if unknown:
        raise ValueError(f"engine options {unknown} have no planner equivalent; known: {sorted(known)}")
    fields = dict(engine)
    if "optimizer" in fields:  # an OptimizerConfig as a dict: only its name matters here
        optimizer = fields.pop("optimizer")
        extra = sorted(set(optimizer) - {"name", "lr"})
        if extra:
            raise ValueError(f"optimizer options {extra} have no planner equivalent (defaults are assumed)")
        fields["optimizer"] = optimizer.get("name", "adamw")
    if "lora" in fields:  # a LoRAConfig as a dict: rank and target module names
        lora = fields.pop("lora")
        targets = lora.get("target_modules", ())
        if isinstance(targets, str):
            raise ValueError("a regex target_modules has no planner equivalent; list the module names")
        fields["lora_rank"] = int(lora["r"])
        fields["lora_targets"] = tuple(targets)
    fields.setdefault("param_dtype", "float32")  # EngineConfig's default
    opts = PlanOptions(seq_len=seq_len, micro_batch_tokens=micro_batch_tokens, attention=attention, **fields)
    dims = ParallelDims.parse(layout).resolve(world_size)
    return estimate_memory(model_stats(Qwen3Config(**model_fields)), dims, opts)
