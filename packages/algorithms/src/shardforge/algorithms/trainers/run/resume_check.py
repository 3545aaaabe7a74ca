"""Refuse to continue a checkpoint with a config that makes it another experiment.

A run resumes from ``output_dir``'s newest checkpoint by default (``resume: auto``). That is right when
the same run restarts, and wrong when a later run reuses the folder with another model, data, learning
rate or loss: the new run would silently start from the old one's weights. Each run writes its resolved
config to ``output_dir/config.json``; on resume the new resolved config is compared with it, key by key.

- Harmless keys (how long, how often, where, on which layout) are listed in one warning and allowed.
- Any other difference (model, data, optimizer, loss, schedule shape, seeds, rollout, ...) is an error
  listing the keys and the ways out: ``resume=never`` (start over in this folder), another ``output_dir``,
  or ``resume=force`` (continue anyway; the differences are logged).

Unknown keys count as experiment keys: a new option is guarded until someone decides it is harmless.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

__all__ = ["HARMLESS_KEYS", "ResumeConfigMismatch", "check_resume_config", "config_differences"]

# Dotted keys (prefixes where they end in "." or "_"; "*" matches one list index or key) whose change keeps
# the continuation the same experiment.
HARMLESS_KEYS: tuple[str, ...] = (
    # length, cadence, outputs
    "steps",
    "eval_every",
    "log_every",
    "save_every",
    "keep_last",
    "resume",
    "output_dir",
    "export_hf_at_end",
    "async_checkpoint",
    "progress",
    "loggers",
    "tracker.",
    "profile.",
    "hang_dump_s",
    "eval_file",
    # layout and memory/speed settings: the same math in another float order
    "layout",
    "engine.scheduler.total_steps",  # follows ``steps`` unless set
    "engine.max_tokens_per_microbatch",
    "engine.activation_checkpointing",
    "engine.checkpoint_every",
    "engine.tiled_mlp_shards",
    "engine.sequence_parallel",
    "engine.data_parallel",
    "engine.reshard_after_forward",
    "engine.share_prefixes",
    "engine.fsdp_",
    "engine.cpu_offload",
    "engine.offload_when_idle",
    "engine.pp_",
    "engine.dist_timeout_s",
    "engine.optimizer.fused",
    "engine.lora.base_model_name_or_path",  # what the exported adapter names as its base, nothing more
    "critic_engine.lora.base_model_name_or_path",
    "rollout.placement",
    "rollout.num_actors",
    "rollout.on_actor_failure",
    "rollout.sleep",
    "rollout.publish_in_memory",
    "rollout.batch_size",
    # a mixture's weights may change on resume (a curriculum): each source continues where it left off
    "data.mix.*.weight",
)


class ResumeConfigMismatch(ValueError):
    """The checkpoint in output_dir was written by a run with another experiment's config."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys; a list of mappings (data sources) by index, other lists as one value."""
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        value = {str(index): item for index, item in enumerate(value)} | {"<count>": len(value)}
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat |= _flatten(item, f"{prefix}{key}.")
        return flat or {prefix[:-1]: {}}
    return {prefix[:-1]: tuple(value) if isinstance(value, list) else value}


def _harmless(key: str) -> bool:
    for pattern in HARMLESS_KEYS:
        if "*" in pattern:
            if fnmatch.fnmatchcase(key, pattern) and key.count(".") == pattern.count("."):
                return True
        elif key == pattern or (pattern.endswith((".", "_")) and key.startswith(pattern)):
            return True
    return False


def config_differences(previous: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``(experiment, harmless)``: dotted keys whose values differ, each as ``key: old -> new``."""
    # Both as JSON sees them (config.json is JSON): tuples and lists compare equal, nested ones too.
    old, new = _flatten(json.loads(json.dumps(previous))), _flatten(json.loads(json.dumps(current)))
    experiment: list[str] = []
    harmless: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key, "<absent>") == new.get(key, "<absent>"):
            continue
        line = f"{key}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}"
        (harmless if _harmless(key) else experiment).append(line)
    return experiment, harmless


def check_resume_config(
    previous: dict[str, Any] | None, current: dict[str, Any], *, mode: str, checkpoint: str, step: int
) -> list[str]:
    """Raise `ResumeConfigMismatch` on an experiment change (unless ``mode == "force"``); return the notes.

    ``previous`` is None where the folder has no config.json (a run of an older version): nothing to check.
    """
    if previous is None:
        return []
    experiment, harmless = config_differences(previous, current)
    notes = []
    if harmless:
        notes.append(f"resuming {checkpoint} (step {step}) with changed settings: {'; '.join(harmless)}")
    if experiment:
        listed = "; ".join(experiment)
        if mode != "force":
            raise ResumeConfigMismatch(
                f"output_dir holds a checkpoint (step {step}, {checkpoint}) of a different experiment: {listed}. "
                "Start over in this folder with resume=never, choose a new output_dir, or continue anyway with "
                "resume=force"
            )
        notes.append(f"resume=force: continuing step {step} of {checkpoint} under another config: {listed}")
    return notes
