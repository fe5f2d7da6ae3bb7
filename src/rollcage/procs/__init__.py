"""Process lifecycle, once: find, signal, stop and reap process trees; finish clean-up under cancellation.

The supervisor (the worker and its sandbox), the executors (a Python child and
what it forks) and the cage (a contained command) all start processes that must
not outlive them. What they share lives here, at the bottom of the import graph
(it needs nothing of rollcage), so each room uses it without reaching up:

* ``/proc``: :func:`read_proc`, :func:`command_name`, :func:`scan_processes`, :func:`subtree`,
  :func:`descendants` (with the orphans a subreaper adopted, found by a marker in
  their environment), :func:`live_members` of a group or session;
* signals that never miss: :func:`signal_group`, :class:`PidHandle` (a pidfd
  checked after opening, so a reused PID is never hit), :class:`ChildProcess` (a
  child kept unreaped, so its group id stays its own), :func:`ensure_subreaper`;
* signals held while a process starts: :func:`hold_cancel_signals` and
  :func:`release_cancel_signals` (SIGTERM and SIGINT pending until the handlers are in place);
* stopping: :func:`stop_tree` with a :class:`StopStrategy` (trio's
  ``deliver_cancel``: polite signal, grace, SIGKILL to the whole tree, always wait),
  on any :class:`ProcessTree`, its progress an explicit :class:`TreeStop` state;
* the one cancellation dialect: :func:`shielded` (shield and finish: the work
  runs to its end, a cancellation is remembered and re-raised after),
  :func:`wait_shared`, :func:`within`, :func:`first_of` and :func:`cancel_and_wait`;
* one task per event loop serving many watches (:class:`LoopPoller`, :func:`poller_for`): the
  supervisor's stop files and the budgets' polls.

Stopping a child the way the executors do::

    from rollcage.procs import GroupTree, StopStrategy, stop_tree

    gone = await stop_tree(GroupTree(proc.pid, exit_future), StopStrategy(grace_s=2, kill_wait_s=5))
"""

from rollcage.procs._ancillary import CREDENTIALS_SPACE, unpack_ancillary
from rollcage.procs._cancel import AsyncClosing, cancel_and_wait, first_of, shielded, wait_shared, within
from rollcage.procs._handles import (
    ChildProcess,
    ExitStatus,
    PidfdChild,
    PidHandle,
    any_exit,
    describe_exit,
    ensure_subreaper,
    is_subreaper,
    pid_exists,
    read_ready,
    reap_abandoned,
    receive_message,
    signal_group,
    signal_name,
    wait_for_children_by_pidfd,
    wait_readable,
)
from rollcage.procs._held import hold_cancel_signals, release_cancel_signals
from rollcage.procs._loops import LoopPoller, poller_for
from rollcage.procs._reap import reap_children
from rollcage.procs._stop import GroupTree, ProcessTree, StopPhase, StopStrategy, TreeStop, stop_tree
from rollcage.procs._table import (
    ProcInfo,
    argv_has,
    command_name,
    descendants,
    environ_has,
    in_proc_thread,
    is_running,
    live_members,
    ns_pids,
    pidfd_pid,
    read_proc,
    run_blocking_inline,
    scan_processes,
    subtree,
    tree_of,
)

__all__ = [
    "CREDENTIALS_SPACE",
    "AsyncClosing",
    "ChildProcess",
    "ExitStatus",
    "GroupTree",
    "LoopPoller",
    "PidHandle",
    "PidfdChild",
    "ProcInfo",
    "ProcessTree",
    "StopPhase",
    "StopStrategy",
    "TreeStop",
    "any_exit",
    "argv_has",
    "cancel_and_wait",
    "command_name",
    "descendants",
    "describe_exit",
    "ensure_subreaper",
    "environ_has",
    "first_of",
    "hold_cancel_signals",
    "in_proc_thread",
    "is_running",
    "is_subreaper",
    "live_members",
    "ns_pids",
    "pid_exists",
    "pidfd_pid",
    "poller_for",
    "read_proc",
    "read_ready",
    "reap_abandoned",
    "reap_children",
    "receive_message",
    "release_cancel_signals",
    "run_blocking_inline",
    "scan_processes",
    "shielded",
    "signal_group",
    "signal_name",
    "stop_tree",
    "subtree",
    "tree_of",
    "unpack_ancillary",
    "wait_for_children_by_pidfd",
    "wait_readable",
    "wait_shared",
    "within",
]
