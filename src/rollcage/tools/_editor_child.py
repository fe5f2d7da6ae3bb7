"""The file editor's one operation, run inside the executor's cage (see :mod:`rollcage.tools._editor`).

Run as ``python -I -c SOURCE``: a JSON request on stdin, a JSON reply on stdout,
``{"ok": bool, "text": str, "previous": str | null, "existed": bool}``
(``previous``: the file's content before a change, for undo). It imports only
the standard library and nothing of rollcage: it runs where agent code runs, on
the agent's file system, as an agent-authored action would.

The texts match those of the editors models are trained on (Anthropic's
``str_replace_based_edit_tool``/``str_replace_editor``, OpenHands' and
SWE-agent's ``str_replace_editor``).
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["main"]

SNIPPET_LINES = 4
MAX_FILE_BYTES = 16 << 20


class ToolError(Exception):
    """An answer for the model: the operation was refused or failed."""


def cat_n(content: str, descriptor: str, init_line: int = 1) -> str:
    """``content`` numbered as ``cat -n`` numbers it, with the editors' heading."""
    numbered = "\n".join(
        f"{i + init_line:6}\t{line}" for i, line in enumerate(content.expandtabs().split("\n"))
    )
    return f"Here's the result of running `cat -n` on {descriptor}:\n{numbered}\n"


def read_text(path: str) -> str:
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            raise ToolError(
                f"The file {path} is larger than {MAX_FILE_BYTES} bytes; view it with bash instead."
            )
        with open(path, encoding="utf-8") as file:
            return file.read()
    except ToolError:
        raise
    except UnicodeDecodeError:
        raise ToolError(f"The file {path} is not UTF-8 text; the editor cannot show or edit it.") from None
    except OSError as exc:
        raise ToolError(f"Ran into {exc} while trying to read {path}") from None


def write_text(path: str, content: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write(content)
    except OSError as exc:
        raise ToolError(f"Ran into {exc} while trying to write to {path}") from None


def validate(command: str, path: str) -> None:
    if not path.startswith("/"):
        raise ToolError(
            f"The path {path} is not an absolute path, it should start with `/`. "
            f"Maybe you meant {os.path.join(os.getcwd(), path)}?"
        )
    exists = os.path.lexists(path)
    if not exists and command != "create":
        raise ToolError(f"The path {path} does not exist. Please provide a valid path.")
    if exists and command == "create":
        raise ToolError(f"File already exists at: {path}. Cannot overwrite files using command `create`.")
    if os.path.isdir(path) and command != "view":
        raise ToolError(
            f"The path {path} is a directory and only the `view` command can be used on directories"
        )


def listing(root: str) -> str:
    """What ``find ROOT -maxdepth 2 -not -path '*/.*'`` prints, sorted (the same on every file system)."""
    found = [root]
    root = root.rstrip("/") or "/"

    def visible(names: list[str]) -> list[str]:
        return sorted(n for n in names if not n.startswith("."))

    try:
        first = visible(os.listdir(root))
    except OSError as exc:
        raise ToolError(f"Ran into {exc} while trying to list {root}") from None
    for name in first:
        child = os.path.join(root, name)
        found.append(child)
        if os.path.isdir(child) and not os.path.islink(child):
            try:
                found += [os.path.join(child, n) for n in visible(os.listdir(child))]
            except OSError:
                continue
    return "\n".join(found)


def view(path: str, view_range: object) -> str:
    if os.path.isdir(path):
        if view_range:
            raise ToolError("The `view_range` parameter is not allowed when `path` points to a directory.")
        return (
            f"Here's the files and directories up to 2 levels deep in {path}, excluding hidden items:\n"
            f"{listing(path)}\n"
        )
    content = read_text(path)
    init_line = 1
    if view_range:
        if (
            not isinstance(view_range, list)
            or len(view_range) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in view_range)
        ):
            raise ToolError("Invalid `view_range`. It should be a list of two integers.")
        lines = content.split("\n")
        count = len(lines)
        init_line, final_line = view_range
        if init_line < 1 or init_line > count:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its first element `{init_line}` should be within the "
                f"range of lines of the file: {[1, count]}"
            )
        if final_line > count:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its second element `{final_line}` should be smaller "
                f"than the number of lines in the file: `{count}`"
            )
        if final_line != -1 and final_line < init_line:
            raise ToolError(
                f"Invalid `view_range`: {view_range}. Its second element `{final_line}` should be larger or "
                f"equal than its first `{init_line}`"
            )
        content = "\n".join(lines[init_line - 1 :] if final_line == -1 else lines[init_line - 1 : final_line])
    return cat_n(content, path, init_line)


