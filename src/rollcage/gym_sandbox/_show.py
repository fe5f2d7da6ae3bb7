"""``rollcage show`` for a NeMo Gym sandbox's directory: what it was made from and every command it ran.

A sandbox's directory (under the provider's ``state_dir``) holds ``sandbox.json`` and ``execs.jsonl``
(:mod:`rollcage.gym_sandbox._cage`). ``rollcage show DIR`` (or either file) prints the record and one
row per command: when it started, how long it ran, how it ended, what it printed (bytes and SHA-256
prefix) and the command itself. A last line cut short by a crash mid-write is reported, not fatal.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from rollcage.durable import read_bounded
from rollcage.errors import ViewerError

__all__ = ["RECORD_KIND", "render_sandbox", "sandbox_directory"]

RECORD_KIND = "rollcage-gym-sandbox"
_RECORD = "sandbox.json"
_JOURNAL = "execs.jsonl"
_LIMIT = 64 << 20
_COMMAND_CHARS = 100


def _record(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(read_bounded(path, limit=1 << 20))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) and value.get("kind") == RECORD_KIND else None


def sandbox_directory(path: Path) -> Path | None:
    """The sandbox directory ``path`` names (the directory, its record or its journal), else ``None``."""
    directory = path if path.is_dir() else path.parent
    if path.is_file() and path.name not in (_RECORD, _JOURNAL):
        return None
    return directory if (directory / _RECORD).is_file() and _record(directory / _RECORD) else None


def _when(seconds: object) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def render_sandbox(directory: Path) -> RenderableType:
    """The sandbox's record and its commands, for the terminal.

    Raises:
        ViewerError: ``sandbox.json`` is not a sandbox's record, or a journal line other than the last
            is not JSON (the journal was changed after it was written).
    """
    record = _record(directory / _RECORD)
    if record is None:
        raise ViewerError(f"{directory / _RECORD}: not a rollcage NeMo Gym sandbox record")
    image = record.get("image") or {}
    head = Text()
    head.append(f"sandbox {record.get('sandbox_id')}", style="bold")
    head.append(f"  image {image.get('ref')} ({image.get('digest')})\n")
    head.append(
        f"workdir {record.get('workdir')}  network {record.get('network')}  budgets {record.get('budgets')}\n"
    )
    head.append(f"created {_when(record.get('created_at'))}  closed {_when(record.get('closed_at'))}")
    journal = directory / _JOURNAL
    lines = read_bounded(journal, limit=_LIMIT).splitlines() if journal.exists() else []
    table = Table("#", "started", "ms", "exit", "flags", "stdout", "stderr", "command")
    torn = ""
    for index, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except ValueError as exc:
            if index == len(lines) - 1:
                torn = f"the last line ({len(line)} bytes) was cut short: the process died writing it"
                break
            raise ViewerError(f"{journal}: line {index + 1} is not JSON ({exc})") from exc
        flags = [name for name in ("timed_out", "cage_failed", "truncated") if entry.get(name)]
        if entry.get("session"):  # a PTY or pipe session (create_pty), journaled when it closed
            flags.insert(0, f"{entry.get('mode')}-session")
            if entry.get("ended_by_close"):
                flags.append("ended_by_close")
        command = str(entry.get("command", ""))
        if entry.get("args"):
            command += " -- " + " ".join(str(a) for a in entry["args"])
        table.add_row(
            str(entry.get("seq")),
            _when(entry.get("started_at")),
            f"{float(entry.get('duration_s', 0)) * 1000:.1f}",
            str(entry.get("exit_code")),
            ",".join(flags),
            f"{entry.get('stdout_bytes')} B {str(entry.get('stdout_sha256', ''))[:12]}",
            f"{entry.get('stderr_bytes')} B {str(entry.get('stderr_sha256', ''))[:12]}",
            command if len(command) <= _COMMAND_CHARS else command[: _COMMAND_CHARS - 1] + "…",
        )
    parts: list[RenderableType] = [head, table]
    if torn:
        parts.append(Text(torn, style="yellow"))
    return Group(*parts)
