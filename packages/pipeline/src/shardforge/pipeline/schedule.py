"""Run pipeline stages through a `torch.distributed.pipelining` schedule chosen by name.

Micro-batches enter as stacked tensors ``[M, ...]`` (M micro-batches of one fixed shape:
pipelining sends activations of a static shape between ranks); the schedule splits them
on dim 0, so every stage sees ``[1, ...]`` slices: ``inputs`` go to the first stage, every
keyword tensor (position ids, cu_seqlens, labels, ...) to every stage.

Losses are *sums* (``scale_grads=False``): the schedule never divides gradients by M, so
the caller's normalisation (e.g. by the global token count) is the only one applied.

The caller's loss function sees real micro-batches only: on a schedule's first step torch runs
backward *metadata inference*, which calls the loss once on the output of placeholder inputs;
that call gets a zero loss of the same graph here and never reaches the caller (whose loss may
record statistics or check its inputs are finite).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)

from shardforge.pipeline.layout import StageStyle

__all__ = ["SCHEDULES", "MicrobatchLossFn", "Pipeline", "ScheduleSpec", "resolve_schedule", "valid_num_microbatches"]

MicrobatchLossFn = Callable[[torch.Tensor, int], torch.Tensor]
"""(last-stage output of one micro-batch, its index) -> summed loss (0-dim)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """A schedule from `torch.distributed.pipelining` and how it places stages on ranks."""

    name: str
    """Canonical name (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``)."""
    cls: type
    """The torch schedule class."""
    multi_stage: bool
    """Whether it runs several (virtual) stages per rank."""
    default_stages_per_rank: int
    """Stages per rank when not given."""
    style: StageStyle
    """Stage placement: looped (``r, r + pp, ...``) or V-shaped (``r, 2 pp - 1 - r``)."""


SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name.lower(): spec
    for spec in (
        ScheduleSpec(name="GPipe", cls=ScheduleGPipe, multi_stage=False, default_stages_per_rank=1, style="loop"),
        ScheduleSpec(name="1F1B", cls=Schedule1F1B, multi_stage=False, default_stages_per_rank=1, style="loop"),
        ScheduleSpec(
            name="Interleaved1F1B",
            cls=ScheduleInterleaved1F1B,
            multi_stage=True,
            default_stages_per_rank=2,
            style="loop",
        ),
        ScheduleSpec(
            name="ZBVZeroBubble", cls=ScheduleZBVZeroBubble, multi_stage=True, default_stages_per_rank=2, style="v"
        ),
    )
}
_ALIASES = {"zbv": "zbvzerobubble", "zb-v": "zbvzerobubble", "interleaved": "interleaved1f1b"}


def _in_metadata_inference(depth: int = 8) -> bool:
    """Whether torch's stage metadata inference (not a real micro-batch) is calling the loss."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if "metadata_inference" in frame.f_code.co_name:
            return True
        frame = frame.f_back
    return False


def resolve_schedule(name: str) -> ScheduleSpec:
    """The `ScheduleSpec` for a (case-insensitive) name; raise listing the valid names."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in SCHEDULES:
        valid = [s.name for s in SCHEDULES.values()] + ["ZBV (alias)"]
        raise ValueError(f"unknown pipeline schedule {name!r}; valid: {valid}")
    return SCHEDULES[key]


