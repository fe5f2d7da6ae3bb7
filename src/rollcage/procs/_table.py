"""Reading ``/proc``: one process, every process, a subtree, a group or session, a marked environment.

Linux reuses PIDs, so a PID read here may name another process a moment
later: each :class:`ProcInfo` carries the start time that, with the PID, names
one process for good. :class:`rollcage.procs.PidHandle` checks it after opening
a pidfd, so a process found here is never confused with a later one.

Reading ``/proc`` is blocking work that grows with the machine's process count;
it runs on a small thread pool of its own (:func:`in_proc_thread`), so that a
default executor saturated by slow fsync calls cannot delay a deadline's
signals. Where only one tree matters, :func:`subtree` follows the kernel's
per-task ``children`` lists down from known roots instead of reading every
process on the machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "ProcInfo",
    "argv_has",
    "command_name",
    "descendants",
    "environ_has",
    "in_proc_thread",
    "is_running",
    "live_members",
    "ns_pids",
    "pidfd_pid",
    "read_proc",
    "run_blocking_inline",
    "scan_processes",
    "subtree",
    "tree_of",
]

_T = TypeVar("_T")

# Children this process started itself (ChildProcess.spawn) or holds by the pidfd of their fork (a warm
# worker, PidfdChild) and has not released: never orphans, so tree_of reads no environ of theirs (with
# 64 rollouts in flight, every rollout's walk read every other rollout's worker's).
started_children: set[int] = set()
_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
_inline = False


def run_blocking_inline() -> None:
    """Have :func:`in_proc_thread` run its calls on the caller's thread from now on, in this process.

    For a process that waits for each of them and has nothing else to do meanwhile (a worker: its
    executor's ``/proc`` sweep, in its own small PID namespace; its result's publication): a
    thread hop costs it more CPU than the call (~0.35 ms on a 2-core VM), and the first one a
    thread's start. Not for a supervisor, whose loop serves other rollouts meanwhile.
    """
    global _inline
    _inline = True


async def in_proc_thread(fn: Callable[..., _T], *args: object) -> _T:
    """Run blocking ``/proc`` work (and a worker's few other blocking calls) on a small pool of its own.

    On the caller's thread, blocking the loop, in a process that asked for it (:func:`run_blocking_inline`).

    **Cancellation:** the caller stops waiting; the call itself runs to its end.
    """
    global _executor
    if _inline:
        return fn(*args)
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="proc-scan")
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(fn, *args))


@dataclass(frozen=True)
class ProcInfo:
    """One process as ``/proc`` described it at one moment.

    Attributes:
        pid: Process id (in this process's PID namespace).
        ppid: Parent's pid.
        pgid: Process group.
        sid: Session.
        starttime: Start time in clock ticks since boot: with ``pid`` it names one process.
        state: One-letter state (``Z`` zombie, ``X`` dead, ...).
    """

    pid: int
    ppid: int
    pgid: int
    sid: int
    starttime: int
    state: str

    @property
    def alive(self) -> bool:
        """Not a zombie: it can still run, fork or hold resources."""
        return self.state not in ("Z", "X", "x")


def read_proc(pid: int) -> ProcInfo | None:
    """Read one process's ``/proc/<pid>/stat``; ``None`` if it is gone (blocking, but one small read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            data = file.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain ") ", so split at the last one.
    try:
        fields = data[data.rindex(b")") + 2 :].split()
        return ProcInfo(
            pid=pid,
            state=fields[0].decode("ascii", "replace"),
            ppid=int(fields[1]),
            pgid=int(fields[2]),
            sid=int(fields[3]),
            starttime=int(fields[19]),
        )
    except (ValueError, IndexError):
        return None


def command_name(pid: int) -> str | None:
    """The process's command name (``/proc/<pid>/comm``, at most 15 bytes); ``None`` if it is gone."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as file:
            return file.read().rstrip(b"\n").decode("utf-8", "replace")
    except OSError:
        return None


def is_running(pid: int) -> bool:
    """Whether the process is running: neither gone nor a zombie, even one not reapable yet.

    A process whose main thread called ``os._exit`` from another thread shows as a
    zombie while its other threads are still being torn down; ``waitpid`` and a
    pidfd only report it a moment later. Anything sent to it in that moment is lost.
    """
    info = read_proc(pid)
    return info is not None and info.alive


def scan_processes() -> dict[int, ProcInfo]:
    """Every process visible in ``/proc`` right now (blocking: run it in a thread).

    Raises:
        OSError: There is no ``/proc`` to read.
    """
    table: dict[int, ProcInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                table[info.pid] = info
    return table


def live_members(sid: int) -> list[ProcInfo] | None:
    """The processes, zombies and this one excepted, in the process group or session ``sid``.

    A process started in a new session leads both, so its pid is both ids: a
    member that left the group (``setpgid``) but not the session is still found.
    Zombies are left out: they are dead, and an orphan's zombie waits for
    whatever reaps orphans. ``None`` where there is no ``/proc`` (blocking).
    """
    try:
        table = scan_processes()
    except OSError:
        return None
    me = os.getpid()
    return [info for info in table.values() if info.alive and info.pid != me and sid in (info.pgid, info.sid)]


def _children(pid: int) -> list[int] | None:
    """PIDs of ``pid``'s children from its tasks' ``children`` lists; ``None`` if the kernel has none."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as file:
                found += [int(part) for part in file.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread (or process) ended meanwhile
            return None  # a kernel without CONFIG_PROC_CHILDREN
        except (OSError, ValueError):
            continue
    return found


def subtree(roots: Iterable[int]) -> list[ProcInfo]:
    """The processes descending from ``roots`` (roots included), parents first (blocking).

    Follows the per-task ``children`` lists, so the cost grows with the subtree,
    not with the machine; falls back to a full scan where the kernel lacks them.
    """
    found: list[ProcInfo] = []
    seen: set[int] = set()
    queue = list(roots)
    while queue:
        pid = queue.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        info = read_proc(pid)
        if info is None:
            continue
        children = _children(pid)
        if children is None:
            return descendants(scan_processes(), roots, marked=None)
        found.append(info)
        queue += children
    return found


def ns_pids(pid: int) -> tuple[int, ...]:
    """The process's PID in each nested PID namespace, outermost first (``NSpid``); ``()`` if gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as file:
            for line in file:
                if line.startswith(b"NSpid:"):
                    return tuple(int(part) for part in line.split()[1:])
    except (OSError, ValueError):
        pass
    return ()


def argv_has(pid: int, word: str) -> bool:
    """Whether the process's command line holds ``word`` as one of its words exactly."""
    return _holds(pid, "cmdline", word)


def _holds(pid: int, name: str, word: str) -> bool:
    """Whether ``/proc/PID/NAME`` (NUL-separated: ``cmdline``, ``environ``) holds ``word`` exactly."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as file:
            return word.encode() in file.read().split(b"\0")
    except OSError:
        return False


def pidfd_pid(pidfd: int) -> int:
    """The PID, in this process's PID namespace, of the process ``pidfd`` names (0: not seen from here)."""
    try:
        with open(f"/proc/self/fdinfo/{pidfd}", "rb") as info:
            return next(int(line.split()[1]) for line in info if line.startswith(b"Pid:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def environ_has(pid: int, entry: str) -> bool:
    """Whether the process's environment holds ``entry`` (``NAME=value``) exactly."""
    return _holds(pid, "environ", entry)


def descendants(
    table: Mapping[int, ProcInfo], roots: Iterable[int], *, marked: str | None, self_pid: int | None = None
) -> list[ProcInfo]:
    """The processes descending from ``roots`` (roots included), in ``table``.

    Args:
        table: A snapshot from :func:`scan_processes`.
        roots: PIDs whose subtrees belong to the tree (e.g. a supervised child).
        marked: An environment entry (``NAME=value``) that marks the tree's
            processes: children of ``self_pid`` holding it are taken as roots too
            (orphans reparented to this process, a child subreaper). ``None``: no
            such search.
        self_pid: This process (default ``os.getpid()``).

    Returns:
        The members, parents before children.
    """
    me = os.getpid() if self_pid is None else self_pid
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    start = [pid for pid in roots if pid in table]
    if marked is not None:
        known = set(start)
        start += [pid for pid in children.get(me, []) if pid not in known and environ_has(pid, marked)]
    found: list[ProcInfo] = []
    seen: set[int] = set()
    queue = list(start)
    while queue:
        pid = queue.pop(0)
        if pid in seen or pid == me:
            continue
        seen.add(pid)
        found.append(table[pid])
        queue.extend(children.get(pid, []))
    return found


def tree_of(roots: Iterable[int], *, marked: str) -> list[ProcInfo]:
    """``descendants(scan_processes(), roots, marked=marked)`` without reading every process (blocking).

    The roots' subtrees through the ``children`` lists, and the orphans reparented to
    this process (a subreaper) that carry ``marked``: only this process's children that
    it did not start itself are candidates, so the cost grows with the tree, not with
    the machine (256 rollouts in flight are ~1,500 processes to read otherwise).
    Falls back to the full scan where the kernel has no ``children`` lists.
    """
    me = os.getpid()
    mine = _children(me)
    if mine is None:
        return descendants(scan_processes(), roots, marked=marked)
    start = list(roots)
    known = set(start)
    start += [
        pid for pid in mine if pid not in known and pid not in started_children and environ_has(pid, marked)
    ]
    return [info for info in subtree(start) if info.pid != me]
