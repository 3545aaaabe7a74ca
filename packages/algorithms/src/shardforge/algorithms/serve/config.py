"""`ServeConfig`: what `shardforge serve` serves and its limits."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServeConfig"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServeConfig:
    """Options of the Tinker-compatible service."""

    model_dir: str
    """The HF base model directory (save_pretrained) with its tokenizer."""
    base_model: str | None = None
    """The name clients pass as ``base_model`` (None: the directory name; the directory path is accepted too)."""
    output_dir: str = "runs/serve"
    """Where ``save_state`` writes checkpoints (one folder per tenant)."""
    lora_alpha: float = 32.0
    """LoRA alpha of every adapter (scaling = alpha / rank)."""
    max_tokens: int = 1024
    """The largest ``max_tokens`` a sample request may ask."""
    max_batch_tokens: int = 65536
    """The most tokens one forward_backward request may hold."""
    max_request_bytes: int = 64 * 1024**2
    """Larger request bodies are refused with 413."""
    workers: int = 2
    """Worker threads: jobs of different training models run at once (one model's jobs run in order)."""
    batch_tenants: bool = True
    """Run different LoRA tenants' queued forward(_backward) requests as one batch over the shared base (False:
    each request runs alone, different tenants' in parallel on the worker threads)."""
    batch_window_s: float = 0.02
    """How long a batch of LoRA tenants' forward_backward requests waits for the next request of tenants that are
    stepping (0: batch only what is already queued; a lone tenant never waits)."""
    batch_spread: bool | None = None
    """Split the stepping tenants' requests over the workers, a batch each, instead of one batch (None: on CPU,
    where each worker's batch runs on its own core; not on an accelerator, where one bigger batch saves time)."""
    loggers: tuple[str, ...] = ()
    """Loggers (`shardforge.algorithms.loggers.LOGGERS`: jsonl, tensorboard, wandb, mlflow) that get each training
    client's step metrics under ``output_dir/<tenant>/<model_id>/`` (empty: only ``/metrics``)."""
    poll_wait_s: float = 5.0
    """How long ``retrieve_future`` waits for a pending result before answering ``try_again``."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "max_batch_tokens", "max_request_bytes", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.batch_window_s < 0:
            raise ValueError(f"batch_window_s={self.batch_window_s} must be >= 0 (0: no waiting)")
        if self.lora_alpha <= 0:
            raise ValueError(f"lora_alpha={self.lora_alpha} must be > 0")