def valid_num_microbatches(schedule: str, pp: int, at_least: int) -> int:
    """The smallest micro-batch count >= ``at_least`` that ``schedule`` accepts at ``pp`` ranks.

    1F1B needs at least ``pp`` micro-batches; Interleaved1F1B needs a count divisible by its
    number of rounds ``max(1, M // pp)``; GPipe and ZB-V take any count >= 1.
    """
    spec = resolve_schedule(schedule)
    count = max(1, at_least)
    if spec.name == "1F1B":
        return max(count, pp)
    if spec.name == "Interleaved1F1B":
        while count % max(1, count // pp) != 0:
            count += 1
    return count


class Pipeline:
    """This rank's stages run through one named schedule over the ``pp`` process group.

    Args:
        stages: this rank's stage modules (e.g. from `split_decoder`), each with
            ``stage_index`` and ``num_stages`` attributes, in increasing stage order.
        schedule: a name from `SCHEDULES` (``GPipe``, ``1F1B``, ``Interleaved1F1B``, ``ZBVZeroBubble``).
        group: the pipeline process group (e.g. ``mesh.get("pp").get_group()``).
        device: where activations live (``cuda:<i>`` or ``cpu``).
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        *,
        schedule: str,
        group: dist.ProcessGroup,
        device: torch.device | str,
    ) -> None:
        self.spec = resolve_schedule(schedule)
        self.stages = list(stages)
        self.group = group
        self.device = torch.device(device)
        pp = dist.get_world_size(group)
        if not self.spec.multi_stage and len(self.stages) != 1:
            raise ValueError(f"{self.spec.name} runs one stage per rank, got {len(self.stages)}; use Interleaved1F1B")
        num_stages = {int(getattr(s, "num_stages", -1)) for s in self.stages}
        if len(num_stages) != 1 or num_stages.pop() != pp * len(self.stages):
            raise ValueError(
                f"{len(self.stages)} stage(s) per rank on pp={pp} ranks need num_stages={pp * len(self.stages)} "
                f"on every stage, got {[getattr(s, 'num_stages', None) for s in self.stages]}"
            )
        self.pp = pp
        self._schedules: dict[tuple[int, bool], Any] = {}
        self._loss_fn: MicrobatchLossFn | None = None

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss (holds the last stage)."""
        return any(getattr(s, "is_last", False) for s in self.stages)

    @property
    def has_first_stage(self) -> bool:
        return any(getattr(s, "is_first", False) for s in self.stages)

    def _schedule(self, num_microbatches: int, train: bool) -> Any:
        key = (num_microbatches, train)
        if key not in self._schedules:
            # Fresh PipelineStage wrappers per schedule: a stage's communication buffers are set
            # up for one micro-batch count and one mode (with or without backward).
            torch_stages = [
                PipelineStage(s, _attr(s, "stage_index"), _attr(s, "num_stages"), self.device, group=self.group)
                for s in self.stages
            ]
            loss = self._call_loss if train else None
            first = torch_stages[0] if not self.spec.multi_stage else torch_stages
            cls = self.spec.cls
            if not train and self.spec.style == "v":
                cls = _forward_only_v_schedule()
            self._schedules[key] = cls(first, num_microbatches, loss_fn=loss, scale_grads=False)
        return self._schedules[key]

    def _call_loss(self, output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None, "loss_fn is set by Pipeline.step"
        if _in_metadata_inference():
            return output.float().sum() * 0.0  # shapes only: placeholder inputs, not a micro-batch
        return self._loss_fn(output, int(index.reshape(-1)[0]))

    def step(self, inputs: torch.Tensor, *, loss_fn: MicrobatchLossFn, **kwargs: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward of ``M = inputs.shape[0]`` micro-batches; gradients accumulate.

        ``loss_fn(output, i)`` returns micro-batch ``i``'s summed loss on the last stage; its
        gradient is what flows back. Returns the per-micro-batch losses on the rank holding
        the last stage and an empty list elsewhere. Collective over the pp group.
        """
        num_microbatches = self._check(inputs, kwargs)
        schedule = self._schedule(num_microbatches, train=True)
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        target = torch.arange(num_microbatches)
        args = (inputs,) if self.has_first_stage else ()
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return losses if self.has_last_stage else []

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | None:
        """Forward only: the last stage's outputs stacked ``[M, ...]`` on its rank, None elsewhere."""
        num_microbatches = self._check(inputs, kwargs)
        schedule = self._schedule(num_microbatches, train=False)
        args = (inputs,) if self.has_first_stage else ()
        out = schedule.step(*args, **kwargs)
        return out if self.has_last_stage else None

    def _check(self, inputs: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> int:
        num_microbatches = int(inputs.shape[0])
        bad = {k: tuple(v.shape) for k, v in kwargs.items() if v.shape[0] != num_microbatches}
        if bad:
            raise ValueError(f"every keyword tensor needs {num_microbatches} micro-batches on dim 0, got {bad}")
        valid = valid_num_microbatches(self.spec.name, self.pp, num_microbatches)
        if valid != num_microbatches:
            raise ValueError(
                f"{self.spec.name} at pp={self.pp} cannot run {num_microbatches} micro-batches; the next valid count "
                f"is {valid} (see valid_num_microbatches)"
            )
        return num_microbatches


def _attr(module: nn.Module, name: str) -> int:
    value = getattr(module, name, None)
    if not isinstance(value, int):
        raise TypeError(f"pipeline stage {type(module).__name__} needs an int attribute {name!r} (see DecoderStage)")
    return value


def _forward_only_v_schedule() -> type:
    """A forward-only schedule for V-placed stages (rank r runs stages r and 2 pp - 1 - r).

    torch's ZB-V runtime (2.13) still executes its backward actions when run without a loss
    and fails, and its schedule validation insists on backward actions, so inference uses
    this one: every rank runs all micro-batches of its first stage, then all of its second
    (GPipe order); torch's lowering adds the sends/receives. It builds on torch's private
    schedule IR (`_PipelineScheduleRuntime`, `_Action`, `_add_send_recv`).
    """
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
    from torch.distributed.pipelining.schedules import (
        _Action,
        _add_send_recv,
        _add_unshard_reshard,
        _ComputationType,
        _PipelineScheduleRuntime,
    )

    class ForwardOnlyV(_PipelineScheduleRuntime):  # type: ignore[misc]
        def __init__(self, stages: list[Any], n_microbatches: int, **kwargs: Any) -> None:
            super().__init__(stages=stages, n_microbatches=n_microbatches, **kwargs)
            pp, num_stages = stages[0].group_size, stages[0].num_stages
            mapping = generate_stage_to_rank_mapping(pp, num_stages, style="v")
            self.stage_index_to_group_rank = mapping
            for stage in self._stages:
                stage.stage_index_to_group_rank = mapping
            order: dict[int, list[Any]] = {}
            for rank in range(pp):
                ids = sorted(s for s, r in mapping.items() if r == rank)
                actions: list[Any] = [
                    _Action(s, _ComputationType.FORWARD, mb) for s in ids for mb in range(n_microbatches)
                ]
                order[rank] = _add_unshard_reshard(actions)
            self.pipeline_order = order
            self.pipeline_order_with_comms = _add_send_recv(
                order, stage_to_rank=lambda s: mapping[s], num_stages=num_stages
            )

    return ForwardOnlyV
