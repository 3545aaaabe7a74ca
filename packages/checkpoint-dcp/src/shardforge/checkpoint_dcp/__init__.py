"""shardforge.checkpoint_dcp: Resumable, reshardable, crash-safe checkpoints with torch.distributed.checkpoint, and HF import/export.

Not implemented yet; this package only reserves its name and dependencies.
Planned: see the package README.
"""

__version__ = "0.1.0"

__all__: list[str] = []
