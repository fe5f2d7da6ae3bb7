"""Processes: the worker child, its descendants found through ``/proc``, and signals that never miss.

Linux reuses PIDs (``kernel.pid_max`` is often 32768), so a PID read from
``/proc`` may name a different process a moment later. Everything here acts on
*verified* processes only:

* the worker's direct child is never reaped until the supervisor is done with it
  (its exit is observed with ``waitid(..., WNOWAIT)``), so its PID, and with it
  its process-group id, cannot be reused while the supervisor signals the group;
* any other process is signalled through a pidfd opened and then checked
  against the start time recorded when the process was found: a pidfd names one
  process for its whole life, so a reused PID can never be hit.

Descendants are found by walking ``PPid`` links down from the worker's child,
plus the processes reparented to this one (it is a child subreaper) that carry
the rollout's token in their environment: a double-forked daemon whose parent
is gone ends up there.

Reading ``/proc`` is blocking work that grows with the machine's process count;
it runs on a small thread pool of its own (:func:`in_proc_thread`), so that a
default executor saturated by slow fsync calls cannot delay a deadline's
signals. Where only one sandbox's processes matter, :func:`subtree` follows the
kernel's per-task ``children`` lists down from known roots instead of reading
every process on the machine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import functools
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from rollcage.errors import SupervisorError

__all__ = [
    "ChildProcess",
    "ExitStatus",
    "PidHandle",
    "ProcInfo",
    "descendants",
    "ensure_subreaper",
    "has_token",
    "in_proc_thread",
    "is_subreaper",
    "ns_pids",
    "read_proc",
    "rollout_tree",
    "scan_processes",
    "subtree",
    "wait_readable",
]

_T = TypeVar("_T")

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h, Linux 6.9
_subreaper_lock = threading.Lock()
_subreaper_set = False
_executor_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None
# Children this process started through ChildProcess.spawn and has not released: never orphans.
_spawned: set[int] = set()


async def in_proc_thread(fn: Callable[..., _T], *args: object) -> _T:
    """Run blocking ``/proc`` work on the supervisor's own small thread pool.

    **Cancellation:** the caller stops waiting; the call itself runs to its end.
    """
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=4, thread_name_prefix="supervisor-proc"
            )
    return await asyncio.get_running_loop().run_in_executor(_executor, functools.partial(fn, *args))


def ensure_subreaper() -> None:
    """Make this process a child subreaper (idempotent, process-wide).

    Orphaned descendants of the workers are then reparented to this process
    rather than to init, so the supervisor can still find, kill and reap them.

    Raises:
        SupervisorError: ``prctl`` refused (not Linux, or a kernel without it).
    """
    global _subreaper_set
    with _subreaper_lock:
        if _subreaper_set:
            return
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            prctl = libc.prctl
        except (OSError, AttributeError) as exc:
            raise SupervisorError(f"cannot call prctl to become a child subreaper: {exc}") from exc
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl.restype = ctypes.c_int
        if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise SupervisorError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")
        _subreaper_set = True


def is_subreaper() -> bool:
    """Tell whether this process is a child subreaper (for tests)."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    return value.value != 0


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
    """Read one process's ``/proc/<pid>/stat``; ``None`` if it is gone."""
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


def scan_processes() -> dict[int, ProcInfo]:
    """Every process visible in ``/proc`` right now (blocking: run it in a thread)."""
    table: dict[int, ProcInfo] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                table[info.pid] = info
    return table


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
            return descendants(scan_processes(), roots, token=None)
        found.append(info)
        queue += children
    return found


def rollout_tree(roots: Iterable[int], *, token: str) -> list[ProcInfo]:
    """``descendants(scan_processes(), roots, token=token)`` without reading every process (blocking).

    The roots' subtrees through the ``children`` lists, and the orphans reparented to
    this process (a subreaper) that carry ``token``: only this process's children that
    it did not start itself are candidates, so the cost grows with the rollout, not
    with the machine (256 rollouts in flight are ~1,500 processes to read otherwise).
    Falls back to the full scan where the kernel has no ``children`` lists.
    """
    me = os.getpid()
    mine = _children(me)
    if mine is None:
        return descendants(scan_processes(), roots, token=token)
    start = list(roots)
    known = set(start)
    start += [pid for pid in mine if pid not in known and pid not in _spawned and has_token(pid, token)]
    return [info for info in subtree(start) if info.pid != me]


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


def has_token(pid: int, token: str) -> bool:
    """Whether the process's environment holds this rollout's supervision token."""
    from rollcage.supervisor.config import TOKEN_ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            return f"{TOKEN_ENV}={token}".encode() in file.read().split(b"\0")
    except OSError:
        return False


def descendants(
    table: Mapping[int, ProcInfo], roots: Iterable[int], *, token: str | None, self_pid: int | None = None
) -> list[ProcInfo]:
    """The processes descending from ``roots`` (roots included), in ``table``.

    Args:
        table: A snapshot from :func:`scan_processes`.
        roots: PIDs whose subtrees belong to the rollout (the worker's direct child).
        token: The rollout's token; children of ``self_pid`` whose environment
            holds ``TOKEN_ENV=token`` are taken as roots too (orphans that were
            reparented to this subreaper). ``None``: no such search.
        self_pid: This process (default ``os.getpid()``).

    Returns:
        The members, parents before children.
    """
    me = os.getpid() if self_pid is None else self_pid
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    start = [pid for pid in roots if pid in table]
    if token is not None:
        known = set(start)
        start += [pid for pid in children.get(me, []) if pid not in known and has_token(pid, token)]
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


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: exactly one of ``code`` and ``signal`` is set."""

    code: int | None
    signal: int | None

    @property
    def signal_name(self) -> str | None:
        """``'SIGKILL'`` etc., or ``None``."""
        return None if self.signal is None else _signal_name(self.signal)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _status_from_siginfo(info: os.waitid_result) -> ExitStatus:
    if info.si_code == os.CLD_EXITED:
        return ExitStatus(code=info.si_status, signal=None)
    return ExitStatus(code=None, signal=info.si_status)


async def wait_readable(fd: int) -> None:
    """Wait until ``fd`` is readable (for a pidfd: the process has exited).

    Bound the wait with ``asyncio.timeout``.

    **Cancellation:** the reader is removed; nothing else happens.
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def _on_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, _on_ready)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


