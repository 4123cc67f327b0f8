"""Which adapters exist: their ids, folders and the directory each was found in.

One rule for adapter ids and one folder scan, used by the engine, the config, the server and the
bench, so an id that registers is always an id that can be asked for.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from lora_guard.engine.errors import RequestError, UnknownAdapterError
from lora_guard.engine.lora.checkpoint import CONFIG_FILE

ADAPTER_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
log = logging.getLogger(__name__)


def valid_adapter_id(adapter_id: str) -> bool:
    """Letters, digits, ``_ . -``, at most 128 characters, and not only dots."""
    return bool(ADAPTER_ID.fullmatch(adapter_id)) and set(adapter_id) != {"."}


def scan_adapter_dir(root: Path) -> list[tuple[str, Path]]:
    """(id, folder) for each adapter in ``root``: its subfolders holding an adapter_config.json
    whose name is a valid id and that resolve inside ``root``, sorted by id. Hidden folders (a
    name starting with a dot, as a copy half-written into place) are passed over."""
    found = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not (folder / CONFIG_FILE).is_file():
            continue
        if not valid_adapter_id(folder.name):
            log.warning("adapter folder %r is not a valid adapter id: not served", folder.name)
            continue
        if not folder.resolve().is_relative_to(root.resolve()):
            log.warning(
                "adapter %s links outside %s: not served (name it with --adapter NAME=PATH "
                "to serve it)",
                folder.name,
                root,
            )
            continue
        found.append((folder.name, folder))
    return found


@dataclass(frozen=True, slots=True)
class AdapterEntry:
    """A registered adapter: its folder and, when found by a scan, the directory it must stay in."""

    path: Path
    root: Path | None = None


class AdapterRegistry:
    def __init__(self) -> None:
        self.entries: dict[str, AdapterEntry] = {}

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self.entries

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, adapter_id: str) -> AdapterEntry | None:
        return self.entries.get(adapter_id)

    def require(self, adapter_id: str) -> AdapterEntry:
        """The entry of a request's adapter. Raises :class:`RequestError` for an id no adapter
        can have, :class:`UnknownAdapterError` for one that is not registered."""
        entry = self.entries.get(adapter_id)
        if entry is not None:
            return entry
        if not valid_adapter_id(adapter_id):
            raise RequestError(
                f"invalid adapter id {adapter_id!r}: use letters, digits, '-', '_' and '.'"
            )
        raise UnknownAdapterError(f"adapter {adapter_id!r} is not known")

    def add(self, adapter_id: str, path: Path, root: Path | None = None) -> None:
        if not valid_adapter_id(adapter_id):
            raise ValueError(
                f"adapter id {adapter_id!r} is not valid: use letters, digits, '_', '.' and '-' "
                "(at most 128)"
            )
        self.entries[adapter_id] = AdapterEntry(Path(path), root)

    def add_dir(self, root: Path) -> None:
        for adapter_id, folder in scan_adapter_dir(root):
            self.add(adapter_id, folder, root)

    def remove(self, adapter_id: str) -> None:
        self.entries.pop(adapter_id, None)
