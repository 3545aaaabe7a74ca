"""Disk transport: one directory per version, published atomically.

    root/v00000007/            committed: bucket_00000.safetensors ..., manifest.json, COMMITTED
    root/.tmp-v00000008/       being written (or abandoned by a crash): never read

The sender writes every bucket and the manifest into the temporary directory, writes the
``COMMITTED`` marker, fsyncs and renames; readers only list directories with the marker,
so they never see a partial version. Old versions beyond ``keep_last`` are removed
(never the newest).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from shardforge.weight_sync.buckets import Bucket
from shardforge.weight_sync.manifest import Manifest, checksum_matches
from shardforge.weight_sync.safetensors_io import write_safetensors

__all__ = ["DiskTransport", "DiskWeightSource", "WeightVersionError"]

COMMIT_MARKER = "COMMITTED"
_VERSION_DIR = re.compile(r"^v(\d{8,})$")


class WeightVersionError(RuntimeError):
    """A version is missing, incomplete, corrupt, stale or duplicated."""


def _name(version: int) -> str:
    return f"v{version:08d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_fsync_file = _fsync_dir  # the same O_RDONLY open + fsync works for regular files


def committed_versions(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _VERSION_DIR.match(child.name)
        if match and (child / COMMIT_MARKER).is_file():
            found.append(int(match.group(1)))
    return sorted(found)


class DiskTransport:
    """Sender side: writes versions under ``root`` (used by `WeightPublisher` on one rank)."""

    def __init__(self, root: str | os.PathLike[str], *, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self._tmp: Path | None = None
        self._version: int | None = None
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, version: int) -> None:
        latest = committed_versions(self.root)
        if latest and version <= latest[-1]:
            raise WeightVersionError(
                f"version {version} is not newer than the published version {latest[-1]}; versions must increase"
            )
        self._version = version
        self._tmp = self.root / f".tmp-{_name(version)}"
        if self._tmp.exists():
            shutil.rmtree(self._tmp)
        self._tmp.mkdir()

    def send(self, bucket: Bucket) -> None:
        assert self._tmp is not None, "begin() first"
        path = self._tmp / f"bucket_{bucket.index:05d}.safetensors"
        write_safetensors(path, bucket.names, bucket.tensors)  # fsynced: durable before COMMITTED

    def commit(self, manifest: Manifest) -> None:
        assert self._tmp is not None and self._version == manifest.version, "begin() first"
        (self._tmp / "manifest.json").write_text(manifest.to_json())
        _fsync_file(self._tmp / "manifest.json")
        with (self._tmp / COMMIT_MARKER).open("w") as handle:
            handle.write(str(manifest.version))
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_dir(self._tmp)
        os.replace(self._tmp, self.root / _name(manifest.version))
        _fsync_dir(self.root)
        self._tmp = None
        self._prune()

    def abort(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def _prune(self) -> None:
        versions = committed_versions(self.root)
        for old in versions[: max(len(versions) - self.keep_last, 0)]:
            shutil.rmtree(self.root / _name(old), ignore_errors=True)
        for child in self.root.iterdir():
            if child.name.startswith(".tmp-") and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


class DiskWeightSource:
    """Receiver side: lists committed versions and reads them back, verifying checksums."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def versions(self) -> list[int]:
        return committed_versions(self.root)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def manifest(self, version: int) -> Manifest:
        path = self.root / _name(version)
        if not (path / COMMIT_MARKER).is_file():
            raise WeightVersionError(f"version {version} is not committed under {self.root} (have {self.versions()})")
        return Manifest.from_json((path / "manifest.json").read_text())

    def tensors(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) bucket by bucket, each checked against the manifest."""
        from safetensors.torch import load_file

        path = self.root / _name(manifest.version)
        infos = {t.name: t for t in manifest.tensors}
        for index in range(manifest.num_buckets):
            bucket_file = path / f"bucket_{index:05d}.safetensors"
            try:
                loaded = load_file(str(bucket_file))
            except Exception as exc:  # missing, truncated or garbled file
                raise WeightVersionError(f"version {manifest.version}: cannot read {bucket_file}: {exc}") from exc
            for name, tensor in loaded.items():
                info = infos.get(name)
                if info is None:
                    raise WeightVersionError(f"version {manifest.version}: {name} is not in the manifest")
                if info.checksum and not checksum_matches(tensor, info.checksum):
                    raise WeightVersionError(f"version {manifest.version}: checksum mismatch for {name}")
                yield name, tensor
