"""shardforge.algorithms.serve: long-running services. Here: a self-hosted Tinker-compatible training service
(`shardforge serve`) that the official ``tinker`` SDK drives (docs/tinker.md).

Needs the ``serve`` extra (``pip install shardforge-algorithms[serve]``: the tinker SDK, whose generated protobuf
messages are the wire codec, FastAPI and uvicorn).
"""

from shardforge.algorithms.serve.config import ServeConfig

__all__ = ["ServeConfig"]
