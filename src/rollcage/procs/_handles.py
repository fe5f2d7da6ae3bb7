"""Signals that never miss: process groups, pidfds, a child kept unreaped, the subreaper flag.

Everything here acts on *verified* processes only:

* a child started by :class:`ChildProcess` is never reaped until its owner is
  done with it (its exit is observed with ``waitid(..., WNOWAIT)``), so its PID,
  and with it its process-group id, cannot be reused while the group is signalled;
* any other process is signalled through a :class:`PidHandle`: a pidfd opened and
  then checked against what was known of the process (its start time, its
  cgroup): a pidfd names one process for its whole life, so a reused PID is never hit.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rollcage.procs._ancillary import CREDENTIALS_SPACE, unpack_ancillary
from rollcage.procs._cancel import first_of
from rollcage.procs._table import ProcInfo, read_proc, started_children

__all__ = [
    "CREDENTIALS_SPACE",
    "ChildProcess",
    "ExitStatus",
    "PidHandle",
    "PidfdChild",
    "any_exit",
    "describe_exit",
    "ensure_subreaper",
    "group_exists",
    "is_subreaper",
    "pid_exists",
    "reap_abandoned",
    "receive_message",
    "signal_group",
    "signal_name",
    "unpack_ancillary",
    "wait_for_children_by_pidfd",
    "wait_readable",
]

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_PIDFD_SIGNAL_PROCESS_GROUP = 4  # linux/pidfd.h, Linux 6.9
_subreaper_lock = threading.Lock()
_subreaper_set = False


def signal_name(number: int) -> str:
    """``'SIGKILL'`` for 9; ``'SIG99'`` for a number with no name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def _shell_code(info: os.waitid_result) -> int:
    """A ``waitid`` result as a shell reports it: the exit code, or 128 + N for signal N."""
    return info.si_status if info.si_code == os.CLD_EXITED else 128 + info.si_status


class PidfdChild:
    """A child of this process known by the pidfd the kernel made at its fork (``CLONE_PIDFD``).

    No number is ever used to reach it: it is signalled, awaited and reaped through the pidfd,
    so a reused PID is never hit. (A warm worker: forked by the template as this process's child.)
    """

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        """Its PID, for a :class:`ProcInfo` or a message."""
        self._fd: int | None = pidfd
        # Known whose it is: never an orphan to look for by token (tree_of reads no environ of it).
        started_children.add(pid)

    @classmethod
    def of_child(cls, pid: int) -> PidfdChild | None:
        """A child of this process that nobody has reaped yet (so ``pid`` is still it); ``None`` if gone."""
        try:
            return cls(pid, os.pidfd_open(pid))
        except OSError:
            return None

    def handle(self) -> PidHandle | None:
        """A :class:`PidHandle` of it (a pidfd of its own); ``None`` if it is closed or gone."""
        info = read_proc(self.pid)
        if self._fd is None or info is None:
            return None
        # Not reaped (only this object reaps it): the PID still names it, zombie or not.
        return PidHandle(info, os.dup(self._fd))

    def kill(self) -> None:
        """SIGKILL it (nothing if it has exited)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._fd, signal.SIGKILL)

    async def wait(self) -> None:
        """Wait until it has exited (bound the wait with ``asyncio.timeout``).

        **Cancellation:** nothing happens to it; it is only no longer awaited.
        """
        if self._fd is not None:
            await wait_readable(self._fd)

    def reap(self) -> int | None:
        """Reap it if it has exited, without blocking, and close the pidfd; its exit code.

        Returns:
            Its exit code as a shell reports it (the code, or 128 + N for signal N); ``None``
            while it runs (the pidfd is then kept), or if someone else reaped it.
        """
        status = self.reap_status()
        if status is None or (status.code is None and status.signal is None):
            return None
        return status.code if status.signal is None else 128 + status.signal

    def reap_status(self) -> ExitStatus | None:
        """:meth:`reap`, its status whole: an exit code apart from a signal (``None``: as :meth:`reap`)."""
        if self._fd is None:
            return None
        try:
            info = os.waitid(os.P_PIDFD, self._fd, os.WEXITED | os.WNOHANG)
            if info is None:
                return None  # still running
        except OSError:
            info = None  # not ours to reap any more (a waitpid(-1) elsewhere took it)
        os.close(self._fd)
        self._fd = None
        started_children.discard(self.pid)
        return None if info is None else _status_from_siginfo(info)

    def exited(self) -> int | None:
        """Its exit code as :meth:`reap` reports it if it has exited, without reaping it; else ``None``."""
        if self._fd is None:
            return None
        try:
            info = os.waitid(os.P_PIDFD, self._fd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except OSError:
            return None
        return None if info is None else _shell_code(info)

    @property
    def reaped(self) -> bool:
        """Whether it has been reaped (or given up on)."""
        return self._fd is None

    def abandon(self) -> None:
        """Kill it, and reap it now or, if it is still dying, at a later :func:`reap_abandoned`."""
        self.kill()
        if self.reap() is None and not self.reaped:
            with _abandoned_lock:
                _abandoned.append(self)


_abandoned: list[PidfdChild] = []
_abandoned_lock = threading.Lock()


def reap_abandoned() -> None:
    """Reap the abandoned children that have exited since (a zombie keeps its PID until then)."""
    with _abandoned_lock:
        for child in list(_abandoned):
            child.reap()
            if child.reaped:
                _abandoned.remove(child)


def describe_exit(returncode: int | None) -> str:
    """A ``subprocess`` return code in words: ``exit code 3``, ``killed by SIGKILL``, ``still running``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"killed by {signal_name(-returncode)}"
    return f"exit code {returncode}"


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pgid``; whether it reached anyone.

    ``False`` when the group is empty, or when every member is one this process
    may not signal (a setuid program): either way nothing more can be done.
    Only for a group whose id cannot have been reused: its leader is an unreaped
    child of this process (see :class:`ChildProcess`), or is known to be alive.
    """
    if pgid <= 0:
        raise ValueError(f"not a process group id: {pgid}")
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def group_exists(pgid: int) -> bool:
    """Whether any process is left in the group ``pgid`` (zombies count until they are reaped)."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member we may not signal is still a member
    return True


