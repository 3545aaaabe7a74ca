"""API keys and the tenants they name. Every key starts with ``tml-`` (the Tinker SDK refuses others) and
names one tenant; a tenant sees only its own sessions, models, sampler weights, checkpoints and futures."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = ["TenantKeys", "generate_key"]

KEY_PREFIX = "tml-"


def generate_key() -> str:
    """A fresh random API key (``tml-`` + 32 hex characters)."""
    return KEY_PREFIX + secrets.token_hex(16)


class TenantKeys:
    """Maps API keys to tenant names.

    Args:
        keys: API key -> tenant name.
    """

    def __init__(self, keys: Mapping[str, str]) -> None:
        if not keys:
            raise ValueError("no API keys: pass --api-key TENANT=tml-... (or --api-keys FILE) to shardforge serve")
        for key, tenant in keys.items():
            if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
                raise ValueError(
                    f"API key of tenant {tenant!r} must start with {KEY_PREFIX!r} and have at least 8 more characters "
                    '(the tinker SDK refuses other keys); e.g. generate one with `python -c "import secrets; '
                    "print('tml-' + secrets.token_hex(16))\"`"
                )
            if not tenant or not tenant.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"tenant name {tenant!r} must be letters, digits, '-' or '_'")
        self._keys = dict(keys)

    @classmethod
    def parse(cls, specs: Iterable[str] = (), file: str | Path | None = None) -> TenantKeys:
        """From ``TENANT=KEY`` strings and/or a JSON file ``{"TENANT": "KEY", ...}``."""
        keys: dict[str, str] = {}
        if file is not None:
            loaded = json.loads(Path(file).read_text())
            if not isinstance(loaded, dict):
                raise ValueError(f'--api-keys {file}: expected a JSON object {{"tenant": "tml-..."}}')
            keys |= {str(key): str(tenant) for tenant, key in loaded.items()}
        for spec in specs:
            tenant, sep, key = spec.partition("=")
            if not sep:
                raise ValueError(f"--api-key {spec!r}: expected TENANT=tml-...")
            keys[key] = tenant
        return cls(keys)

    def tenant(self, key: str | None) -> str | None:
        """The tenant of ``key``; None for a missing or unknown key."""
        if key is None:
            return None
        for known, tenant in self._keys.items():
            if secrets.compare_digest(known, key):
                return tenant
        return None

    @property
    def tenants(self) -> list[str]:
        return sorted(set(self._keys.values()))
