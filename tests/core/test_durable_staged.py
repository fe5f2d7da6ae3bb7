"""durable.StagedDirectory: a directory published whole, or not at all."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from rollcage import durable
from rollcage.durable import StagedDirectory, is_temp_artifact
from rollcage.errors import DurableWriteError


def _tree(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_a_new_directory_appears_whole(tmp_path: Path) -> None:
    target = tmp_path / "out"
    with StagedDirectory(target) as staged:
        staged.add("a.json", b"1")
        staged.add("b.json", b"2")
        assert not target.exists()  # nothing is visible before the end
    assert _tree(target) == {"a.json": b"1", "b.json": b"2"}
    assert oct(os.stat(target / "a.json").st_mode & 0o777) == oct(0o644)
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("exchange", ["renameat2", "two renames"])
def test_an_existing_directory_is_replaced_whole_with_no_stale_file(
    tmp_path: Path, exchange: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if exchange == "two renames":
        monkeypatch.setattr(ctypes, "CDLL", lambda *args, **kwargs: object())  # no renameat2 to be found
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.json").write_bytes(b"old")
    (target / "a.json").write_bytes(b"old")
    with StagedDirectory(target) as staged:
        staged.add("a.json", b"new")
    assert _tree(target) == {"a.json": b"new"}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_exception_in_the_block_leaves_the_target_and_nothing_else(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.json").write_bytes(b"old")
    with pytest.raises(RuntimeError), StagedDirectory(target) as staged:
        staged.add("a.json", b"new")
        raise RuntimeError("converting the next document failed")
    assert _tree(target) == {"a.json": b"old"}
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_file_at_the_target_is_refused_untouched(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.write_bytes(b"a file")
    with pytest.raises(DurableWriteError, match="not a directory"), StagedDirectory(target) as staged:
        staged.add("a.json", b"new")
    assert target.read_bytes() == b"a file"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_killed_publishers_leftover_is_swept_and_others_are_not(tmp_path: Path) -> None:
    leftover = tmp_path / ".out.0123456789abcdef.tmp"
    leftover.mkdir()
    (leftover / "a.json").write_bytes(b"half")
    other = tmp_path / ".other.0123456789abcdef.tmp"
    other.mkdir()
    assert is_temp_artifact(leftover.name)
    with StagedDirectory(tmp_path / "out") as staged:
        staged.add("a.json", b"1")
    assert sorted(os.listdir(tmp_path)) == [".other.0123456789abcdef.tmp", "out"]


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\0b"])
def test_a_name_that_is_not_one_file_name_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError), StagedDirectory(tmp_path / "out") as staged:
        staged.add(name, b"x")
    assert os.listdir(tmp_path) == []


def test_a_write_failure_names_the_file_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(durable, "_write_all", full)
    with (
        pytest.raises(DurableWriteError, match=r"writing a\.json failed"),
        StagedDirectory(tmp_path / "out") as s,
    ):
        s.add("a.json", b"x")
    assert os.listdir(tmp_path) == []
