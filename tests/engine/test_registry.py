"""The adapter folder scan: which subfolders of an adapter directory are served, under which id."""

from __future__ import annotations

from pathlib import Path

from lora_guard.engine.lora.registry import scan_adapter_dir, valid_adapter_id


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_the_scan_serves_valid_ids_inside_the_directory_and_nothing_else(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    _adapter(root / "b-01")
    _adapter(root / "a-00")
    _adapter(root / ".a-02-half-copied")  # a copy being written into place
    _adapter(root / "my adapter")  # a space: no request could name it
    (root / "notes").mkdir()  # no adapter_config.json
    (root / "elsewhere").symlink_to(_adapter(tmp_path / "outside"))
    assert [adapter_id for adapter_id, _ in scan_adapter_dir(root)] == ["a-00", "b-01"]


def test_adapter_ids_are_plain_names() -> None:
    assert all(valid_adapter_id(i) for i in ("a-00", "Tenant_A.v2", "x" * 128))
    assert not any(valid_adapter_id(i) for i in ("", ".", "..", "a/b", "my adapter", "x" * 129))
