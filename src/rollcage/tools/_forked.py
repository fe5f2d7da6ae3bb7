"""Executors forked by the executor template (:mod:`rollcage.tools._executor_template`) instead of started.

Two sides:

* in the warm worker template (:mod:`rollcage.warm`), :class:`TemplateLink` starts the executor
  template beside it (once, lazily) and, for each warm worker, hands the executor template
  the rollout's ids, limits and ``cgroup.procs`` files with one end of a socket pair
  (:class:`~rollcage.forkserver.ExecutorClient`); the worker is forked holding the other end
  (:func:`adopt`);
* in the worker, :func:`start` makes the executor's cage as before (the nested bubblewrap of
  :mod:`rollcage.cage._nested`) but around a holder (``sh``, a process start of a few hundred
  microseconds), asks for the executor through that socket
  (:class:`~rollcage.forkserver.ExecutorStart`, answered by the codec of :mod:`rollcage.forkserver`),
  and returns a
  :class:`ForkedExecutor` that looks as the started process did (``pid``, ``returncode``,
  ``wait()``). Where nothing can be forked (no template, a cold start, an environment that
  differs in what an interpreter reads at start-up, a template that died), it returns
  ``None`` and the executor is started as before.

Where the executor stands, compared with a started one: the same namespaces (it joins the
holder's: the nested cage's user, mount, PID, network, IPC, UTS and cgroup namespaces), the
same uid, no capability, ``no_new_privs``, the worker's limits, umask and cgroups, its own
session, SIGINT held until its handler is set, the same environment, working directory and
command line (``/proc/PID/cmdline`` and ``environ`` restated). Its parent is the executor
template (outside the cage: ``getppid()`` is 0 there instead of bubblewrap's init), and every
executor of one template has the template's string-hash seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import struct
import sys
import termios
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from rollcage.cage import Limits
from rollcage.forkserver import (
    ExecutorClient,
    ExecutorStart,
    ExecutorStarted,
    Exited,
    Refused,
    WireError,
    receive,
    send,
)
from rollcage.procs import (
    PidfdChild,
    PidHandle,
    ProcInfo,
    argv_has,
    pidfd_pid,
    read_proc,
    receive_message,
    shielded,
    signal_group,
    wait_readable,
    wait_shared,
)

__all__ = ["ForkedExecutor", "TemplateLink", "adopt", "spawn", "start"]

log = logging.getLogger(__name__)

PROGRAM = Path(__file__).with_name("_executor_template.py")
"""The executor template's program, run by path (it imports nothing of ``rollcage``)."""
STARTUP_ENV = ("HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONUSERBASE", "TZ")
"""What an interpreter reads from its environment once, at start-up: the executor template starts with the
first worker's (the program refuses a request that differs in these or in any it was started with)."""
HOLDER = (
    "printf r; exec >/dev/null; exec 3<&0; "
    'while :; do read _ <&3 & wait "$!"; [ "$?" -lt 128 ] && exit 0; done'
)
"""The nested cage's payload while the executor is forked into it, as its PID 1 (``--as-pid-1``): says
it is there (one byte, whose sender's PID the worker learns), then waits for the end of its stdin (the
worker's) with a background ``read``, which a killed ``read`` does not end. As PID 1 no signal from
inside the cage reaches it (agent code that kills every process it sees kills only itself), and
``wait`` reaps every orphan the cells leave, as bubblewrap's own init would."""
HOLDER_NAME = "rollcage-executor-cage"
"""The holder's ``$0``: how the worker knows it from another process that took its PID."""
MAX_STARTS = 8
"""Executor templates one warm template starts at most (one that dies is started again, up to this)."""
_REAP_WAIT_S = 10.0
"""How long the executor's cage is waited for once it is killed (the kernel takes it at once)."""
_EXIT_WAIT_S = 1.0
"""How long the exit code is waited for once the executor is gone (the template sends it at once)."""
ANSWER_S = 5.0
"""How long a worker waits for the executor template's answer to one start (it forks at once): one
that says nothing so long is hung (stopped, deadlocked), and the worker starts its executors itself
from then on, as where there is no template. A cell's time is the agent's; a hung helper's is not."""
HUNG_S = 15.0
"""How long a worker's hand-over to the executor template may stay unread (it reads each at once)
before the warm template takes the executor template for hung: it is killed and another started."""


