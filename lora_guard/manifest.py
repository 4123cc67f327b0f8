"""A small JSON manifest of the files in a prepared folder (a model, adapters), so a second run can
trust it quickly; the engine reads the model name a prepared checkpoint records in it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MANIFEST_NAME = "lora-guard-manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record size and sha256 of every file under ``folder`` (the manifest itself excluded)."""
    files = describe_files(folder, folder.rglob("*"))
    manifest = {"version": 1, "info": info or {}, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def describe_files(folder: Path, paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size, sha256) of the files among ``paths``, by path under ``folder``."""
    return {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(paths)
        if p.is_file() and p.name != MANIFEST_NAME
    }


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def manifest_problems(folder: Path, *, deep: bool = False) -> list[str]:
    """What differs between ``folder`` and its manifest; empty when it matches.

    The quick check compares sizes; ``deep`` also re-hashes every file.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return [f"{folder}: no valid {MANIFEST_NAME}"]
    problems = []
    for name, meta in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.stat().st_size != meta.get("size"):
            problems.append(f"{path}: size {path.stat().st_size}, expected {meta.get('size')}")
        elif deep and sha256_file(path) != meta.get("sha256"):
            problems.append(f"{path}: content changed since it was written")
    return problems