def pid_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (it may be a zombie, or a later process that got the PID)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ensure_subreaper() -> None:
    """Make this process a child subreaper (idempotent, process-wide).

    Orphaned descendants of its children are then reparented to this process
    rather than to init, so it can still find, kill and reap them.

    Raises:
        OSError: ``prctl`` refused (not Linux, or a kernel without it).
    """
    global _subreaper_set
    with _subreaper_lock:
        if _subreaper_set:
            return
        import ctypes

        try:
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError) as exc:
            raise OSError(f"cannot call prctl to become a child subreaper: {exc}") from exc
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        prctl.restype = ctypes.c_int
        if prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(err)}")
        _subreaper_set = True


def wait_for_children_by_pidfd() -> None:
    """Have asyncio wait for this process's subprocesses through pidfds, not a thread for each.

    Python 3.11's default child watcher starts a thread for every subprocess, only to wait for
    it; 3.12 and later use pidfds by default where the kernel has them (then this does nothing),
    as it does where the kernel has none (Linux < 5.3). For a process that is asyncio's alone
    (the worker): the watcher is the event loop policy's, for every loop after this call.
    """
    if sys.version_info >= (3, 12):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return
    asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


def is_subreaper() -> bool:
    """Tell whether this process is a child subreaper (for tests)."""
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0)
    return value.value != 0


@dataclass(frozen=True)
class ExitStatus:
    """How a process ended: at most one of ``code`` and ``signal`` is set (neither: the status was lost)."""

    code: int | None
    signal: int | None

    @property
    def signal_name(self) -> str | None:
        """``'SIGKILL'`` etc., or ``None``."""
        return None if self.signal is None else signal_name(self.signal)

    @property
    def returncode(self) -> int | None:
        """As ``subprocess`` says it: the exit code, or minus the signal; ``None`` if the status was lost."""
        return self.code if self.signal is None else -self.signal


def _status_from_siginfo(info: os.waitid_result) -> ExitStatus:
    if info.si_code == os.CLD_EXITED:
        return ExitStatus(code=info.si_status, signal=None)
    return ExitStatus(code=None, signal=info.si_status)


async def receive_message(
    sock: socket.socket, size: int, *, fds: int = 0, credentials: bool = False
) -> tuple[bytes, list[int], int]:
    """One message of a non-blocking socket, once it comes: its bytes (``b""``: end of file), the
    descriptors with it (room for ``fds``), and its sender's PID here (``credentials``: ``SO_PASSCRED``
    set on ``sock``; else 0).

    **Cancellation:** nothing is read.
    """
    room = (socket.CMSG_SPACE(4 * fds) if fds else 0) + (CREDENTIALS_SPACE if credentials else 0)
    while True:
        await wait_readable(sock.fileno())
        try:
            # Close-on-exec from the first instant: a process spawned meanwhile inherits none of them.
            data, ancillary, _, _ = sock.recvmsg(size, room, socket.MSG_CMSG_CLOEXEC)
        except BlockingIOError:
            continue
        received, sender = unpack_ancillary(ancillary)
        return data, received, sender


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


async def read_ready(fd: int, size: int = 65536) -> bytes:
    """Wait until the non-blocking ``fd`` is readable and read what is there; ``b""`` at end of file.

    **Cancellation:** nothing is read.
    """
    while True:
        await wait_readable(fd)
        try:
            return os.read(fd, size)
        except BlockingIOError:
            continue


