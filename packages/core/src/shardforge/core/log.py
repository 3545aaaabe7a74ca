"""`logging` for shardforge: ``[shardforge] message``, rank 0 only unless the level is DEBUG.

    from shardforge.core.log import get_logger
    log = get_logger(__name__)
    log.info("done: %s", summary)

The CLI calls `setup_logging` with ``--log-level``; a library user may call it too or
configure the ``shardforge`` logger themselves.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["RankZeroFilter", "get_logger", "rank_log_file", "setup_logging"]

_ROOT = "shardforge"
_FORMAT = "[shardforge] %(message)s"


def _rank() -> int:
    # A process group can only exist once torch.distributed is imported: never import torch just to log a line.
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        try:
            if dist.is_available() and dist.is_initialized():
                return int(dist.get_rank())
        except RuntimeError:
            pass
    return int(os.environ.get("RANK", "0"))


class RankZeroFilter(logging.Filter):
    """Let records through on rank 0 only (RANK env var, or the process group's rank once initialised)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _rank() == 0


def get_logger(name: str) -> logging.Logger:
    """The logger for ``name`` under the ``shardforge`` hierarchy (module ``__name__`` works as is)."""
    return logging.getLogger(name if name == _ROOT or name.startswith(_ROOT + ".") else f"{_ROOT}.{name}")


def setup_logging(level: int | str = "INFO") -> logging.Logger:
    """Install one stdout handler (where the CLI's messages always went) on the ``shardforge``
    logger, replacing the one a previous call installed, and set its level.

    Below DEBUG every rank logs; at INFO and above only rank 0 does.
    """
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        if getattr(handler, "_shardforge", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(_FORMAT))
    if numeric > logging.DEBUG:
        handler.addFilter(RankZeroFilter())
    handler._shardforge = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(numeric)
    logger.propagate = False
    return logger


class _LazyFileHandler(logging.FileHandler):
    """Creates its directory and file at the first record (a run refused early leaves nothing behind)."""

    def _open(self):  # type: ignore[no-untyped-def]
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextmanager
def rank_log_file(directory: str | Path, rank: int | None = None) -> Iterator[Path]:
    """While active, every record the ``shardforge`` logger emits on this rank also goes to
    ``directory/rank{R}.log`` (appended, with time, rank and level), whatever the console shows:
    the console prints rank 0 only, the files keep every rank's messages for debugging a hang or a
    rank-specific error."""
    rank = _rank() if rank is None else rank
    path = Path(directory) / f"rank{rank}.log"
    handler = _LazyFileHandler(path, mode="a", delay=True)  # nothing is created until a record comes
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger(_ROOT)
    logger.addHandler(handler)
    try:
        yield path
    finally:
        logger.removeHandler(handler)
        handler.close()
