"""Settings that plugins declare for themselves."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    type: Callable[[str], Any]
    default: Any
    help: str


class OptionRegistry:
    """Collects options from ``lora_guard_add_options``; the CLI turns them into flags."""

    def __init__(self) -> None:
        self.options: dict[str, Option] = {}

    def add(self, name: str, type: Callable[[str], Any], default: Any, help: str) -> None:
        """Declare ``name`` (underscored, e.g. ``tenant_quota``; the flag is ``--tenant-quota``)."""
        key = name.replace("-", "_")
        if key in self.options:
            raise ValueError(f"option {key!r} is declared twice")
        self.options[key] = Option(key, type, default, help)

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options.values()}


def id_list(value: Any) -> tuple[str, ...]:
    """Adapter ids from a setting: a list, or a comma-separated string."""
    if not value:
        return ()
    items: Iterable[Any] = value.split(",") if isinstance(value, str) else value
    return tuple(s for s in (str(v).strip() for v in items) if s)
