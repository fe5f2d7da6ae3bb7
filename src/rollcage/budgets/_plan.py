"""How each budget will be enforced on this machine, known before anything runs.

:class:`~rollcage.budgets.RolloutBudgets` decides per rollout (a cgroup
where this process may make one, a bounded tmpfs as root, else a per-process rlimit
or a poll) and the receipt names the mechanism. A run needs the answer before its
first rollout: a budget that is not a hard bound here is said once, loudly, when
the run starts (:func:`check_budgets`), and ``require_budgets`` refuses to run at
all. ``rlimit`` (per process: four processes under a 1 GiB limit hold 4 GiB) and
``poll`` (measured every ``budget_poll_s``: the agent writes past it meanwhile) are
weak; a cgroup and a bounded tmpfs are hard bounds.
"""

from __future__ import annotations

import logging
import os
import threading

from rollcage.budgets._mechanisms import CgroupSupport, detect_cgroups
from rollcage.budgets._settings import BudgetSettings
from rollcage.errors import SandboxError
from rollcage.protocol import BudgetMechanism, BudgetName

__all__ = ["WEAK_MECHANISMS", "check_budgets", "planned_mechanisms", "weak_budgets"]

logger = logging.getLogger("rollcage.supervisor")

WEAK_MECHANISMS: frozenset[BudgetMechanism] = frozenset({"rlimit", "poll"})
"""Mechanisms that do not bound the sandbox as a whole at every moment."""

_HOW_TO = (
    "a delegated cgroup v2 subtree gives memory and processes hard bounds (e.g. run under "
    "`systemd-run --user --scope -p Delegate=yes`); root gives every budget one"
)


def planned_mechanisms(
    config: BudgetSettings, *, euid: int | None = None
) -> dict[BudgetName, BudgetMechanism]:
    """The mechanism each budget asked for will have here (blocking: reads the cgroup tree once).

    Mirrors :meth:`RolloutBudgets.prepare <rollcage.budgets.RolloutBudgets.prepare>`:
    cgroups where :func:`~rollcage.cage.detect_cgroups` finds them (``cgroups="auto"``), bounded
    tmpfs mounts as root (``disk_budgets="auto"``), otherwise bubblewrap's size-bounded tmpfs for
    ``/tmp`` and ``/dev/shm`` and a poll for the rest. A budget set to ``None`` is left out.

    Args:
        config: The sandbox's budgets.
        euid: The effective uid to plan for (default: this process's).
    """
    support = detect_cgroups() if config.cgroups == "auto" else CgroupSupport(memory=None, pids=None)
    mounted = config.disk_budgets == "auto" and (os.geteuid() if euid is None else euid) == 0
    planned: dict[BudgetName, BudgetMechanism] = {}
    if config.memory_bytes is not None:
        planned["memory_bytes"] = support.memory[0] if support.memory is not None else "rlimit"
    if config.max_processes is not None:
        planned["processes"] = support.pids[0] if support.pids is not None else "rlimit"
    planned["workspace_bytes"] = "tmpfs" if mounted else "poll"
    planned["workspace_inodes"] = "tmpfs" if mounted else "poll"
    planned["tmp_bytes"] = "tmpfs"  # bubblewrap's --size bounds it without root
    planned["tmp_inodes"] = "tmpfs" if mounted else "poll"
    planned["shm_bytes"] = "tmpfs"
    planned["shm_inodes"] = "tmpfs" if mounted else "poll"
    return planned


def weak_budgets(mechanisms: dict[BudgetName, BudgetMechanism], config: BudgetSettings) -> list[str]:
    """One phrase per budget whose mechanism is weak: its name and what bounds it instead."""
    words: list[str] = []
    for budget, mechanism in mechanisms.items():
        if mechanism not in WEAK_MECHANISMS:
            continue
        off = " (--cgroups off)" if config.cgroups == "off" else ""
        if budget == "memory_bytes":
            why = f"a per-process address-space rlimit only, no memory cgroup{off}"
        elif budget == "processes":
            why = f"RLIMIT_NPROC only, no pids cgroup{off}: a breach is not seen"
        elif config.disk_budgets == "poll":
            why = f"polled every {config.budget_poll_s:g} s (--disk-budgets poll)"
        elif os.geteuid() != 0:
            why = f"polled every {config.budget_poll_s:g} s: no bounded tmpfs without root"
        else:
            why = f"polled every {config.budget_poll_s:g} s: its bounded tmpfs could not be mounted"
        words.append(f"{budget} ({why})")
    return words


_warned: set[str] = set()
_warned_lock = threading.Lock()


def check_budgets(config: BudgetSettings) -> list[str]:
    """Say which budgets are weak here, once per process; refuse if ``require_budgets`` (blocking).

    Returns:
        The weak budgets' phrases (empty: every budget is a hard bound).

    Raises:
        SandboxError: ``config.require_budgets`` is set and a budget asked for would be weak; the
            message names each, and what would make it a hard bound.
    """
    weak = weak_budgets(planned_mechanisms(config), config)
    if not weak:
        return weak
    listed = "; ".join(weak)
    if config.require_budgets:
        raise SandboxError(
            f"--require-budgets: {len(weak)} budget(s) cannot be enforced as a hard bound here: {listed}. "
            f"Where: {_HOW_TO}; or run without --require-budgets"
        )
    line = (
        f"WEAK BUDGETS: {len(weak)} sandbox budget(s) are not hard bounds here: {listed}. "
        f"A rollout can pass them before it is stopped; {_HOW_TO}; --require-budgets refuses to run instead"
    )
    with _warned_lock:
        if line in _warned:
            return weak
        _warned.add(line)
    logger.warning("%s", line)
    return weak
