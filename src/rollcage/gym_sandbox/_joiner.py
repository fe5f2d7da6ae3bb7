"""The provider's side of its joiner (:mod:`rollcage.gym_sandbox._joinserver`): one per provider.

:class:`Joiner` starts the joiner on first use, hands it each command's start
(:class:`~rollcage.forkserver.CommandStart`), and gives back the command as a
:class:`~rollcage.procs.PidfdChild` of this process (the joiner forks it as its parent's child), with
whether it took its place in the cage. A joiner that is gone (killed, or its starting thread ended)
is started again once; one that cannot be started, or a start it does not answer, is an
:class:`JoinerUnavailable` and the caller takes the slow path (a fresh interpreter per command).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollcage.errors import SandboxError
from rollcage.forkserver import CommandStart, EnterFailed, Forked, Unforked, WireError, receive, send
from rollcage.procs import PidfdChild, shielded, within

__all__ = ["Joiner", "JoinerUnavailable", "Started"]

_SERVER: Final = str(Path(__file__).with_name("_joinserver.py"))
_ANSWER_S: Final = 30.0
"""How long a start waits for the joiner's answer (a fork: milliseconds, on a loaded machine more)."""
_STOP_S: Final = 10.0
_CONTROL_FD: Final = 3
"""Where the joiner finds its control socket (so every descriptor it receives is numbered above 3)."""


class JoinerUnavailable(SandboxError):
    """The joiner could not be started or did not answer: the command was not started (take the slow path)."""


@dataclass
class Started:
    """A command the joiner forked into a cage.

    Attributes:
        child: The command, this process's child (wait, kill and reap it through its pidfd).
        status: The start's reply socket (non-blocking): its end of file says the command executed,
            an :class:`~rollcage.forkserver.EnterFailed` that it could not take its place.
    """

    child: PidfdChild
    status: socket.socket

    async def entered(self) -> str | None:
        """``None`` once the command executed; or why it could not take its place in the cage.

        **Cancellation:** nothing happens to the command.
        """
        got = await receive(self.status, [EnterFailed])
        if got.ended:
            return None
        for fd in got.fds:
            os.close(fd)
        if isinstance(got.message, EnterFailed):
            return got.message.reason
        return f"the command's start said something else: {got.error}"


class Joiner:
    """One provider's joiner: started on first use, stopped by :meth:`close` (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._control: socket.socket | None = None
        self._server: PidfdChild | None = None
        self.closed = False

    @property
    def pid(self) -> int | None:
        """The joiner's PID while one runs (for tests and logs)."""
        return None if self._server is None or self._server.reaped else self._server.pid

    def _spawn(self) -> None:
        """Start the joiner (from the calling thread: its death would end the joiner, which is then
        started again on the next command)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.posix_spawn(
                sys.executable,
                [sys.executable, "-I", "-S", _SERVER, str(_CONTROL_FD), str(os.getpid())],
                {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_DUP2, theirs.fileno(), _CONTROL_FD),
                ],
                setsid=True,
            )
        finally:
            theirs.close()
        server = PidfdChild.of_child(pid)
        if server is None:
            ours.close()
            raise JoinerUnavailable("the sandbox joiner ended as soon as it was started")
        self._control, self._server = ours, server

    def _request(self, message: CommandStart, fds: list[int]) -> None:
        with self._lock:
            if self.closed:
                raise JoinerUnavailable("the sandbox joiner is closed")
            for attempt in (1, 2):
                if self._control is None:
                    self._spawn()
                assert self._control is not None
                try:
                    send(self._control, message, fds)
                    return
                except (BrokenPipeError, ConnectionError) as exc:
                    self._drop()
                    if attempt == 2:
                        raise JoinerUnavailable(f"the sandbox joiner is gone: {exc}") from exc
                except (OSError, WireError) as exc:
                    raise JoinerUnavailable(f"cannot hand the command to the sandbox joiner: {exc}") from exc

    def _drop(self) -> None:
        """Forget a joiner that is gone (reaped now, or later by :func:`rollcage.procs.reap_abandoned`)."""
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._server is not None:
            self._server.abandon()
            self._server = None

    async def start(
        self,
        holder: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str,
        uid: tuple[int, int],
        cgroups: Sequence[str],
        stdio: tuple[int, int, int],
        tty: bool = False,
    ) -> Started:
        """Fork ``argv`` into the cage of the holder whose pidfd is ``holder``, with ``stdio`` as its 0, 1, 2.

        With ``tty``, ``stdio[0]`` is a terminal's slave, made the command's controlling terminal.

        The descriptors stay the caller's (the joiner has copies, closed once it forked).

        Raises:
            JoinerUnavailable: The joiner could not be started, or did not answer; nothing was started.
            SandboxError: The joiner could not fork the command there (its words).

        **Cancellation:** nothing is waited for; a command the joiner forks all the same runs until its
        sandbox closes (which kills everything in the sandbox's cgroups).
        """
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setblocking(False)
        try:
            message = CommandStart(
                argv=list(argv),
                env=dict(env),
                cwd=cwd,
                uid=uid[0],
                gid=uid[1],
                cgroups=list(cgroups),
                tty=tty,
            )
            try:
                self._request(message, [holder, theirs.fileno(), *stdio])
            finally:
                theirs.close()
            got = await within(receive(ours, [Forked, Unforked]), _ANSWER_S)
        except BaseException:
            ours.close()
            raise
        if got is not None and isinstance(got.message, Forked) and len(got.fds) == 1:
            child = PidfdChild(got.message.pid, got.fds[0])
            return Started(child, ours)
        ours.close()
        if got is not None:
            for fd in got.fds:
                os.close(fd)
        if got is not None and isinstance(got.message, Unforked):
            raise SandboxError(f"the sandbox joiner could not start the command: {got.message.reason}")
        why = "no answer" if got is None else got.error or "its end of file"
        raise JoinerUnavailable(f"the sandbox joiner did not start the command ({why})")

    async def close(self) -> None:
        """Stop the joiner (its end of file) and reap it; idempotent.

        **Cancellation:** the joiner is killed and left to :func:`rollcage.procs.reap_abandoned`.
        """
        with self._lock:
            self.closed = True
            server, self._server = self._server, None
            if self._control is not None:
                self._control.close()
                self._control = None
        if server is None:
            return

        async def reap() -> None:
            await within(server.wait(), _STOP_S)
            if server.exited() is None:
                server.kill()
                await within(server.wait(), _STOP_S)
            if server.reap() is None and not server.reaped:
                server.abandon()

        await shielded(reap(), on_cancel=server.abandon)
