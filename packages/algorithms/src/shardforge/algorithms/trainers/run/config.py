"""The config fields every trainer shares (`TrainerConfig`) and the tokenizer they load."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from shardforge.algorithms.data.config import DataConfig, check_data_fields
from shardforge.algorithms.loggers import TrackerConfig
from shardforge.algorithms.trainers.run.profiling import ProfileConfig
from shardforge.engine.config import EngineConfig

__all__ = ["TrainerConfig", "load_tokenizer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerConfig:
    """The fields every trainer has; YAML keys mirror the field names."""

    model: str
    """HF model directory to start from (config.json + safetensors)."""
    output_dir: str
    """Metrics, TensorBoard logs, checkpoints and the exported model."""
    train_file: str | None = None
    """Training JSONL (rows, preference pairs or prompts, per trainer); required unless the trainer reads
    ``data`` and data.train or data.mix is set."""
    tokenizer: str | None = None
    """Tokenizer directory; None = the model directory."""
    eval_file: str | None = None
    """Optional held-out JSONL for periodic evaluation."""
    data: DataConfig = field(default_factory=DataConfig)
    """Dataset sources beyond one JSONL path: files, save_to_disk dirs, HF names, weighted mixtures and a
    chat-template override (docs/packages/algorithms-data.md); trainers with ``reads_data_sources``."""
    layout: str = "d-1"
    """Parallel layout, e.g. 'd2' (FSDP 2), 'r2d2' (HSDP); d-1 = all ranks FSDP; 'auto' (the CLI) = the
    planner's best data-parallel layout for the model, world size and memory, printed at start."""
    steps: int = 100
    """Optimizer steps (RL trainers: one rollout batch each)."""
    eval_every: int = 0
    """Evaluate every this many steps (0 = only at the end, when eval_file is set)."""
    log_every: int = 1
    """Write train metrics every this many steps (and at the last step)."""
    seed: int = 0
    """Data-order (and sampling) seed."""
    export_hf_at_end: bool = True
    """Write an HF model directory to output_dir/hf (and LoRA adapters to output_dir/lora) at the end."""
    save_every: int = 0
    """Save a DCP checkpoint to output_dir/checkpoints every this many steps (0 = never)."""
    resume: Literal["auto", "latest_valid", "never", "force"] = "auto"
    """auto: continue from the newest committed checkpoint in output_dir/checkpoints, if any (a damaged one
    is an error naming the file), when the run that wrote it had the same experiment config (model, data,
    optimizer, loss, ...; changed steps, cadences and layout are listed and allowed; another experiment is an
    error naming the keys, docs/runs.md). latest_valid: the same, but skip damaged checkpoints (each logged)
    and continue from the newest intact one. never: start from step 0. force: as auto, continuing even
    under another experiment's config (the differences are logged)."""
    keep_last: int = 2
    """Committed checkpoints to keep."""
    async_checkpoint: Literal["off", "async", "async_pinned"] = "off"
    """Write checkpoints in the background (committed before the next save and at the end)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine settings (optimizer, schedule, dtype, micro-batch budget, ...)."""
    loggers: tuple[str, ...] = ("jsonl", "tensorboard")
    """Metric sinks by name (`shardforge list` shows them; or a user's ``package.module:factory``). Rank 0
    only; a sink that fails is reported once and disabled, training goes on. Keep jsonl: resume, curves.png
    and the summary read metrics.jsonl."""
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    """Options of the wandb/mlflow loggers: project, run_name, tags, wandb_entity, wandb_mode,
    mlflow_tracking_uri, log_artifacts (docs/packages/algorithms-tracking.md)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """torch.profiler traces of chosen steps and ranks (trainers/profiling.py), off by default."""
    hang_dump_s: float | None = None
    """Write every thread's Python stack to output_dir/logs/stacks-rank{R}.txt when a step (or eval) runs longer
    than this many seconds; None = 0.9 x engine.dist_timeout_s (before a peer's collective times out), 0 = off.
    A collective timeout then names the stuck ranks (docs/multinode.md, 'When a run hangs')."""

    reads_data_sources: ClassVar[bool] = False
    """True for trainers that load `data` sources (sft, rm, dpo, grpo, ppo, distill); the others read
    train_file/eval_file only."""

    def __post_init__(self) -> None:
        check_data_fields(self, type(self).__name__, self.reads_data_sources)
        for name, low in (("steps", 1), ("log_every", 1), ("keep_last", 1), ("eval_every", 0), ("save_every", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)} is invalid; it must be >= {low}")
        if self.hang_dump_s is not None and self.hang_dump_s < 0:
            raise ValueError(f"hang_dump_s={self.hang_dump_s} is invalid; use seconds > 0, 0 (off) or null (default)")


def load_tokenizer(config: TrainerConfig) -> Any:
    """The tokenizer of ``config.tokenizer`` (or the model directory); a missing directory is an error."""
    from transformers import AutoTokenizer

    tokenizer_dir = config.tokenizer or config.model
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir!r} does not exist")
    return AutoTokenizer.from_pretrained(tokenizer_dir)
