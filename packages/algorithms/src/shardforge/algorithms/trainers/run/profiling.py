"""``profile:`` — torch.profiler traces of chosen training steps, one Chrome trace per rank.

Open a trace in https://ui.perfetto.dev or chrome://tracing. CPU activity is always recorded;
CUDA kernels too when a GPU is present.

RL steps mark their phases with `phase` (``shardforge/generate``, ``shardforge/weight_sync``, ...): named
ranges in the trace, so a step's time splits into generation, log-prob passes, training and publishing.
Every phase's wall time is also summed per step and logged as ``timing_s/<phase>`` (with
``timing_s/step``), traced or not, as verl's ``timing_s/*`` and TRL's timing logs do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.profiler

__all__ = ["PHASES", "ProfileConfig", "StepProfiler", "phase", "take_phase_seconds"]

logger = logging.getLogger(__name__)


PHASES: dict[str, str] = {
    "generate": "rollout generation and reward scoring (async rollouts: in the generator thread)",
    "rollout_wait": "async rollouts: the trainer waiting for the generator's batch",
    "reward_model": "a reward model scoring the rollouts",
    "old_logprobs": "the training engine's forward for the old (proximal) log-probs",
    "ref_logprobs": "the frozen reference policy's forward",
    "values": "the critic's forward for the old values (PPO)",
    "train": "the optimiser update(s): forward, backward, step",
    "weight_sync": "publishing the new weights to the rollout engine",
}
"""The phase names `phase` accepts (the trace shows them as ``shardforge/<name>``) and what each covers."""


_seconds: dict[str, float] = {}
_seconds_lock = threading.Lock()


def phase(name: str) -> AbstractContextManager[None]:
    """A named range ``shardforge/<name>`` in a torch.profiler trace around one phase of a step
    (`PHASES`), and its wall time added to this step's ``timing_s/<name>`` (`take_phase_seconds`).
    Outside a traced step it costs a few microseconds. Phases run by another thread (the async
    rollout generator) add their time too: there ``timing_s/generate`` overlapped training."""
    if name not in PHASES:
        raise ValueError(f"unknown step phase {name!r}; known phases: {sorted(PHASES)}")
    return _timed_phase(name)


@contextmanager
def _timed_phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(f"shardforge/{name}"):
            yield
    finally:
        elapsed = time.perf_counter() - start
        with _seconds_lock:
            _seconds[name] = _seconds.get(name, 0.0) + elapsed


def take_phase_seconds() -> dict[str, float]:
    """The wall seconds each phase took since the last call (this process), and reset them."""
    with _seconds_lock:
        taken = dict(_seconds)
        _seconds.clear()
    return taken


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileConfig:
    """Which steps and ranks to trace (``profile.enabled=true profile.start_step=5``)."""

    enabled: bool = False
    """Record a torch.profiler trace of ``steps`` training steps starting at ``start_step``."""
    start_step: int = 2
    """First traced step (1-based; the default skips the first step's warm-up)."""
    steps: int = 2
    """How many consecutive steps to trace."""
    ranks: tuple[int, ...] | None = None
    """Global ranks that record (None = every rank)."""
    record_shapes: bool = False
    """Record operator input shapes (bigger traces)."""
    profile_memory: bool = False
    """Record tensor allocations and frees, and write a memory snapshot of the traced steps next to the
    trace: on a GPU ``torch.cuda.memory`` history (``..._memory.pickle``, opens in pytorch.org/memory_viz);
    on CPU the profiler's per-operator memory table (``..._memory.txt``)."""
    with_stack: bool = False
    """Record Python stacks (much bigger traces)."""

    def __post_init__(self) -> None:
        if self.start_step < 1 or self.steps < 1:
            raise ValueError(
                f"profile.start_step={self.start_step} and profile.steps={self.steps} must both be >= 1 "
                "(start_step counts training steps from 1)"
            )


class StepProfiler:
    """Starts torch.profiler before step ``start_step`` and writes the trace after the last traced step
    (or at `close` when the run ends or stops first) to ``out_dir/profile/rank{R}_steps{A}-{B}.json``."""

    def __init__(self, config: ProfileConfig, out_dir: Path, rank: int) -> None:
        self.config = config
        self.dir = Path(out_dir) / "profile"
        self.rank = rank
        self.active = config.enabled and (config.ranks is None or rank in config.ranks)
        self._profiler: Any = None
        self._first = 0
        self._last = 0
        self.trace: Path | None = None
        self.memory: Path | None = None

    def before_step(self, step: int) -> None:
        """``step`` is the 1-based number of the step about to run."""
        if not self.active or self._profiler is not None or step != self.config.start_step:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profiler = profile(
            activities=activities,
            record_shapes=self.config.record_shapes,
            profile_memory=self.config.profile_memory,
            with_stack=self.config.with_stack,
        )
        if self.config.profile_memory and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self._profiler.__enter__()
        self._first = step

    def after_step(self, step: int) -> None:
        if self._profiler is None:
            return
        self._last = step
        if step >= self.config.start_step + self.config.steps - 1:
            self.close()

    def close(self) -> None:
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.__exit__(None, None, None)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.trace = self.dir / f"rank{self.rank}_steps{self._first}-{max(self._last, self._first)}.json"
        profiler.export_chrome_trace(str(self.trace))
        if self.config.profile_memory:
            self.memory = self._memory_snapshot(profiler, self.trace.with_suffix(""))
        self.active = False
        logger.info("profiler trace of steps %d-%d: %s", self._first, max(self._last, self._first), self.trace)

    @staticmethod
    def _memory_snapshot(profiler: Any, stem: Path) -> Path:
        """The traced steps' memory: CUDA allocator history on a GPU, else the profiler's memory table."""
        import torch

        if torch.cuda.is_available():
            path = stem.parent / f"{stem.name}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
        else:
            path = stem.parent / f"{stem.name}_memory.txt"
            table = profiler.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=40)
            path.write_text(table + "\n")
        logger.info("memory snapshot of the traced steps: %s", path)
        return path
