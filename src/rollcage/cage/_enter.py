"""Entering a cage bubblewrap made: the system calls a warm worker uses to become what bwrap's payload is.

A cage's namespaces, mounts and cgroups are made by bubblewrap exactly as for a
cold start (:func:`~rollcage.cage.cage_argv`); its payload is then only a holder
(:data:`HOLDER_SCRIPT`). A warm worker is a fork of a pre-imported template that
joins the holder's namespaces (``setns`` through a pidfd, all at once) and then
takes away from itself everything bubblewrap, ``setpriv`` and ``prlimit`` would
have: supplementary groups, capabilities (bounding, ambient, permitted,
effective, inheritable), the uid and gid, the right to gain privileges, the resource limits,
every inherited descriptor. What is left is the process a cold start would have
run, with the interpreter already warm.

Nothing here is called by the supervisor's own process: these calls change the
caller for good and are made only in the template's children.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Mapping

__all__ = [
    "HOLDER_SCRIPT",
    "JOIN",
    "PID_NS",
    "PR_SET_PDEATHSIG",
    "EntryFailed",
    "clone_child",
    "clone_sibling",
    "drop_privileges",
    "fork_into",
    "prctl",
    "setns",
    "show_process",
]

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

JOIN = (
    CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP
)
"""The holder's namespaces, joined at once by a warm worker, born in the cage's PID namespace, before it
runs anything (the PID namespace, already its own, takes effect for its children). At once, and while
the caller still holds the capabilities
it came with: bubblewrap nests a second user namespace to set the cage's uid, so the cage's cgroup
namespace belongs to the outer one, over which the holder's own user namespace gives none."""

MOUNT_NS = CLONE_NEWNS
"""The cage's mount namespace alone: a warm worker joins it first, to mount the cage's bounded
``/tmp`` and ``/dev/shm`` as the host's root (the mount namespace belongs to bubblewrap's outer user
namespace, over which the cage's own gives no capability either), then the rest of :data:`JOIN`."""

PID_NS = CLONE_NEWPID
"""The PID namespace alone: the template joins the cage's for its next child (the worker is born
there, its init's to kill with the rest), then goes back to its own."""

PR_SET_PDEATHSIG = 1
PR_SET_MM = 35
PR_SET_MM_MAP = 14
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

HOLDER_SCRIPT = (
    # The cage's stand-in for the worker: it tells the supervisor it is there (one byte on stdout,
    # a socket whose receiver learns its PID), lets go of that socket, then waits for the worker's
    # exit code on stdin (written by the worker's parent outside) and exits with it once that
    # parent is gone too (end of file), so bwrap reports the worker's status as for a cold start
    # and nothing of the rollout outlives the sandbox. Polite signals are for the worker, not for
    # it; 125: the worker's parent went away without a word (it could not be started).
    "trap '' HUP INT QUIT TERM USR1 USR2; printf r; exec >/dev/null; "
    "IFS= read -r code || code=125; "
    "while IFS= read -r _; do :; done; "
    'case $code in ""|*[!0-9]*) code=125;; esac; '
    'exit "$code"'
)
"""The holder: the payload of a cage a warm worker enters (run by ``/bin/sh -c``)."""

_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


_libc = ctypes.CDLL(None, use_errno=True)
# clone3 is called holding the GIL, between the interpreter's own fork hooks (PyOS_BeforeFork and
# PyOS_AfterFork_*), as os.fork() calls fork(): a CDLL call would release the GIL around it.
_python = ctypes.PyDLL(None, use_errno=True)
_python.syscall.restype = ctypes.c_long
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_libc.capset.argtypes = (ctypes.POINTER(_CapHeader), ctypes.POINTER(_CapData))
_libc.sbrk.argtypes = (ctypes.c_long,)
_libc.sbrk.restype = ctypes.c_void_p


def setns(fd: int, flags: int) -> None:
    """Join the namespaces ``flags`` of the process the pidfd ``fd`` names (single-threaded callers only).

    Raises:
        OSError: The kernel refused.
    """
    if _libc.setns(fd, flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"setns({flags:#x}) failed: {os.strerror(code)}")


CLONE_PIDFD = 0x00001000
_SIGCHLD: int = sys.modules["_signal"].SIGCHLD
"""``signal.SIGCHLD`` from the built-in module every interpreter loads at start-up: the executor template
(which loads this file by path) does not import ``signal``."""
CLONE_PARENT = 0x00008000
_SYS_CLONE3 = 435  # the same number on every architecture (Linux 5.3's unified table)


