"""API keys: who is calling, as which tenant, with which adapters, and whether as an admin.

The key file is TOML, one table per key::

    [keys.acme-app]
    sha256 = "9f86d0..."            # or key = "the key itself"
    tenant = "acme"
    adapters = ["acme-*", "shared-*"]   # glob patterns; leave out for every adapter
    admin = false
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

from lora_guard.server.errors import APIError


class KeyFileError(ValueError):
    """The API-key file cannot be used; the message names the key and the problem."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    sha256: str
    tenant: str
    adapters: tuple[str, ...] | None
    admin: bool

    def may_use(self, adapter_id: str | None) -> bool:
        if adapter_id is None or self.adapters is None:
            return True
        return any(fnmatch.fnmatchcase(adapter_id, pattern) for pattern in self.adapters)


class KeyRing:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    @classmethod
    def from_file(cls, path: Path) -> KeyRing:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise KeyFileError(f"cannot read the API-key file {path}: {exc}") from None
        tables = data.get("keys")
        if not isinstance(tables, dict) or not tables:
            raise KeyFileError(f"{path} has no [keys.NAME] tables")
        return cls([_key(name, table) for name, table in tables.items()])

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key presented as ``Authorization: Bearer KEY``; 401 if there is no valid one."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing API key: send Authorization: Bearer KEY", "unauthorized")
        digest = hashlib.sha256(token.strip().encode()).hexdigest()
        for key in self.keys:
            if hmac.compare_digest(digest, key.sha256):
                return key
        raise APIError(401, "invalid API key", "unauthorized")


def require_admin(keys: KeyRing | None, key: ApiKey | None, what: str) -> None:
    """403 unless there is no key file or the caller's key is an admin key."""
    if keys is not None and (key is None or not key.admin):
        raise APIError(403, f"{what} needs an admin API key", "forbidden")


def _key(name: str, table: Any) -> ApiKey:
    if not isinstance(table, dict):
        raise KeyFileError(f"keys.{name} is not a table")
    unknown = set(table) - {"key", "sha256", "tenant", "adapters", "admin"}
    if unknown:
        raise KeyFileError(f"keys.{name}: unknown field {sorted(unknown)[0]!r}")
    if ("key" in table) == ("sha256" in table):
        raise KeyFileError(f"keys.{name}: give exactly one of key or sha256")
    if "key" in table:
        if not isinstance(table["key"], str) or len(table["key"]) < 8:
            raise KeyFileError(f"keys.{name}: key must be a string of at least 8 characters")
        digest = hashlib.sha256(table["key"].encode()).hexdigest()
    else:
        digest = str(table["sha256"]).lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise KeyFileError(f"keys.{name}: sha256 must be 64 hex digits")
    adapters = table.get("adapters")
    if adapters is not None and (
        not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)
    ):
        raise KeyFileError(f"keys.{name}: adapters must be a list of glob patterns")
    tenant = table.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise KeyFileError(f"keys.{name}: tenant must be a non-empty string")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise KeyFileError(f"keys.{name}: admin must be true or false")
    return ApiKey(name, digest, tenant, tuple(adapters) if adapters is not None else None, admin)