class PidHandle:
    """A verified handle on one process (not necessarily a child): signal it, wait for it, reap it."""

    def __init__(self, info: ProcInfo, pidfd: int) -> None:
        self.info = info
        self._fd: int | None = pidfd

    @classmethod
    def open(cls, info: ProcInfo) -> PidHandle | None:
        """Open a pidfd for ``info`` and check it is still that process; ``None`` if it is gone.

        The check after opening is what makes PID reuse harmless: if the PID now
        names another process, its start time differs and the handle is refused.
        """
        try:
            fd = os.pidfd_open(info.pid)
        except OSError:
            return None
        now = read_proc(info.pid)
        if now is None or now.starttime != info.starttime:
            os.close(fd)
            return None
        return cls(info, fd)

    @property
    def fd(self) -> int:
        """The pidfd (readable once the process has exited)."""
        if self._fd is None:
            raise RuntimeError(f"pid handle {self.info.pid} is closed")
        return self._fd

    def send(self, sig: int) -> bool:
        """Send ``sig``; ``False`` if the process is already gone."""
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            return False
        return True

    def send_group(self, sig: int) -> bool | None:
        """Send ``sig`` to the process group this process leads, atomically and without a PID.

        Returns:
            ``True`` if sent, ``False`` if the group is empty, ``None`` if the kernel
            cannot do it (before Linux 6.9): find the members and signal each instead.
        """
        try:
            signal.pidfd_send_signal(self.fd, sig, None, _PIDFD_SIGNAL_PROCESS_GROUP)
        except ProcessLookupError:
            return False
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS):
                return None
            raise
        return True

    def exited(self) -> bool:
        """Whether the process has exited (a zombie counts as exited)."""
        return _poll_fd(self.fd)

    def reap(self) -> None:
        """Collect the exit status if the process is a zombie child of ours; anything else is left alone."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, self.fd, os.WEXITED | os.WNOHANG)

    def close(self) -> None:
        """Close the pidfd (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _poll_fd(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class ChildProcess:
    """The worker's direct child: started in a new session, and not reaped before :meth:`release`.

    Keeping the child unreaped (a zombie once it exits) pins its PID, which is
    also the id of its process group and session: until :meth:`release`, no
    other process can get that number, so :meth:`signal_group` can only ever
    reach this child's group.
    """

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int) -> None:
        self._popen = popen
        self._pidfd: int | None = pidfd
        self._status: ExitStatus | None = None

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        stdout: int,
        pass_fds: Sequence[int] = (),
    ) -> ChildProcess:
        """Start ``argv`` in a new session with stdin from /dev/null and stdout+stderr to ``stdout``.

        This forks and executes at once (milliseconds), as asyncio's own
        subprocess functions do.

        Raises:
            SupervisorError: The program cannot be started, or pidfds are unavailable (Linux < 5.4).
        """
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(pass_fds),
            )
        except OSError as exc:
            raise SupervisorError(f"cannot start the worker ({argv[0]}): {exc}") from exc
        try:
            # Safe: nobody has reaped the child yet (we never let Popen wait), so the PID is still it.
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
            raise SupervisorError(
                f"pidfd_open failed ({exc}); the supervisor needs Linux 5.4 or newer"
            ) from exc
        _spawned.add(popen.pid)
        return cls(popen, pidfd)

    @property
    def pid(self) -> int:
        """The child's PID (also its process group and session id)."""
        return self._popen.pid

    @property
    def status(self) -> ExitStatus | None:
        """How it ended, once :meth:`wait` has seen it end; ``None`` before."""
        return self._status

    def _peek(self) -> ExitStatus | None:
        if self._status is None and self._pidfd is not None:
            try:
                # WNOWAIT: read the status but leave the zombie, so the PID stays pinned.
                info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                # Someone else reaped it (a waitpid(-1) child watcher): the status is lost.
                self._status = ExitStatus(code=None, signal=None)
                return self._status
            if info is not None:
                self._status = _status_from_siginfo(info)
        return self._status

    async def wait(self) -> ExitStatus:
        """Wait for the child to exit, without reaping it (bound the wait with ``asyncio.timeout``).

        **Cancellation:** nothing happens to the child; it is only no longer awaited.
        """
        while True:
            status = self._peek()
            if status is not None:
                return status
            if self._pidfd is None:
                raise RuntimeError("the child was released before it exited")
            await wait_readable(self._pidfd)

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the child's whole process group; ``False`` if the group is empty or released."""
        if self._pidfd is None:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError as exc:
            if exc.errno == errno.EPERM:
                return False
            raise
        return True

    def release(self) -> ExitStatus | None:
        """Reap the child (if it exited) and close the pidfd; after this the PID is no longer ours."""
        status = self._peek()
        if self._pidfd is not None:
            if status is not None:
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
                # Tell Popen the child is gone, so it never waits on a PID that may be someone else's.
                self._popen.returncode = status.code if status.code is not None else -(status.signal or 0)
            os.close(self._pidfd)
            self._pidfd = None
            _spawned.discard(self.pid)
        return status
