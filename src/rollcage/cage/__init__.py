"""The one containment primitive: every piece of agent-authored code runs in a cage made here.

A *cage* is a bubblewrap sandbox built from nothing: an unprivileged uid (as
root, privileges are dropped before the user namespace is made, so the cage is
never host root), no capabilities, no user namespaces of its own, no network,
its own PID, IPC and UTS namespaces, a minimal read-only view of the host, a
cleared environment, and bounds on time, memory, processes, file sizes, disk and
output. Three callers share it:

* the supervisor cages the **worker** (:mod:`rollcage.supervisor.sandbox`), with
  per-rollout budgets on total memory, processes, workspace, ``/tmp`` and
  ``/dev/shm`` (:mod:`rollcage.budgets`: the mechanisms, planned, made and read per rollout);
* the worker cages its **Python executor** inside its own cage
  (:meth:`NestedCage.prefix`): agent code cannot see, signal, trace or write the
  worker, its journal or its result;
* a **grader** that runs or imports the agent's files calls
  :func:`run_contained`: the interpreter, the files given, nothing else.

This room sits low in the import graph (it needs only :mod:`rollcage.errors`, :mod:`rollcage.procs`
and the budgets' mechanisms, :mod:`rollcage.budgets`),
so environments, tools and the supervisor all use it without reaching up.

Writing a grader step that runs agent code::

    from rollcage.cage import PYTHON, run_contained

    run = await run_contained(
        [PYTHON, "-I", "-S", "check.py"],
        files={"solution.py": source, "check.py": tests},
        timeout_s=10,
    )
    # run.exit_code, run.stdout (bounded), run.timed_out; SandboxError if no cage could be made
"""

from rollcage.cage._bwrap import (
    Bind,
    BwrapTools,
    CageSpec,
    Limits,
    Mount,
    Tmpfs,
    cage_argv,
    find_tools,
    outermost,
    python_paths,
    system_mounts,
    which,
)
from rollcage.cage._enter import (
    HOLDER_SCRIPT,
    JOIN,
    MOUNT_NS,
    PID_NS,
    PR_SET_PDEATHSIG,
    EntryFailed,
    clone_sibling,
    drop_privileges,
    fork_into,
    prctl,
    setns,
    show_process,
)
from rollcage.cage._image import IMAGE_ROOT, image_cage_env, image_environment, image_prefix
from rollcage.cage._launch import Launcher, launcher, release_launcher
from rollcage.cage._nested import CAGE_ENV, NestedCage
from rollcage.cage._run_contained import PYTHON, ContainedRun, RunLimits, run_contained

__all__ = [
    "CAGE_ENV",
    "HOLDER_SCRIPT",
    "IMAGE_ROOT",
    "JOIN",
    "MOUNT_NS",
    "PID_NS",
    "PR_SET_PDEATHSIG",
    "PYTHON",
    "Bind",
    "BwrapTools",
    "CageSpec",
    "ContainedRun",
    "EntryFailed",
    "Launcher",
    "Limits",
    "Mount",
    "NestedCage",
    "RunLimits",
    "Tmpfs",
    "cage_argv",
    "clone_sibling",
    "drop_privileges",
    "find_tools",
    "fork_into",
    "image_cage_env",
    "image_environment",
    "image_prefix",
    "launcher",
    "outermost",
    "prctl",
    "python_paths",
    "release_launcher",
    "run_contained",
    "setns",
    "show_process",
    "system_mounts",
    "which",
]
