"""`TrainEngine`: one HF model, sharded per a `ParallelDims`, trained on packed batches.

The composition order lives in `shardforge.engine.build` (and docs/parallelism.md);
how micro-batches run on a layout lives in a runner (`runners.SPMDRunner`,
`pipeline_runner.PipelineRunner`); what the model outputs per token lives in a head
(`heads.LMHead`, `heads.ValueHead`). The engine normalises, clips, steps and reports once for all.

Loss normalisation: ``loss_fn`` returns a *sum* over a micro-batch; the engine divides by
the loss weight summed over the whole global batch (all micro-batches, all data-parallel
ranks), and multiplies by the number of ranks FSDP averages gradients over. The update
is therefore the same whatever the micro-batching or the world size.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from shardforge.core.log import get_logger
from shardforge.engine.batching import PackedBatch, all_reduce_stats, all_reduce_sum, stat_kind
from shardforge.engine.build import build_model
from shardforge.engine.checks import check_engine, check_features, ignored_without_fsdp
from shardforge.engine.config import EngineConfig
from shardforge.engine.context import ParallelContext
from shardforge.engine.features.moe import register_moe_checkpoint_hooks
from shardforge.engine.features.offload import OffloadState, offloaded_between_calls
from shardforge.engine.heads import make_head
from shardforge.engine.io import EngineIO
from shardforge.engine.loading import load_hf_config
from shardforge.engine.objectives.sft import sft_loss, token_count
from shardforge.engine.optim import build_optimizer, build_scheduler
from shardforge.engine.vision import is_vlm
from shardforge.engine.vision_value import make_vlm_head
from shardforge.mesh import ParallelDims, build_mesh, current_device, init_distributed

log = get_logger(__name__)

__all__ = ["LossFn", "LossWeightFn", "TrainEngine"]

LossFn = Callable[[torch.Tensor, PackedBatch], torch.Tensor]
"""(target log-probs [T], micro-batch) -> summed loss (0-dim); a value-head engine passes
per-position values [T] instead of log-probs. A loss function with a true
``wants_entropy`` attribute is called as ``loss_fn(logprobs, mb, entropy=[T] entropies)``
(differentiable; vocab-parallel under TP, gathered under CP); one with a true ``wants_distribution``
gets ``distribution=[T, V]`` float32 log-probs of each target's whole distribution (differentiable;
row t = the distribution token t was drawn from; LM heads, tp = pp = 1)."""
LossWeightFn = Callable[[PackedBatch], torch.Tensor]
"""micro-batch -> its weight in the global normalisation (e.g. number of target tokens)."""


class TrainEngine(EngineIO):
    """Build, shard and train an HF causal LM (or a value model: ``EngineConfig.head="value"``).

    Args:
        model: an HF model directory (``save_pretrained`` output) or a `PretrainedConfig`
            (weights initialised with ``config.seed``, identically on any layout).
        dims: the parallel layout (`ParallelDims` or a string like ``"d4"`` / ``"r2d2"``).
        config: optimizer, schedule, dtype and memory settings.
    """

    offload_state: OffloadState | None = None
    """Set with ``EngineConfig.offload_when_idle``: weights and optimizer state live on the host between calls."""

    def __init__(
        self,
        model: Any,
        dims: ParallelDims | str = "d-1",
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        raw_config = load_hf_config(model)
        # Image+text models get heads that feed visual inputs (engine/vision.py, engine/vision_value.py).
        self.head = make_vlm_head(self.config.head) if is_vlm(raw_config) else make_head(self.config.head)
        self.hf_config = self.head.hf_config(raw_config)
        # Training turns the KV cache off on the model (whose config may be this object); exports keep the base's.
        self.base_use_cache = bool(getattr(self.hf_config, "use_cache", True))
        dims = ParallelDims.parse(dims) if isinstance(dims, str) else dims
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        # Everything that can be wrong with the inputs is checked before the first collective.
        check_features(dims, self.config)
        self.dims = dims.resolve(world)
        check_engine(self.dims, self.hf_config, self.config)
        mesh = None
        if world > 1 or dist.is_initialized():
            init_distributed(timeout_s=self.config.dist_timeout_s)
            mesh = build_mesh(self.dims)
        self.ctx = ParallelContext(dims=self.dims, mesh=mesh, device=current_device(), config=self.config)
        if mesh is None and (ignored := ignored_without_fsdp(self.config)):
            log.warning(
                "a single process trains a plain model without the FSDP wrapper, so these settings have no effect: "
                "%s. Run with 2 or more ranks (--nproc-per-node) to use them, or set engine.param_dtype to train "
                "in another dtype",
                "; ".join(ignored),
            )
        self.model, self.runner = build_model(self.ctx, self.head, self.hf_config, model)
        self.optimizer = build_optimizer(self.model, self.config.optimizer)
        register_moe_checkpoint_hooks(self.model, self.optimizer)  # expert-TP optimizer states in DCP
        self.scheduler = build_scheduler(self.optimizer, self.config.scheduler)
        if self.config.offload_when_idle:  # weights + optimizer state on the host between calls
            self.offload_state = OffloadState(self.model, self.optimizer, self.device)
            self.offload_state.offload()
        self.step = 0

    # ------------------------------------------------------------------ layout
    @property
    def mesh(self) -> Any:
        return self.ctx.mesh

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def param_dtype(self) -> torch.dtype:
        return self.ctx.param_dtype

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.ctx.compute_dtype

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """Ranks holding different data (losses and weights are summed over them)."""
        return self.ctx.dp_group

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def logprob_temperature(self) -> float:
        """Log-probs and entropies are those of softmax(logits / T): RL trainers set T to the
        rollout temperature so ratios compare the same distribution the samples came from."""
        return self.head.temperature

    @logprob_temperature.setter
    def logprob_temperature(self, value: float) -> None:
        self.head.temperature = float(value)

    def all_reduce_sum(self, *values: torch.Tensor | float, group: dist.ProcessGroup | None) -> list[float]:
        """Sum scalars over ``group`` with this engine's device rule (identity without a group)."""
        return all_reduce_sum(*values, group=group, device=self.device)

    def reduce_loss_stats(self, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A loss function's statistics summed over the global batch (by name: sums, ``*_max``, ``*_min``).

        Counts each data-parallel replica once: TP/CP ranks hold copies, and with pp > 1 only the last
        stage's ranks computed the loss. Every rank must pass the same keys; every rank gets the result.
        """
        counts, group = self.runner.stats_report()
        if not counts:
            neutral = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}
            stats = {k: torch.full((), neutral[stat_kind(k)], dtype=torch.float64) for k in stats}
        return all_reduce_stats(stats, group, self.device)

    @contextlib.contextmanager
    def offloaded(self) -> Iterator[None]:
        """Weights and optimizer state in host memory for the block, back on the device after it (a colocated
        rollout engine generates meanwhile: ``offload_train_state_during_rollout``). A call into the engine
        inside the block brings them to the device for the call only, as ``offload_when_idle`` does. A no-op
        on a CPU-only machine (the device is the host) and for an engine with ``offload_when_idle`` (already
        on the host between calls); gradients are not kept between steps, so there are none to move."""
        if self.offload_state is not None:
            yield
            return
        state = OffloadState(self.model, self.optimizer, self.device)
        state.offload()
        self.offload_state = state
        try:
            yield
        finally:
            self.offload_state = None
            state.onload()

    # ------------------------------------------------------------------ compute
    @offloaded_between_calls
    def train_batch(
        self,
        batch: PackedBatch,
        loss_fn: LossFn = sft_loss,
        loss_weight_fn: LossWeightFn = token_count,
    ) -> dict[str, float]:
        """One optimizer step on this rank's share of the global batch; return global stats."""
        wants_entropy = bool(getattr(loss_fn, "wants_entropy", False))
        if wants_entropy and not self.head.has_token_distribution:
            raise ValueError("a value-head engine has no token distribution: its loss_fn cannot want entropy")
        wants_distribution = bool(getattr(loss_fn, "wants_distribution", False))
        if wants_distribution:
            self._check_full_distribution()
        start = time.perf_counter()
        self.model.train()
        mbs = self.runner.microbatches(batch)
        local_weight = sum(
            (loss_weight_fn(mb).detach().double() for _, mb in mbs.items if mb is not None),
            torch.zeros((), dtype=torch.float64),
        )
        [global_weight] = self.all_reduce_sum(local_weight, group=self.dp_group)
        if global_weight <= 0:
            raise ValueError(
                "the global batch has zero loss weight (no target tokens on any rank); check loss_mask "
                "(e.g. completions are empty or were truncated away)"
            )
        fixed = getattr(loss_fn, "fixed_loss_weight", None)  # token-sum: a constant W, not the batch's sum
        if fixed is not None:
            global_weight = float(fixed)
        # FSDP averages gradients over the dp_cp ranks; undo that so the sum is global.
        grad_scale = self.dims.dp_cp / global_weight
        loss_sum, extra = self.runner.forward_backward(
            mbs, loss_fn, grad_scale, wants_entropy=wants_entropy, wants_distribution=wants_distribution
        )
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = self.runner.grad_norm(params, self.config.optimizer.max_grad_norm)
        norm = float(grad_norm)
        finite = math.isfinite(norm)
        # An all-zero gradient (RL: no sequence carries an advantage) moves nothing: AdamW would still move
        # every weight by about lr on its momentum (and decay it), amplifying the last batches' noise.
        zero = norm == 0.0
        if finite and not zero:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        with warnings.catch_warnings():
            # A skipped step (non-finite or all-zero gradient) still advances the schedule, on purpose.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.scheduler.step()
        self.step += 1
        report = self.runner.report_step(loss_sum, batch.num_tokens)
        loss_total, num_tokens = self.all_reduce_sum(*report.values, group=report.group)
        return {
            "loss": loss_total / global_weight,
            "grad_norm": norm,
            "lr": float(lr),
            "loss_weight": global_weight,
            "tokens": num_tokens,
            "microbatches": float(len(mbs.items)),
            "skipped": float(not finite),
            "zero_grad_skipped": float(zero),
            "step_time_s": time.perf_counter() - start,
            **extra,
        }

    @torch.no_grad()
    @offloaded_between_calls
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """[T] target log-probs of this rank's batch (token order of ``batch``); value-head engines
        return [T] per-position values."""
        self.model.eval()
        return self.runner.forward(batch)

    @torch.no_grad()
    @offloaded_between_calls
    def forward_distribution(self, batch: PackedBatch, *, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[T, V] float32 log-probs of each target's whole next-token distribution at ``logprob_temperature``
        (row t: the distribution token t was drawn from; 0 off ``loss_mask``), on the host, and None; with
        ``top_k > 0`` the [T, k] largest log-probs and their [T, k] token ids (memory: T x k, not T x V)."""
        self._check_full_distribution()
        if top_k < 0:
            raise ValueError(f"top_k={top_k} must be >= 0 (0 = the whole vocabulary)")
        self.model.eval()
        return self.runner.forward_distribution(batch, top_k)

    def _check_full_distribution(self) -> None:
        if not self.head.has_full_distribution:
            raise ValueError(
                f"this engine's head ({type(self.head).__name__}) has no full next-token distribution: "
                "full-vocabulary losses need a causal-LM head on a text model"
            )
        if self.dims.tp > 1 or self.dims.pp > 1:
            raise ValueError(
                f"full-vocabulary distributions need the whole vocabulary and the whole model on each rank; this "
                f"layout has tp={self.dims.tp}, pp={self.dims.pp}: use tp=1 and pp=1 (FSDP/HSDP/CP layouts)"
            )

    @torch.no_grad()
    @offloaded_between_calls
    def eval_batch(
        self,
        batch: PackedBatch,
        loss_fn: LossFn = sft_loss,
        loss_weight_fn: LossWeightFn = token_count,
    ) -> dict[str, float]:
        """Global loss of a batch without updating anything."""
        self.model.eval()
        report = self.runner.eval_sums(batch, loss_fn, loss_weight_fn)
        total, weight_total = self.all_reduce_sum(*report.values, group=report.group)
        return {"loss": total / max(weight_total, 1e-12), "loss_weight": weight_total}
