"""The sandbox's budget and containment flags, shared by ``rollcage run`` and ``rollcage supervise``.

The budget flags are generated (:mod:`rollcage.commands._config_options`) from the budgets'
model, :class:`rollcage.budgets.BudgetSettings`, which :class:`rollcage.supervisor.BwrapSandbox`
is built on: a budget added to the model is a config key and a flag of both commands, with the
same spelling, without a line here. What is spelled here is each flag that keeps an older name
(``memory_bytes`` -> ``--memory-budget``); any other field is ``--bwrap-<field>``, as ``rollcage
run`` spells the sandbox's fields. Sizes take a unit (``512M``, ``4G``).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Annotated, Any

import typer

from rollcage.commands._config_options import FieldOption, Spelling, field_options, given_values

__all__ = [
    "FLAG_OF_FIELD",
    "ExecutorCage",
    "ExecutorCageChoice",
    "WorkerStart",
    "WorkerStartChoice",
    "bwrap_fields",
    "sandbox_options",
]

_PANEL = "Sandbox budgets"

FLAG_OF_FIELD: dict[str, str] = {
    "memory_bytes": "--memory-budget",
    "max_processes": "--max-processes",
    "workspace_bytes": "--workspace-budget",
    "workspace_inodes": "--workspace-inodes",
    "tmp_size_bytes": "--tmp-budget",
    "tmp_inodes": "--tmp-inodes",
    "shm_bytes": "--shm-budget",
    "shm_inodes": "--shm-inodes",
    "cgroups": "--cgroups",
    "disk_budgets": "--disk-budgets",
    "require_budgets": "--require-budgets",
    "executor_cage": "--executor-cage",
    "worker_start": "--worker-start",
}
"""The flag of each ``BwrapSandbox`` field that keeps a spelling of its own (scripts and docs use them)."""

_CONTAINMENT = ("executor_cage", "worker_start")
"""``BwrapSandbox`` fields beside the budgets that ``rollcage supervise`` takes (spelled below)."""
_BWRAP_ONLY = ("executor_cage",)
"""Of those, the ones ``--sandbox none`` refuses (``worker_start`` is ``NoSandbox``'s too)."""


class ExecutorCageChoice(enum.StrEnum):
    """Where the agent's code runs inside the sandbox."""

    bwrap = "bwrap"
    shared = "shared"


class WorkerStartChoice(enum.StrEnum):
    """How each rollout's worker starts in its sandbox."""

    warm = "warm"
    cold = "cold"


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
        help="warm: the worker forked from a pre-imported template (default; into its bwrap sandbox, "
        "as root or not, or beside a holder with --sandbox none); cold: a fresh interpreter per rollout.",
        rich_help_panel=_PANEL,
    ),
]


def sandbox_options() -> list[FieldOption]:
    """The budget flags of ``rollcage supervise``: one per :class:`~rollcage.budgets.BudgetSettings` field.

    Each lands at ``("sandbox", field)`` of the supervisor's config (its errors reported at
    ``("sandbox", "bwrap", field)``), spelled as ``rollcage run`` spells the same field.
    """
    from rollcage.budgets import BudgetSettings

    return field_options(
        BudgetSettings,
        spellings={("sandbox", field): Spelling(flag) for field, flag in FLAG_OF_FIELD.items()},
        prefix="bwrap-",
        path=("sandbox",),
        tag="bwrap",
        panels={("sandbox",): _PANEL},
    )


def bwrap_fields(
    flags: Mapping[str, Any], *, sandbox: str, options: list[FieldOption] | None = None
) -> dict[str, Any]:
    """The ``BwrapSandbox`` fields the flags set (flags left out keep the defaults).

    Args:
        flags: The command's parameters; only the budget flags (:func:`sandbox_options`) and
            ``executor_cage`` and ``worker_start`` are read.
        sandbox: The ``--sandbox`` chosen: budgets are enforced by the bubblewrap sandbox only
            (``worker_start`` is also ``--sandbox none``'s: see :class:`~rollcage.supervisor.NoSandbox`).
        options: :func:`sandbox_options`, if the caller has them already.

    Raises:
        typer.BadParameter: A budget flag was given with ``--sandbox none`` (it would be ignored), or
            a size that is not one.
    """
    options = sandbox_options() if options is None else options
    given = {option.param: option.flag for option in options if flags.get(option.param) is not None}
    given |= {name: FLAG_OF_FIELD[name] for name in _BWRAP_ONLY if flags.get(name) is not None}
    if sandbox != "bwrap" and given:
        flag = next(iter(given.values()))
        why = f"{flag} needs --sandbox bwrap: with --sandbox {sandbox} no budget is enforced"
        raise typer.BadParameter(why, param_hint=flag)
    fields: dict[str, Any] = given_values(options, flags).get("sandbox", {})
    for name in _CONTAINMENT:
        value = flags.get(name)
        if value is not None:
            fields[name] = value.value if isinstance(value, enum.Enum) else value
    return fields
