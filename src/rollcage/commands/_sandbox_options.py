"""The sandbox's budget and containment flags, shared by ``rollcage run`` and ``rollcage supervise``.

Each flag is one field of :class:`rollcage.supervisor.BwrapSandbox` (the config
key has the same name with underscores); sizes take a unit (``512M``, ``4G``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any

import typer

__all__ = [
    "BUDGET_FLAGS",
    "FLAG_OF_FIELD",
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


class WorkerStartChoice(enum.StrEnum):
    """How each rollout's worker starts in its sandbox."""

    warm = "warm"
    cold = "cold"


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
RequireBudgets = Annotated[
    bool | None,
    typer.Option(
        "--require-budgets",
        help="Refuse to run (exit 2) when a budget cannot be a hard bound here (no cgroup, only a poll).",
        rich_help_panel=_PANEL,
        show_default=False,
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
WorkerStart = Annotated[
    WorkerStartChoice | None,
    typer.Option(
        "--worker-start",
        help="warm: the worker forked into its sandbox from a pre-imported template (default, as root); "
        "cold: a fresh interpreter per rollout.",
        rich_help_panel=_PANEL,
    ),
]


BUDGET_FLAGS = (
    "memory_budget",
    "max_processes",
    "workspace_budget",
    "workspace_inodes",
    "tmp_budget",
    "tmp_inodes",
    "shm_budget",
    "shm_inodes",
    "cgroups",
    "disk_budgets",
    "require_budgets",
    "executor_cage",
    "worker_start",
)
"""The commands' parameter names of the flags above."""

_SIZES = {"memory_budget", "workspace_budget", "tmp_budget", "shm_budget"}
_FIELDS = {
    "memory_budget": "memory_bytes",
    "workspace_budget": "workspace_bytes",
    "tmp_budget": "tmp_size_bytes",
    "shm_budget": "shm_bytes",
}

FLAG_OF_FIELD: dict[str, str] = {
    _FIELDS.get(name, name): "--" + name.replace("_", "-") for name in BUDGET_FLAGS
}
"""The flag of each ``BwrapSandbox`` field spelled here (``memory_bytes`` -> ``--memory-budget``)."""


def bwrap_fields(flags: Mapping[str, Any], *, sandbox: str) -> dict[str, Any]:
    """The ``BwrapSandbox`` fields the flags set (flags left out keep the defaults).

    Args:
        flags: The command's parameters (e.g. its ``locals()``); only :data:`BUDGET_FLAGS` are read.
        sandbox: The ``--sandbox`` chosen: budgets are enforced by the bubblewrap sandbox only.

    Raises:
        typer.BadParameter: A budget flag was given with ``--sandbox none`` (it would be ignored).
    """
    fields: dict[str, Any] = {}
    for name in BUDGET_FLAGS:
        value = flags.get(name)
        if value is None:
            continue
        if sandbox != "bwrap":
            flag = "--" + name.replace("_", "-")
            why = f"{flag} needs --sandbox bwrap: with --sandbox {sandbox} no budget is enforced"
            raise typer.BadParameter(why, param_hint=flag)
        if name in _SIZES:
            value = parse_size(value)
        elif isinstance(value, enum.Enum):
            value = value.value
        fields[_FIELDS.get(name, name)] = value
    return fields
