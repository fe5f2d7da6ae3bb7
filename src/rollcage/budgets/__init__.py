"""One room for budgets: the mechanisms that bound a cage, and a rollout's budgets planned, made and read.

A budget bounds the sandbox as a whole (total memory, processes, bytes and inodes of
the workspace, ``/tmp`` and ``/dev/shm``), where a per-process limit cannot. Its parts:

* **the settings** (:mod:`._settings`: :class:`BudgetSettings`): every budget and how it is
  enforced; the supervisor's :class:`~rollcage.supervisor.BwrapSandbox` is built on it, and
  ``rollcage supervise`` generates its budget flags from it;
* **the mechanisms** (:mod:`._mechanisms`): cgroups v2 and v1 (:class:`CgroupSet`), bounded
  tmpfs mounts (:class:`TmpfsVolume`, :class:`CageTmpfs`), trees polled for their size; the cage
  (:func:`rollcage.cage.run_contained`) bounds a grader's cage with them too, which is why this
  room sits below it;
* **the plan** (:mod:`._plan`: :func:`check_budgets`, :func:`planned_mechanisms`): how each
  budget will be enforced on this machine, known before anything runs; a weak one is said once,
  loudly, and ``require_budgets`` refuses it;
* **the rollout's budgets** (:mod:`._rollout`: :class:`RolloutBudgets`): made before the
  launch (the sandbox's writable places, a :class:`Scratch`), checked while it runs (the first
  breach named), reported in the receipt, and released at the end; what a killed supervisor
  left is released by a later one (:func:`release_leftovers`, :func:`sweep_orphans`, by the
  rules of :mod:`._leftovers`);
* **the poll** (:mod:`._polls`: :func:`watch_budget`): every supervision of one event
  loop read together, one thread hop per look for all that are due.
"""

from rollcage.budgets._leftovers import mount_source, settle_workspace
from rollcage.budgets._mechanisms import (
    CageTmpfs,
    CgroupSet,
    attach_mounts,
    clone_mounts,
    copy_tree,
    detect_cgroups,
    kill_cgroup,
    mount_tmpfs,
    mount_tmpfs_with_copy,
    remove_cgroup,
    unique_name,
    unmount,
)
from rollcage.budgets._plan import WEAK_MECHANISMS, check_budgets, planned_mechanisms
from rollcage.budgets._polls import watch_budget
from rollcage.budgets._rollout import (
    BUDGETS_RECORD,
    Place,
    RolloutBudgets,
    Scratch,
    owner_tag,
    private_parent,
    release_leftovers,
    remove_staged_view,
    sweep_orphans,
)
from rollcage.budgets._settings import BudgetSettings

__all__ = [
    "BUDGETS_RECORD",
    "WEAK_MECHANISMS",
    "BudgetSettings",
    "CageTmpfs",
    "CgroupSet",
    "Place",
    "RolloutBudgets",
    "Scratch",
    "attach_mounts",
    "check_budgets",
    "clone_mounts",
    "copy_tree",
    "detect_cgroups",
    "kill_cgroup",
    "mount_source",
    "mount_tmpfs",
    "mount_tmpfs_with_copy",
    "owner_tag",
    "planned_mechanisms",
    "private_parent",
    "release_leftovers",
    "remove_cgroup",
    "remove_staged_view",
    "settle_workspace",
    "sweep_orphans",
    "unique_name",
    "unmount",
    "watch_budget",
]