def str_replace(path: str, old_str: str, new_str: str) -> tuple[str, str]:
    previous = read_text(path)
    content = previous.expandtabs()
    old_str = old_str.expandtabs()
    new_str = new_str.expandtabs()
    occurrences = content.count(old_str) if old_str else 0
    if occurrences == 0:
        raise ToolError(
            f"No replacement was performed, old_str `{old_str}` did not appear verbatim in {path}."
        )
    if occurrences > 1:
        lines = [i + 1 for i, line in enumerate(content.split("\n")) if old_str in line]
        raise ToolError(
            f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in lines {lines}. "
            "Please ensure it is unique"
        )
    updated = content.replace(old_str, new_str)
    write_text(path, updated)
    at = content.split(old_str)[0].count("\n")
    start = max(0, at - SNIPPET_LINES)
    end = at + SNIPPET_LINES + new_str.count("\n")
    snippet = "\n".join(updated.split("\n")[start : end + 1])
    text = (
        f"The file {path} has been edited. "
        + cat_n(snippet, f"a snippet of {path}", start + 1)
        + "Review the changes and make sure they are as expected. Edit the file again if necessary."
    )
    return text, previous


def insert(path: str, insert_line: int, new_str: str) -> tuple[str, str]:
    previous = read_text(path)
    lines = previous.expandtabs().split("\n")
    count = len(lines)
    if insert_line < 0 or insert_line > count:
        raise ToolError(
            f"Invalid `insert_line` parameter: {insert_line}. It should be within the range of lines of the "
            f"file: {[0, count]}"
        )
    new_lines = new_str.expandtabs().split("\n")
    updated = lines[:insert_line] + new_lines + lines[insert_line:]
    snippet = (
        lines[max(0, insert_line - SNIPPET_LINES) : insert_line]
        + new_lines
        + lines[insert_line : insert_line + SNIPPET_LINES]
    )
    write_text(path, "\n".join(updated))
    text = (
        f"The file {path} has been edited. "
        + cat_n("\n".join(snippet), "a snippet of the edited file", max(1, insert_line - SNIPPET_LINES + 1))
        + "Review the changes and make sure they are as expected (correct indentation, no duplicate lines, "
        "etc). Edit the file again if necessary."
    )
    return text, previous


def required(request: dict[str, object], name: str, command: str, kind: type) -> object:
    value = request.get(name)
    if value is None:
        raise ToolError(f"Parameter `{name}` is required for command: {command}")
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ToolError(f"Parameter `{name}` of command {command} must be of type {kind.__name__}")
    return value


def handle(request: dict[str, object]) -> dict[str, object]:
    command = request.get("command")
    path = request.get("path")
    if not isinstance(path, str) or not path:
        raise ToolError(f"Parameter `path` is required for command: {command}")
    if command == "restore":
        # An undo: the worker holds the history and sends back what the file held (None: absent).
        content = request.get("content")
        if content is None:
            try:
                os.unlink(path)
            except OSError as exc:
                raise ToolError(f"Ran into {exc} while trying to undo the creation of {path}") from None
            return {
                "ok": True,
                "text": f"Last edit to {path} undone successfully: the file it created was removed.",
            }
        write_text(path, str(content))
        return {"ok": True, "text": f"Last edit to {path} undone successfully. {cat_n(str(content), path)}"}
    validate(str(command), path)
    if command == "view":
        return {"ok": True, "text": view(path, request.get("view_range"))}
    if command == "create":
        file_text = required(request, "file_text", "create", str)
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise ToolError(f"Ran into {exc} while trying to write to {path}") from None
        write_text(path, str(file_text))
        return {"ok": True, "text": f"File created successfully at: {path}", "existed": False}
    if command == "str_replace":
        old_str = required(request, "old_str", "str_replace", str)
        new_str = request.get("new_str") or ""
        if not isinstance(new_str, str):
            raise ToolError("Parameter `new_str` of command str_replace must be of type str")
        text, previous = str_replace(path, str(old_str), new_str)
        return {"ok": True, "text": text, "previous": previous, "existed": True}
    if command == "insert":
        line = required(request, "insert_line", "insert", int)
        new_str = required(request, "new_str", "insert", str)
        text, previous = insert(path, int(str(line)), str(new_str))
        return {"ok": True, "text": text, "previous": previous, "existed": True}
    raise ToolError(
        f"Unrecognized command {command}. The allowed commands for the {request.get('tool')} tool are: "
        "view, create, str_replace, insert, undo_edit"
    )


def main() -> int:
    try:
        request = json.loads(sys.stdin.buffer.read())
        if not isinstance(request, dict):
            raise ToolError("the editor's request is not a JSON object")
        reply = handle(request)
    except ToolError as exc:
        reply = {"ok": False, "text": str(exc)}
    except OSError as exc:
        reply = {"ok": False, "text": f"Ran into {exc}"}
    sys.stdout.write(json.dumps(reply))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
