from __future__ import annotations

from pathlib import Path

from lora_guard.manifest import manifest_problems, write_manifest


def test_manifest_notices_missing_resized_and_changed_files(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"abcd")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("hello")
    write_manifest(tmp_path)
    assert manifest_problems(tmp_path, deep=True) == []

    (tmp_path / "a.bin").write_bytes(b"abce")  # same size, other content
    assert manifest_problems(tmp_path) == []
    assert any("content changed" in p for p in manifest_problems(tmp_path, deep=True))

    (tmp_path / "sub" / "b.txt").write_text("hello!")
    assert any("size" in p for p in manifest_problems(tmp_path))

    (tmp_path / "sub" / "b.txt").unlink()
    assert any("missing" in p for p in manifest_problems(tmp_path))


def test_folder_without_manifest_is_not_trusted(tmp_path: Path) -> None:
    assert manifest_problems(tmp_path)