class _CloneArgs(ctypes.Structure):
    _fields_ = tuple(
        (name, ctypes.c_uint64)
        for name in ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal", "stack", "stack_size", "tls")
    )


def clone_sibling() -> tuple[int, int]:
    """Fork this process as its own parent's child (``clone3`` with ``CLONE_PARENT | CLONE_PIDFD``).

    The child is born where this process's next child would be (a PID namespace joined with
    :func:`setns` and :data:`PID_NS`), and its exit is reported to this process's parent, which
    reaps it: this process has nothing to wait for. Single-threaded callers only (as ``fork``).

    Returns:
        ``(pid, pidfd)`` in the caller: the child's PID and a pidfd of it (the caller's to close,
        or to hand to the parent); ``(0, -1)`` in the child.

    Raises:
        OSError: The kernel refused (before Linux 5.3: ``ENOSYS``).
    """
    # exit_signal stays 0: with CLONE_PARENT the kernel takes this process's own.
    return _clone3(CLONE_PARENT | CLONE_PIDFD, 0)


class EntryFailed(OSError):
    """A step of :func:`fork_into` failed (an ``OSError``, with the failed call's ``errno``).

    Attributes:
        step: What could not be done, in words ("join the sandbox's namespaces").
        refused: The kernel said no to the entry itself (``setns``, ``chroot`` or the fork there,
            with a permission or support error: no user namespace to join, a seccomp filter), not
            a lack of memory or processes: a later entry would be refused too.
    """

    def __init__(self, step: str, cause: BaseException, *, refused: bool) -> None:
        code = cause.errno if isinstance(cause, OSError) else None
        super().__init__(code, f"cannot {step}: {cause}")
        self.step = step
        self.refused = refused

    def __str__(self) -> str:
        return str(self.strerror)  # "cannot STEP: CAUSE", without OSError's "[Errno N]" before it


