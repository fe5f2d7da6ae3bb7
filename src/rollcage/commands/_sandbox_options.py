"""The sandbox's budget and containment flags, shared by ``rollcage run`` and ``rollcage supervise``.

Each flag is one field of :class:`rollcage.supervisor.BwrapSandbox` (the config
key has the same name with underscores); sizes take a unit (``512M``, ``4G``).
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any

import typer

__all__ = [
    "CgroupsChoice",
    "DiskChoice",
    "ExecutorCageChoice",
    "bwrap_fields",
    "parse_size",
]

_PANEL = "Sandbox budgets"


class CgroupsChoice(enum.StrEnum):
    """How memory and process budgets are enforced."""

    auto = "auto"
    off = "off"


class DiskChoice(enum.StrEnum):
    """How disk budgets are enforced."""

    auto = "auto"
    poll = "poll"


class ExecutorCageChoice(enum.StrEnum):
    """Where the agent's code runs inside the sandbox."""

    bwrap = "bwrap"
    shared = "shared"


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``'512M'`` -> bytes (K, M, G, T are powers of 1024; an optional ``iB``/``B`` is accepted).

    Raises:
        typer.BadParameter: Not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 512M, 4G, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


MemoryBudget = Annotated[
    str | None,
    typer.Option(
        "--memory-budget",
        help="Total memory of one rollout's sandbox (default 4G); a cgroup where the machine allows one.",
        rich_help_panel=_PANEL,
    ),
]
MaxProcesses = Annotated[
    int | None,
    typer.Option(
        "--max-processes",
        min=8,
        help="Processes and threads in one sandbox (default 256).",
        rich_help_panel=_PANEL,
    ),
]
WorkspaceBudget = Annotated[
    str | None,
    typer.Option("--workspace-budget", help="Bytes in the workspace (default 1G).", rich_help_panel=_PANEL),
]
WorkspaceInodes = Annotated[
    int | None,
    typer.Option(
        "--workspace-inodes",
        min=64,
        help="Files and directories in the workspace (default 65536).",
        rich_help_panel=_PANEL,
    ),
]
TmpBudget = Annotated[
    str | None, typer.Option("--tmp-budget", help="Bytes in /tmp (default 256M).", rich_help_panel=_PANEL)
]
TmpInodes = Annotated[
    int | None,
    typer.Option(
        "--tmp-inodes", min=64, help="Files and directories in /tmp (default 16384).", rich_help_panel=_PANEL
    ),
]
ShmBudget = Annotated[
    str | None, typer.Option("--shm-budget", help="Bytes in /dev/shm (default 64M).", rich_help_panel=_PANEL)
]
ShmInodes = Annotated[
    int | None,
    typer.Option("--shm-inodes", min=16, help="Files in /dev/shm (default 1024).", rich_help_panel=_PANEL),
]
Cgroups = Annotated[
    CgroupsChoice | None,
    typer.Option(
        "--cgroups",
        help="auto: a cgroup per rollout where possible; off: rlimits only.",
        rich_help_panel=_PANEL,
    ),
]
DiskBudgets = Annotated[
    DiskChoice | None,
    typer.Option(
        "--disk-budgets",
        help="auto: bounded tmpfs mounts as root; poll: measure instead.",
        rich_help_panel=_PANEL,
    ),
]
ExecutorCage = Annotated[
    ExecutorCageChoice | None,
    typer.Option(
        "--executor-cage",
        help="bwrap: agent code in a cage of its own in the sandbox (default); shared: beside the worker.",
        rich_help_panel=_PANEL,
    ),
]


def bwrap_fields(
    *,
    memory_budget: str | None,
    max_processes: int | None,
    workspace_budget: str | None,
    workspace_inodes: int | None,
    tmp_budget: str | None,
    tmp_inodes: int | None,
    shm_budget: str | None,
    shm_inodes: int | None,
    cgroups: CgroupsChoice | None,
    disk_budgets: DiskChoice | None,
    executor_cage: ExecutorCageChoice | None,
) -> dict[str, Any]:
    """The ``BwrapSandbox`` fields the flags set (flags left out keep the defaults)."""
    values: dict[str, Any] = {
        "memory_bytes": None if memory_budget is None else parse_size(memory_budget),
        "max_processes": max_processes,
        "workspace_bytes": None if workspace_budget is None else parse_size(workspace_budget),
        "workspace_inodes": workspace_inodes,
        "tmp_size_bytes": None if tmp_budget is None else parse_size(tmp_budget),
        "tmp_inodes": tmp_inodes,
        "shm_bytes": None if shm_budget is None else parse_size(shm_budget),
        "shm_inodes": shm_inodes,
        "cgroups": None if cgroups is None else cgroups.value,
        "disk_budgets": None if disk_budgets is None else disk_budgets.value,
        "executor_cage": None if executor_cage is None else executor_cage.value,
    }
    return {key: value for key, value in values.items() if value is not None}
