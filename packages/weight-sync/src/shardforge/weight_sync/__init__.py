"""shardforge.weight_sync: Push trained weights from sharded trainers into inference engines.

Not implemented yet; this package only reserves its name and dependencies.
Planned: see the package README.
"""

__version__ = "0.1.0"

__all__: list[str] = []