def _poll_fd(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


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
        return cls.open_checked(info, lambda pid: _same_start(pid, info))

    @classmethod
    def open_checked(cls, info: ProcInfo, still_it: Callable[[int], bool]) -> PidHandle | None:
        """Open a pidfd for ``info.pid``; keep it only if ``still_it(pid)``, asked *after* opening, holds.

        Whatever ``still_it`` checks (the start time, membership of a cgroup) then
        holds of the process the pidfd names, for good.
        """
        try:
            fd = os.pidfd_open(info.pid)
        except OSError:
            return None
        try:
            verified = still_it(info.pid)
        except BaseException:
            os.close(fd)
            raise
        if not verified:
            os.close(fd)
            return None
        return cls(info, fd)

    @classmethod
    def of_child(cls, pid: int) -> PidHandle | None:
        """A handle on a child of this process that nobody has reaped yet (so ``pid`` is still it).

        ``None`` where the child is already gone or pidfds are unavailable (not Linux, or before 5.3).
        """
        info = read_proc(pid)
        if info is None:
            return None
        try:
            return cls(info, os.pidfd_open(pid))
        except (AttributeError, OSError):
            return None

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

    async def wait(self) -> None:
        """Wait until the process has exited (bound the wait with ``asyncio.timeout``).

        **Cancellation:** nothing happens to the process; it is only no longer awaited.
        """
        await wait_readable(self.fd)

    def reap(self) -> None:
        """Collect the exit status if the process is a zombie child of ours; anything else is left alone."""
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, self.fd, os.WEXITED | os.WNOHANG)

    def close(self) -> None:
        """Close the pidfd (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _same_start(pid: int, info: ProcInfo) -> bool:
    now = read_proc(pid)
    return now is not None and now.starttime == info.starttime


async def any_exit(handles: Sequence[PidHandle]) -> None:
    """Return once any of ``handles`` has exited.

    **Cancellation:** the waits are cancelled; nothing happens to the processes.
    """
    await first_of(*(handle.wait() for handle in handles))


class ChildProcess:
    """A child started in a new session, and not reaped before :meth:`release`.

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
        stdin: int | None = None,
        stderr: int | None = None,
    ) -> ChildProcess:
        """Start ``argv`` in a new session with stdin from /dev/null and stdout+stderr to ``stdout``.

        This forks and executes at once (milliseconds), as asyncio's own
        subprocess functions do. ``stdin`` and ``stderr``, when given, replace
        /dev/null and ``stdout``.

        Raises:
            OSError: The program cannot be started, or pidfds are unavailable (Linux < 5.4;
                the child is then killed and reaped).
        """
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL if stdin is None else stdin,
            stdout=stdout,
            stderr=subprocess.STDOUT if stderr is None else stderr,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
        try:
            # Safe: nobody has reaped the child yet (we never let Popen wait), so the PID is still it.
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
            raise OSError(exc.errno, f"pidfd_open failed ({exc}); Linux 5.4 or newer is needed") from exc
        started_children.add(popen.pid)
        return cls(popen, pidfd)

    @property
    def pid(self) -> int:
        """The child's PID (also its process group and session id)."""
        return self._popen.pid

    @property
    def status(self) -> ExitStatus | None:
        """How it ended, once :meth:`wait` or :meth:`poll` has seen it end; ``None`` before."""
        return self._status

    def poll(self) -> ExitStatus | None:
        """How it ended, if it has (read without reaping it); ``None`` while it runs."""
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
            status = self.poll()
            if status is not None:
                return status
            if self._pidfd is None:
                raise RuntimeError("the child was released before it exited")
            await wait_readable(self._pidfd)

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the child's whole process group; ``False`` if the group is empty or released."""
        if self._pidfd is None:
            return False
        return signal_group(self.pid, sig)

    def abandon(self) -> None:
        """SIGKILL the child's group and let go of it (for one started after its caller gave up)."""
        self.signal_group(signal.SIGKILL)
        self.release()

    def kill_alone(self) -> ExitStatus | None:
        """SIGKILL the child alone (through its pidfd, not its group), wait for it to end, reap it, let go.

        For a fork server: what it forked may still share its group on the way to a session of its
        own, and must not die with it. Blocking, briefly: SIGKILL ends even a stopped process.
        """
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOWAIT)  # ended, still unreaped
        return self.release()

    def release(self) -> ExitStatus | None:
        """Reap the child (if it exited) and close the pidfd; after this the PID is no longer ours."""
        status = self.poll()
        if self._pidfd is not None:
            if status is not None:
                with contextlib.suppress(ChildProcessError):
                    os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
                # Tell Popen the child is gone, so it never waits on a PID that may be someone else's.
                self._popen.returncode = 0 if status.returncode is None else status.returncode
            os.close(self._pidfd)
            self._pidfd = None
            started_children.discard(self.pid)
        return status
