"""The file editor tool: its commands and the texts models trained on Anthropic's and OpenHands' editors know.

Run beside the test and in a real nested bubblewrap cage (where it must see what the cage sees).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from rollcage.cage import NestedCage
from rollcage.tools import FileEditor
from tests.helpers.supervisor_env import requires_bwrap

TIMEOUT_S = 60.0


@pytest.fixture(params=["beside", pytest.param("caged", marks=[pytest.mark.bwrap, requires_bwrap()])])
def where(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    return workspace


@pytest.fixture
def make(where: str, ws: Path, tmp_path: Path) -> Callable[..., FileEditor]:
    def factory(**options: object) -> FileEditor:
        prefix: list[str] = []
        if where == "caged":
            bwrap = shutil.which("bwrap")
            assert bwrap is not None
            private = tmp_path / "private"
            private.mkdir(exist_ok=True)
            prefix = NestedCage(bwrap=bwrap, workspace=str(ws), hide=(str(private),)).prefix()
        return FileEditor(cwd=ws, prefix=prefix, **options)  # type: ignore[arg-type]

    return factory


async def test_create_view_and_view_range(make: Callable[..., FileEditor], ws: Path) -> None:
    editor = make()
    path = f"{ws}/pkg/mod.py"
    ok, text = await editor.call(
        {"command": "create", "path": path, "file_text": "a = 1\nb = 2\nc = 3\n"}, TIMEOUT_S
    )
    assert (ok, text) == (True, f"File created successfully at: {path}")
    assert (ws / "pkg" / "mod.py").read_text() == "a = 1\nb = 2\nc = 3\n"
    ok, text = await editor.call({"command": "view", "path": path}, TIMEOUT_S)
    assert ok
    assert text == (
        f"Here's the result of running `cat -n` on {path}:\n"
        "     1\ta = 1\n     2\tb = 2\n     3\tc = 3\n     4\t\n"
    )
    ok, text = await editor.call({"command": "view", "path": path, "view_range": [2, -1]}, TIMEOUT_S)
    assert (
        text == f"Here's the result of running `cat -n` on {path}:\n     2\tb = 2\n     3\tc = 3\n     4\t\n"
    )
    ok, text = await editor.call({"command": "view", "path": path, "view_range": [0, 2]}, TIMEOUT_S)
    assert not ok
    assert text == (
        "Invalid `view_range`: [0, 2]. Its first element `0` should be within the range of lines of the "
        "file: [1, 4]"
    )


async def test_a_directory_is_listed_two_levels_deep_without_hidden_items(
    make: Callable[..., FileEditor], ws: Path
) -> None:
    (ws / "a" / "b" / "c").mkdir(parents=True)
    (ws / "a" / "b" / "c" / "deep.txt").write_text("x")
    (ws / ".git").mkdir()
    (ws / "top.txt").write_text("x")
    ok, text = await make().call({"command": "view", "path": str(ws)}, TIMEOUT_S)
    assert ok
    assert text == (
        f"Here's the files and directories up to 2 levels deep in {ws}, excluding hidden items:\n"
        f"{ws}\n{ws}/a\n{ws}/a/b\n{ws}/top.txt\n"
    )


async def test_str_replace_and_its_refusals(make: Callable[..., FileEditor], ws: Path) -> None:
    editor = make()
    path = f"{ws}/f.py"
    (ws / "f.py").write_text("x = 1\ny = 2\nx = 1\n")
    ok, text = await editor.call(
        {"command": "str_replace", "path": path, "old_str": "nope", "new_str": "z"}, TIMEOUT_S
    )
    assert (ok, text) == (
        False,
        f"No replacement was performed, old_str `nope` did not appear verbatim in {path}.",
    )
    ok, text = await editor.call(
        {"command": "str_replace", "path": path, "old_str": "x = 1", "new_str": "z"}, TIMEOUT_S
    )
    assert (ok, text) == (
        False,
        "No replacement was performed. Multiple occurrences of old_str `x = 1` in lines [1, 3]. "
        "Please ensure it is unique",
    )
    assert (ws / "f.py").read_text() == "x = 1\ny = 2\nx = 1\n"
    ok, text = await editor.call(
        {"command": "str_replace", "path": path, "old_str": "y = 2", "new_str": "y = 3"}, TIMEOUT_S
    )
    assert ok and (ws / "f.py").read_text() == "x = 1\ny = 3\nx = 1\n"
    assert text.startswith(
        f"The file {path} has been edited. Here's the result of running `cat -n` on a snippet"
    )
    assert "     2\ty = 3\n" in text
    assert text.endswith(
        "Review the changes and make sure they are as expected. Edit the file again if necessary."
    )


async def test_insert_and_undo_restore_each_earlier_state(make: Callable[..., FileEditor], ws: Path) -> None:
    editor = make()
    path = f"{ws}/g.txt"
    await editor.call({"command": "create", "path": path, "file_text": "one\ntwo"}, TIMEOUT_S)
    ok, text = await editor.call(
        {"command": "insert", "path": path, "insert_line": 1, "new_str": "1.5"}, TIMEOUT_S
    )
    assert ok and (ws / "g.txt").read_text() == "one\n1.5\ntwo"
    assert "a snippet of the edited file" in text
    ok, text = await editor.call(
        {"command": "insert", "path": path, "insert_line": 9, "new_str": "x"}, TIMEOUT_S
    )
    assert (ok, text) == (
        False,
        "Invalid `insert_line` parameter: 9. It should be within the range of lines of the file: [0, 3]",
    )
    await editor.call({"command": "str_replace", "path": path, "old_str": "two", "new_str": "2"}, TIMEOUT_S)
    assert (ws / "g.txt").read_text() == "one\n1.5\n2"
    ok, text = await editor.call({"command": "undo_edit", "path": path}, TIMEOUT_S)
    assert ok and text.startswith(f"Last edit to {path} undone successfully. ")
    assert (ws / "g.txt").read_text() == "one\n1.5\ntwo"
    await editor.call({"command": "undo_edit", "path": path}, TIMEOUT_S)
    assert (ws / "g.txt").read_text() == "one\ntwo"
    ok, text = await editor.call({"command": "undo_edit", "path": path}, TIMEOUT_S)
    assert ok and not (ws / "g.txt").exists()  # undoing the create removes the file
    ok, text = await editor.call({"command": "undo_edit", "path": path}, TIMEOUT_S)
    assert (ok, text) == (False, f"No edit history found for {path}.")


async def test_path_and_command_refusals(make: Callable[..., FileEditor], ws: Path) -> None:
    editor = make(name="str_replace_editor")
    (ws / "exists.txt").write_text("x")
    cases = [
        (
            {"command": "view", "path": "rel.txt"},
            "The path rel.txt is not an absolute path, it should start with `/`. "
            f"Maybe you meant {ws}/rel.txt?",
        ),
        (
            {"command": "view", "path": f"{ws}/missing"},
            f"The path {ws}/missing does not exist. Please provide a valid path.",
        ),
        (
            {"command": "create", "path": f"{ws}/exists.txt", "file_text": "y"},
            f"File already exists at: {ws}/exists.txt. Cannot overwrite files using command `create`.",
        ),
        (
            {"command": "str_replace", "path": str(ws), "old_str": "a", "new_str": "b"},
            f"The path {ws} is a directory and only the `view` command can be used on directories",
        ),
        (
            {"command": "create", "path": f"{ws}/new.txt"},
            "Parameter `file_text` is required for command: create",
        ),
        (
            {"command": "delete", "path": f"{ws}/exists.txt"},
            "Unrecognized command delete. The allowed commands for the str_replace_editor tool are: "
            "view, create, str_replace, insert, undo_edit",
        ),
    ]
    for arguments, expected in cases:
        assert await editor.call(arguments, TIMEOUT_S) == (False, expected), arguments
    assert (ws / "exists.txt").read_text() == "x"


async def test_answers_are_bounded(make: Callable[..., FileEditor], ws: Path) -> None:
    (ws / "big.txt").write_text("line\n" * 20_000)
    ok, text = await make(output_limit=2000).call({"command": "view", "path": f"{ws}/big.txt"}, TIMEOUT_S)
    assert ok and len(text) <= 2000 and "truncated" in text


async def test_a_caged_editor_sees_the_cage_not_the_worker(
    make: Callable[..., FileEditor], where: str
) -> None:
    editor = make()
    ok, text = await editor.call({"command": "view", "path": f"/proc/{os.getpid()}/environ"}, TIMEOUT_S)
    if where == "caged":
        # Its own PID namespace: the worker's process is not there to read.
        assert (ok, text) == (
            False,
            f"The path /proc/{os.getpid()}/environ does not exist. Please provide a valid path.",
        )
    else:
        assert "does not exist" not in text
