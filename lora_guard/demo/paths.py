"""Where lora-guard keeps what it prepares: the demo model, its adapters."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def lora_guard_home() -> Path:
    """``$LORA_GUARD_HOME``, else ``$XDG_CACHE_HOME/lora-guard``, else ``~/.cache/lora-guard``."""
    explicit = os.environ.get("LORA_GUARD_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "lora-guard"


@dataclass(frozen=True)
class DemoPaths:
    home: Path
    model_dir: Path
    adapter_dir: Path

    @classmethod
    def under(cls, home: Path | None = None) -> DemoPaths:
        root = home if home is not None else lora_guard_home()
        return cls(
            home=root, model_dir=root / "demo" / "model", adapter_dir=root / "demo" / "adapters"
        )