class TemplateLink:
    """The warm worker template's side: the executor template, started with the first worker's start-up
    environment (see :data:`STARTUP_ENV`)."""

    def __init__(self) -> None:
        self._control: socket.socket | None = None
        self._process: PidfdChild | None = None
        self._starts = 0
        self._unread_since: float | None = None
        """When the oldest hand-over the executor template has not read yet was sent (``None``: none)."""

    def attach(
        self,
        *,
        uid: int,
        gid: int,
        limits: Limits,
        umask: int,
        cgroups: Sequence[str],
        env: Mapping[str, str],
        userns: bool = False,
    ) -> int:
        """A socket for the worker about to be forked (its descriptor, the caller's to close), or -1.

        -1 where the executor template cannot be started or reached: the worker starts its
        executors itself. ``userns``: the worker's supervisor is not root
        (:attr:`~rollcage.forkserver.ExecutorClient.userns`).
        """
        control = self._ensure(env)
        if control is None:
            return -1
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        opened: list[int] = []
        try:
            for path in cgroups:
                opened.append(os.open(path, os.O_WRONLY | os.O_CLOEXEC))
            rlimits = [[which, value] for which, value in limits.rlimits()]
            client = ExecutorClient(
                uid=uid, gid=gid, umask=umask, limits=rlimits, cgroups=len(opened), userns=userns
            )
            send(control, client, [theirs.fileno(), *opened], socket.MSG_DONTWAIT)
            if self._unread_since is None:
                self._unread_since = time.monotonic()
        except OSError as exc:
            log.warning("cannot reach the executor template (%s): this worker starts its executors", exc)
            ours.close()
            self.stop()
            return -1
        finally:
            theirs.close()
            for fd in opened:
                os.close(fd)
        return ours.detach()

    def _ensure(self, env: Mapping[str, str]) -> socket.socket | None:
        if self._control is not None and self._process is not None and self._process.exited() is None:
            if not self._hung(self._control):
                return self._control
            log.warning(
                "the executor template (PID %d) has not read a worker's hand-over in %g s (hung): "
                "it is killed and another started",
                self._process.pid,
                HUNG_S,
            )
        self.stop()
        if self._starts >= MAX_STARTS:
            return None  # one that keeps dying would cost every worker an interpreter's start, and more
        self._starts += 1
        if self._starts == MAX_STARTS:
            log.warning("executor template: start %d, the last; then workers start executors", MAX_STARTS)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-I", "-u", str(PROGRAM), str(theirs.fileno()), str(os.getpid())]
        environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        environment.update({name: env[name] for name in STARTUP_ENV if name in env})
        try:
            theirs.set_inheritable(True)
            pid = spawn(argv, environment)
        except OSError as exc:
            log.warning("cannot start the executor template: %s", exc)
            ours.close()
            return None
        finally:
            theirs.close()
        self._process = PidfdChild.of_child(pid)
        if self._process is None:
            ours.close()
            return None
        self._control = ours
        return ours

    def _hung(self, control: socket.socket) -> bool:
        """Whether the executor template has left a hand-over unread for :data:`HUNG_S` (a live one reads
        each at once: what it has not read is still charged to this end of the socket)."""
        try:
            unread = struct.unpack("i", fcntl.ioctl(control.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            return False
        if unread == 0:
            self._unread_since = None
            return False
        return self._unread_since is not None and time.monotonic() - self._unread_since > HUNG_S

    def stop(self) -> None:
        """Stop the executor template (its executors live on; a later :meth:`attach` starts another).

        A stopped (``SIGSTOP``) one is killed all the same."""
        self._unread_since = None
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._process is not None:
            self._process.kill()
            self._process.reap()
            self._process = None


def spawn(argv: list[str], env: Mapping[str, str]) -> int:
    """Start ``argv`` (its program named in full) with ``env`` as this process's child; its PID.

    Fork and exec, not ``posix_spawn``: glibc leaves a ``posix_spawn``'s child with its two internal
    signals (32 and 33) ignored until the exec, which keeps them so; the executor template would
    pass them on to every executor it forks, which a started one has at their default. The
    caller is single-threaded (the warm template): the fork copies one thread and execs at once.

    Raises:
        OSError: The fork failed (an exec that fails is a child that exits with 127).
    """
    pid = os.fork()
    if pid == 0:
        try:
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    return pid


_channel: socket.socket | None = None


def adopt(fd: int) -> None:
    """In a forked worker: ``fd`` is its socket to the executor template (:meth:`TemplateLink.attach`)."""
    global _channel
    _channel = socket.socket(fileno=fd)
    _channel.setblocking(False)


class ForkedExecutor:
    """A forked executor, as the worker sees it: what it needs of an ``asyncio.subprocess.Process``.

    It ends with its cage: once it has exited, the holder (and so the nested PID namespace,
    with whatever the cells left in it) is killed.
    """

    def __init__(
        self, pid: int, pidfd: int, holder: asyncio.subprocess.Process, channel: socket.socket
    ) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = pidfd
        self._holder = holder
        self._channel = channel
        self._ended: asyncio.Future[int] | None = None

    async def wait(self) -> int:
        """Wait for the executor's exit, then its cage's; its exit code (as ``Process.wait``).

        **Cancellation:** only the wait is abandoned.
        """
        if self._ended is None:
            self._ended = asyncio.ensure_future(self._end())
        return await wait_shared(self._ended)

    async def _end(self) -> int:
        try:
            await wait_readable(self._pidfd)
            code = await _exit_code(self._channel)
        finally:
            os.close(self._pidfd)
            await _end_holder(self._holder)
        if code is None:
            log.warning("the executor template did not say how executor %d ended", self.pid)
            code = 255
        self.returncode = code
        return code


_REPLIES = (ExecutorStarted, Refused, Exited)
"""What the executor template says to a worker."""


async def _exit_code(channel: socket.socket) -> int | None:
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(_EXIT_WAIT_S):
            while True:
                got = await receive(channel, _REPLIES)
                for fd in got.fds:
                    os.close(fd)
                if got.ended:
                    return None
                if isinstance(got.message, Exited):
                    return got.message.code
    return None


async def _end_holder(holder: asyncio.subprocess.Process) -> None:
    # Its group: bubblewrap's monitor and the holder, the cage's PID 1 (its `read` beside it); with
    # PID 1 goes whatever a cell left running in the cage's PID namespace.
    if holder.returncode is None:
        signal_group(holder.pid, signal.SIGKILL)
    try:
        async with asyncio.timeout(_REAP_WAIT_S):
            await holder.wait()
    except TimeoutError:
        log.error("the executor's cage (bwrap %d) outlived SIGKILL for %g s", holder.pid, _REAP_WAIT_S)


async def start(
    prefix: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    boot: str,
    argv: Sequence[str],
    control: int,
    stdout: int,
    stderr: int,
    answer_s: float = ANSWER_S,
) -> ForkedExecutor | None:
    """Make the executor's cage around a holder and have the executor forked into it; ``None``: start it.

    Args:
        prefix: The nested cage's command line (:meth:`rollcage.cage.NestedCage.prefix`, without ``sh``).
        cwd: The executor's working directory.
        env: Its environment.
        boot: Its ``-c`` program.
        argv: The command line it shows (that of a started executor).
        control: Its control socket; ``stdout``, ``stderr``: its output pipes (the holder's stderr too,
            where bubblewrap says why a cage could not be made).
        answer_s: How long the executor template may take to answer (see :data:`ANSWER_S`): one
            that does not is hung, and this worker starts its executors itself from then on.

    The caller holds SIGINT blocked (as for a started executor) and bounds the wait.

    **Cancellation:** the holder is killed and reaped (shielded) before ``CancelledError`` propagates.
    """
    channel = _channel
    if channel is None or channel.fileno() < 0 or not prefix or not prefix[0].endswith("bwrap"):
        return None
    ready, theirs = socket.socketpair()
    ready.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    try:
        holder = await asyncio.create_subprocess_exec(
            prefix[0],
            "--as-pid-1",
            *prefix[1:],
            "/bin/sh",
            "-c",
            HOLDER,
            HOLDER_NAME,
            stdin=asyncio.subprocess.PIPE,
            stdout=theirs.fileno(),
            stderr=stderr,
            cwd=cwd,
            env=dict(env),
            start_new_session=True,
        )
    finally:
        theirs.close()
    forked: ForkedExecutor | None = None
    try:
        ready.setblocking(False)
        word, _, sender = await receive_message(ready, 16, credentials=True)
        if word != b"r" or sender <= 0:
            return None  # the cage was not made: its holder's exit and bubblewrap's words say why
        fds = (control, stdout, stderr)
        forked = await _ask(channel, holder, sender, cwd, env, boot, argv, fds, answer_s)
        return forked
    finally:
        ready.close()
        if forked is None:
            await shielded(_end_holder(holder))


async def _ask(
    channel: socket.socket,
    holder: asyncio.subprocess.Process,
    sender: int,
    cwd: str,
    env: Mapping[str, str],
    boot: str,
    argv: Sequence[str],
    fds: tuple[int, int, int],
    answer_s: float,
) -> ForkedExecutor | None:
    global _channel
    info = read_proc(sender)
    # The process that said it is there, still: the holder (a PID reused meanwhile is refused).
    handle = None if info is None else PidHandle.open_checked(info, lambda pid: _is_holder(pid, info))
    if handle is None:
        return None
    request = ExecutorStart(cwd=cwd, env=dict(env), boot=boot, argv=list(argv))
    try:
        send(channel, request, [handle.fd, *fds], socket.MSG_DONTWAIT)
        async with asyncio.timeout(answer_s):
            while True:
                got = await receive(channel, _REPLIES)
                if not isinstance(got.message, Exited):  # a previous executor's, if its end was not awaited
                    break
    except TimeoutError:
        # Hung: its answer may still come, and a later start would take it for its own. Not the
        # agent's to pay for: this executor, and this worker's next ones, are started instead.
        log.warning(
            "the executor template did not answer in %g s (hung): executors are started from here on",
            answer_s,
        )
        _channel = None
        return None
    except (OSError, WireError) as exc:
        log.warning("the executor template cannot be reached (%s): executors are started from here on", exc)
        _channel = None
        return None
    except BaseException:
        # Cancelled (the start's time ran out) with the answer still to come: a later start would
        # take it for its own. This worker asks no more.
        _channel = None
        raise
    finally:
        handle.close()
    if not isinstance(got.message, ExecutorStarted):
        refused = got.message if isinstance(got.message, Refused) else None
        why = f"refused {refused.reason}" if refused is not None else str(got.error or "it is gone")
        if refused is None or refused.final:
            # Gone, or speaking no reply of the codec's, or every later start would be refused too (this
            # worker's environment will differ every time, or the kernel refuses the entry): a cage made
            # for nothing before each started executor would cost more than the fork saves.
            _channel = None
            log.info("the executor template did not fork an executor (%s): this worker starts its own", why)
        else:
            log.info("the executor template did not fork an executor (%s): one is started", why)
        return None
    executor = got.fds[0]
    pid = pidfd_pid(executor)
    if pid <= 0:
        os.close(executor)
        return None
    return ForkedExecutor(pid, executor, holder, channel)


def _is_holder(pid: int, info: ProcInfo) -> bool:
    now = read_proc(pid)
    return now is not None and now.starttime == info.starttime and argv_has(pid, HOLDER_NAME)
