"""shardforge.moe_ep: Expert parallelism for HF fused-expert MoE blocks.

Not implemented yet; this package only reserves its name and dependencies.
Planned: see the package README.
"""

__version__ = "0.1.0"

__all__: list[str] = []