_KERNEL_REFUSALS = frozenset({errno.EPERM, errno.EACCES, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
"""How the kernel says no to a step of :func:`fork_into` (not a lack of memory or processes, which passes)."""


def fork_into(holder: int, *, cage: str, child: str) -> tuple[int, int]:
    """Join every namespace of the holder the pidfd ``holder`` names at once, take its root, and fork
    ``child`` there as this process's parent's child (:func:`clone_sibling`): the go-between's entry.

    For a caller that is not root but whose uid owns the cage's user namespaces (bubblewrap made
    them unprivileged): it holds every capability in them, so it may join the holder's user
    namespace with the rest at once (one ``setns`` on the pidfd), as root may, but not the PID
    namespace alone, and it can never come back. So only a throwaway fork (a go-between) calls
    this: the PID namespace takes effect for its child, born in the cage as a process bubblewrap
    started would be. The holder's root is taken as the holder sees it (``/proc/PID/root``:
    bubblewrap's pivoted root), opened before the mount namespace changes.

    Args:
        holder: A pidfd of the cage's holder.
        cage: The cage in words, for :attr:`EntryFailed.step` ("sandbox", "executor's cage").
        child: The child in words ("the worker").

    Returns:
        ``(pid, pidfd)`` of the child, in the caller (the PID in the caller's own PID namespace,
        not the cage's); ``(0, -1)`` in the child.

    Raises:
        EntryFailed: A step failed; the caller stands where it failed (exit).
    """
    step = "open the holder's root"
    entering = False
    try:
        with open(f"/proc/self/fdinfo/{holder}", "rb") as info:
            pid = next(int(line.split()[1]) for line in info if line.startswith(b"Pid:"))
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        entering = True
        step = f"join the {cage}'s namespaces"
        setns(holder, JOIN)
        step = f"take the {cage}'s root"
        os.fchdir(root)
        os.chroot(".")
        os.close(root)
        step = f"fork {child} in the {cage}"
        return clone_sibling()
    except (OSError, StopIteration, ValueError, IndexError) as exc:
        refused = entering and isinstance(exc, OSError) and exc.errno in _KERNEL_REFUSALS
        raise EntryFailed(step, exc, refused=refused) from exc


def clone_child() -> tuple[int, int]:
    """Fork this process, as ``os.fork`` does, with a pidfd of the child (``clone3`` with ``CLONE_PIDFD``).

    The child is born where this process's next child would be; its exit is this process's to
    reap (``SIGCHLD``). Single-threaded callers only (as ``fork``).

    Returns:
        ``(pid, pidfd)`` in the caller (the pidfd is the caller's to close); ``(0, -1)`` in the child.

    Raises:
        OSError: The kernel refused (before Linux 5.3: ``ENOSYS``).
    """
    return _clone3(CLONE_PIDFD, _SIGCHLD)


def _clone3(flags: int, exit_signal: int) -> tuple[int, int]:
    pidfd = ctypes.c_int(-1)
    args = _CloneArgs(flags=flags, pidfd=ctypes.addressof(pidfd), exit_signal=exit_signal)
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = _python.syscall(ctypes.c_long(_SYS_CLONE3), ctypes.byref(args), ctypes.c_long(ctypes.sizeof(args)))
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
        return 0, -1
    code = ctypes.get_errno()
    ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(code, f"clone3 failed: {os.strerror(code)}")
    return int(pid), pidfd.value


def prctl(option: int, arg2: int = 0, arg3: int = 0) -> int:
    """``prctl(option, arg2, arg3, 0, 0)``.

    Raises:
        OSError: The kernel refused.
    """
    result = int(_libc.prctl(option, arg2, arg3, 0, 0))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl({option}) failed: {os.strerror(code)}")
    return result


class _MmMap(ctypes.Structure):
    """``struct prctl_mm_map`` (linux/prctl.h)."""

    _fields_ = (
        *(
            (name, ctypes.c_uint64)
            for name in (
                "start_code",
                "end_code",
                "start_data",
                "end_data",
                "start_brk",
                "brk",
                "start_stack",
                "arg_start",
                "arg_end",
                "env_start",
                "env_end",
                "auxv",
            )
        ),
        ("auxv_size", ctypes.c_uint32),
        ("exe_fd", ctypes.c_uint32),
    )


_blocks: list[ctypes.Array[ctypes.c_char]] = []


def _block(words: list[str]) -> tuple[int, int]:
    """A NUL-separated block that lives as long as the process: its (start, end) addresses."""
    data = b"".join(word.encode() + b"\0" for word in words)
    block = ctypes.create_string_buffer(data)
    _blocks.append(block)
    start = ctypes.addressof(block)
    return start, start + len(data)


def show_process(argv: list[str], env: Mapping[str, str]) -> None:
    """Make ``/proc/<pid>/cmdline`` and ``environ`` of this process, and of the children it forks, show these.

    A forked process shows its template's command line and environment there,
    whatever ``sys.argv`` and ``os.environ`` say; the supervisor knows a rollout's
    processes by the token in their environment, and people by their command line.
    The whole memory map is restated with only those two places changed
    (``PR_SET_MM_MAP``, which needs no capability).

    Raises:
        OSError: The kernel refused.
    """
    arg_start, arg_end = _block(argv)
    env_start, env_end = _block([f"{name}={value}" for name, value in env.items()])
    with open("/proc/self/stat", "rb") as file:
        # Fields after the command's closing parenthesis, numbered as in proc(5) from 3.
        fields = file.read().rsplit(b")", 1)[1].split()

    def field(number: int) -> int:
        return int(fields[number - 3])

    mm = _MmMap(
        start_code=field(26),
        end_code=field(27),
        start_data=field(45),
        end_data=field(46),
        start_brk=field(47),
        brk=_libc.sbrk(0) or 0,
        start_stack=field(28),
        arg_start=arg_start,
        arg_end=arg_end,
        env_start=env_start,
        env_end=env_end,
        auxv=0,
        auxv_size=0,
        exe_fd=0xFFFFFFFF,  # unchanged
    )
    result = int(_libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_MM_MAP) failed: {os.strerror(code)}")


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` (ids of the current user namespace) with no capability and no way to gain one.

    In order: the bounding set emptied and the ambient set cleared (which needs
    ``CAP_SETPCAP``, so before the uid changes), then the gid and uid, then the
    effective, permitted and inheritable sets emptied, then ``no_new_privs``. The
    sets are emptied by hand: the kernel clears them on a change away from the
    namespace's uid 0, and a process that joined a user namespace is not its uid 0
    (it keeps the host uid, unmapped there). Checked after: a process that still
    holds a capability refuses to go on.

    Raises:
        OSError: A step failed, or a capability is left.
    """
    cap = 0
    while True:
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # past the kernel's last capability
                break
            raise
        cap += 1
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    empty = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), empty) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"capset failed: {os.strerror(code)}")
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    # Bytes, not text: a codec looked up here is imported in every warm worker (~1 ms of CPU each;
    # a forked worker imports what its template had not).
    with open("/proc/self/status", "rb") as status:
        for line in status:
            name, _, value = line.partition(b":")
            if name in (b"CapInh", b"CapPrm", b"CapEff", b"CapBnd", b"CapAmb") and int(value, 16) != 0:
                left = line.strip().decode("latin-1")
                raise OSError(errno.EPERM, f"a capability is left after dropping privileges: {left}")
