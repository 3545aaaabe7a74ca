"""``save_weights_external`` and the signed download URLs of its files (the SDK's
``TrainingClient.save_weights_external`` + ``RestClient.get_external_weights_urls``).

A LoRA model is exported as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``, written by
`shardforge.lora.save_peft_adapter`: ``peft.PeftModel.from_pretrained(base, dir)`` loads it); a full fine-tuning
model as an HF model directory (``save_pretrained``, with the tokenizer). Files go under
``<output_dir>/<tenant>/<model_id>/external_weights/<name>/`` (``tinker://<model_id>/external_weights/<name>``),
written into a temporary folder and renamed into place.

Downloads, as with the hosted service, are plain GETs of signed URLs (no API key: ``urllib.request.urlretrieve``
works): only the owning tenant's key gets the URLs, and each URL carries an HMAC over the tenant, model, export,
file and expiry, made with a secret the service draws at start (URLs die with the service; the files do not).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
import shutil
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import quote

import torch

from shardforge.algorithms.serve.checkpoints import check_name
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.models import TrainingModel
from shardforge.checkpoint_dcp.replace import replace_folder

__all__ = ["DownloadSigner", "delete_export", "export_dir", "list_exports", "save_external"]

URL_TTL_S = 3600
"""How long a download URL is valid."""


def export_dir(root: Path, tenant: str, model_id: str, name: str) -> Path:
    return root / tenant / check_name(model_id, "model id") / "external_weights" / check_name(name, "name")


def save_external(
    root: Path,
    model: TrainingModel,
    name: str,
    *,
    tokenizer: Any,
    base_model: str,
    full_weights: tuple[Any, dict[str, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Export ``model`` as ``name`` (PEFT adapter or HF model, see the module doc); the SDK's response JSON.
    ``full_weights``: a full fine-tuning model's (HF model of the same architecture, its whole weights by name),
    written in place of ``model.module``'s own (which may be FSDP shards)."""
    from shardforge.lora import save_peft_adapter

    target = export_dir(root, model.owner, model.model_id, name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        if model.lora is not None:
            save_peft_adapter(model.module, staging, model.lora, base_model_name_or_path=base_model)
        else:
            template, weights = full_weights if full_weights is not None else (model.module, None)
            template.save_pretrained(staging, state_dict=weights)  # type: ignore[operator]
            tokenizer.save_pretrained(staging)
        replace_folder(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    size = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    path = f"tinker://{model.model_id}/external_weights/{name}"
    return {"type": "save_weights_external", "path": path, "size_bytes": size}


def delete_export(root: Path, tenant: str, model_id: str, name: str) -> None:
    """Remove the export ``tinker://<model_id>/external_weights/<name>`` of ``tenant`` (KeyError when it has none
    such); renamed out of place first, so a download in progress never reads a half-deleted folder's file list."""
    target = export_dir(root, tenant, model_id, name)
    if not target.is_dir():
        raise KeyError(f"tinker://{model_id}/external_weights/{name} is not an export of this API key")
    trash = target.parent / f".tmp-deleted-{target.name}-{uuid.uuid4().hex[:8]}"
    os.replace(target, trash)
    shutil.rmtree(trash)


def list_exports(root: Path, tenant: str, model_id: str) -> list[dict[str, Any]]:
    """``save_weights_external`` exports of ``model_id`` on disk, as the SDK's ``Checkpoint`` JSON, oldest first."""
    folder = root / tenant / check_name(model_id, "model id") / "external_weights"
    out = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.name.startswith(".") or not path.is_dir():  # a staging folder of an export being written
            continue
        files = [f for f in path.rglob("*") if f.is_file()]
        out.append({
            "checkpoint_id": f"external_weights/{path.name}", "checkpoint_type": "external",
            "time": datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC).isoformat(),
            "tinker_path": f"tinker://{model_id}/external_weights/{path.name}",
            "size_bytes": sum(f.stat().st_size for f in files),
        })  # fmt: skip
    return sorted(out, key=lambda c: c["time"])


class DownloadSigner:
    """Signs and checks the download URLs of exported files (see the module doc)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._secret = secrets.token_bytes(32)

    def _signature(self, tenant: str, model_id: str, name: str, file: str, expires: int) -> str:
        message = "\n".join((tenant, model_id, name, file, str(expires))).encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def urls(self, tenant: str, model_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        """``ExternalWeightsUrlsResponse`` JSON: a signed URL per file of the export; KeyError unless ``tenant``
        owns it (another tenant's export reads as missing)."""
        kind, _, name = checkpoint_id.partition("/")
        if kind != "external_weights" or not name:
            raise UserError(f"checkpoint_id {checkpoint_id!r} must be external_weights/<name> (save_weights_external)")
        folder = export_dir(self.root, tenant, model_id, name)
        if not folder.is_dir():
            raise KeyError(f"tinker://{model_id}/{checkpoint_id} is not an export of this API key")
        expires = int(time.time()) + URL_TTL_S
        urls = {}
        for file in sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()):
            signature = self._signature(tenant, model_id, name, file, expires)
            route = "/".join(quote(part, safe="") for part in (tenant, model_id, name, *file.split("/")))
            urls[file] = (
                f"{base_url.rstrip('/')}/api/v1/external_weights_files/{route}?expires={expires}&sig={signature}"
            )
        when = datetime.datetime.fromtimestamp(expires, datetime.UTC).isoformat()
        return {"urls": urls, "expires": when}

    def file(self, tenant: str, model_id: str, name: str, file: str, expires: int, signature: str) -> Path:
        """The exported file a signed URL names; PermissionError for a bad or expired signature."""
        expected = self._signature(tenant, model_id, name, file, expires)
        if not hmac.compare_digest(expected, signature) or expires < time.time():
            raise PermissionError("the download URL is invalid or expired; ask get_external_weights_urls again")
        folder = export_dir(self.root, tenant, model_id, name).resolve()
        path = (folder / file).resolve()
        if not path.is_relative_to(folder) or not path.is_file():
            raise KeyError(f"{file!r} is not a file of this export")
        return path
