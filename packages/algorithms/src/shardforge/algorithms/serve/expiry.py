"""Checkpoint time-to-live: the SDK's ``ttl_seconds`` (on ``save_state``, ``save_weights_for_sampler`` and
``save_weights_external``) and ``RestClient.set_checkpoint_ttl_from_tinker_path``.

A model's expiry times live in one small JSON file next to its checkpoints,
``<output_dir>/<tenant>/<model_id>/.expiry.json`` (``{checkpoint_id: unix time}``), written atomically (a
temporary file renamed into place), so they survive a service restart and never mix into a checkpoint's or an
export's own files. An expired checkpoint is deleted by `ExpiryBook.sweep`: the service sweeps a model before
listing its checkpoints or reading one, and sweeps everything on a timer (`SWEEP_EVERY_S`), so a client never
sees one past its time. Sampler weights (in memory) expire the same way while the service runs.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from shardforge.algorithms.serve.checkpoints import check_name
from shardforge.algorithms.serve.futures import UserError

__all__ = ["SWEEP_EVERY_S", "TTL_MAX_S", "TTL_MIN_S", "ExpiryBook", "check_ttl"]

TTL_MIN_S = 3600
"""The shortest TTL the API takes (the hosted service's bound: one hour)."""
TTL_MAX_S = 10 * 365 * 24 * 3600
"""The longest (ten years)."""
SWEEP_EVERY_S = 60.0
"""How often the service deletes expired checkpoints in the background."""

_FILE = ".expiry.json"

Delete = Callable[[str, str, str], None]
"""``delete(tenant, model_id, checkpoint_id)``: remove one checkpoint (KeyError when it is gone already)."""


def check_ttl(value: object) -> int | None:
    """``ttl_seconds`` as an int, or None (never expires); a UserError (400) that says the valid range otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not TTL_MIN_S <= value <= TTL_MAX_S:
        raise UserError(
            f"ttl_seconds={value!r} must be an integer number of seconds from {TTL_MIN_S} (1 hour) to {TTL_MAX_S} "
            "(10 years), or null (never expires)"
        )
    return value


class ExpiryBook:
    """The expiry times of every tenant's checkpoints under ``root`` (see the module doc).

    Args:
        root: the service's output directory.
        delete: removes an expired checkpoint.
        clock: seconds since the epoch (tests move it forward).
    """

    def __init__(self, root: Path, delete: Delete, clock: Callable[[], float] = time.time) -> None:
        self.root = root
        self.delete = delete
        self.clock = clock
        self._lock = threading.Lock()

    def _file(self, tenant: str, model_id: str) -> Path:
        return self.root / tenant / check_name(model_id, "model id") / _FILE

    def _read(self, file: Path) -> dict[str, float]:
        try:
            return {str(k): float(v) for k, v in json.loads(file.read_text()).items()}
        except FileNotFoundError:
            return {}

    def _write(self, file: Path, book: dict[str, float]) -> None:
        if not book:
            file.unlink(missing_ok=True)
            return
        file.parent.mkdir(parents=True, exist_ok=True)
        staging = file.with_name(f"{_FILE}.{uuid.uuid4().hex[:8]}")
        staging.write_text(json.dumps(book, sort_keys=True))
        os.replace(staging, file)

    def set(self, tenant: str, model_id: str, checkpoint_id: str, ttl_s: int | None) -> None:
        """Expire ``checkpoint_id`` ``ttl_s`` seconds from now (None: never)."""
        with self._lock:
            file = self._file(tenant, model_id)
            book = self._read(file)
            if ttl_s is None:
                book.pop(checkpoint_id, None)
            else:
                book[checkpoint_id] = self.clock() + ttl_s
            self._write(file, book)

    def expires_at(self, tenant: str, model_id: str) -> dict[str, str]:
        """``{checkpoint_id: ISO time}`` of the model's checkpoints that have a TTL."""
        book = self._read(self._file(tenant, model_id))
        return {cid: datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat() for cid, at in book.items()}

    def sweep_model(self, tenant: str, model_id: str) -> list[str]:
        """Delete the model's expired checkpoints; their ids."""
        with self._lock:
            file = self._file(tenant, model_id)
            book = self._read(file)
            now = self.clock()
            gone = [cid for cid, at in book.items() if at <= now]
            for cid in gone:
                try:
                    self.delete(tenant, model_id, cid)
                except KeyError:  # deleted by hand, or sampler weights of an earlier service run
                    pass
                del book[cid]
            if gone:
                self._write(file, book)
            return gone

    def sweep(self) -> int:
        """Delete every tenant's expired checkpoints; how many."""
        count = 0
        for file in self.root.glob(f"*/*/{_FILE}"):
            count += len(self.sweep_model(file.parent.parent.name, file.parent.name))
        return count
