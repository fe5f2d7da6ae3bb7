"""One room for a rollout's budgets: planned before the run, made before the launch, read while it runs.

A budget bounds the sandbox as a whole (total memory, processes, bytes and inodes of
the workspace, ``/tmp`` and ``/dev/shm``), where a per-process limit cannot. Its parts:

* **the plan** (:mod:`._plan`: :func:`check_budgets`, :func:`planned_mechanisms`): how each
  budget will be enforced on this machine (a cgroup, a bounded tmpfs, or only a per-process
  rlimit or a poll), known before anything runs; a weak one is said once, loudly, and
  ``require_budgets`` refuses it;
* **the rollout's budgets** (:mod:`._rollout`: :class:`RolloutBudgets`): made before the
  launch, checked while it runs (the first breach named), reported in the receipt, and
  released at the end; what a killed supervisor left is released by a later one
  (:func:`release_leftovers`, :func:`sweep_orphans`);
* **the poll** (:mod:`._polls`: :func:`watch_budget`): every supervision of one event
  loop read together, one thread hop per look for all that are due.

The mechanisms themselves (cgroups v2 and v1, bounded tmpfs mounts, trees polled for
their size) are the cage's (:mod:`rollcage.cage`), below this room, because
:func:`rollcage.cage.run_contained` bounds a grader's cage with them too.
"""

from rollcage.supervisor.budgets._plan import WEAK_MECHANISMS, check_budgets, planned_mechanisms
from rollcage.supervisor.budgets._polls import watch_budget
from rollcage.supervisor.budgets._rollout import (
    BUDGETS_RECORD,
    RolloutBudgets,
    owner_tag,
    private_parent,
    release_leftovers,
    remove_staged_view,
    sweep_orphans,
)

__all__ = [
    "BUDGETS_RECORD",
    "WEAK_MECHANISMS",
    "RolloutBudgets",
    "check_budgets",
    "owner_tag",
    "planned_mechanisms",
    "private_parent",
    "release_leftovers",
    "remove_staged_view",
    "sweep_orphans",
    "watch_budget",
]
