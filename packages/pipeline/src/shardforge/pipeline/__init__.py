"""shardforge.pipeline: Pipeline parallelism for HF decoders.

Not implemented yet; this package only reserves its name and dependencies.
Planned: see the package README.
"""

__version__ = "0.1.0"

__all__: list[str] = []
