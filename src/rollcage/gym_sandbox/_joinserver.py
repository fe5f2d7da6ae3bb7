"""The joiner: a fork server that forks each sandbox command into its sandbox's cage.

Run by :class:`rollcage.gym_sandbox._joiner.Joiner` as ``python -I -S THIS_FILE CTL PARENT``, once
per provider, as root (the provider's own user). A command then costs a fork of this small process,
not a fresh interpreter that loads :mod:`rollcage.cage._enter` (most of an exec's time before).

It is a :class:`rollcage.forkserver.ForkServer` and speaks its codec (:mod:`rollcage.forkserver._wire`,
loaded by path as the loop and the cage's system calls are: this process imports nothing of the
``rollcage`` package, nor anything outside the standard library). On ``CTL``, from the provider,
once per command: :class:`~rollcage.forkserver.CommandStart` with a pidfd of the sandbox's holder,
a reply socket, and the command's stdin, stdout and stderr. It joins the holder's PID namespace for
one fork and forks the command there as its parent's child (``clone_sibling``: the provider waits
on it and reaps it through the pidfd it is handed; this process reaps nothing), answers
:class:`~rollcage.forkserver.Forked` with that pidfd (or :class:`~rollcage.forkserver.Unforked`
and why), and closes its copies of every descriptor. The fork, born in the cage's PID namespace:

* moves itself into the sandbox's cgroups (host paths, before it leaves the host's mount namespace),
* clears its supplementary groups and joins all the holder's namespaces at once (as root: every
  capability over the cage's user namespace, until it gives them up),
* leads a session of its own (the provider's time bound kills that group), takes its stdio and
  working directory, closes every other descriptor,
* gives up every capability and the uid (:func:`rollcage.cage.drop_privileges`), and executes the
  command. The reply socket is closed by that execution (close-on-exec): its end of file tells the
  provider the command took its place; a step that failed is told there instead
  (:class:`~rollcage.forkserver.EnterFailed`) and the fork exits 125.

The joiner stays outside every cage: a command cannot see it (another PID namespace) nor signal it
(another uid, no capability). It exits when the provider closes ``CTL`` or dies (its end of file, and
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import termios

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Loaded at start-up; ``import signal`` would import enum.
_signal: Any = sys.modules["_signal"]

__all__ = ["main"]

ENTER_FAILED = 125
"""The fork's exit status when it could not take the command's place (as the slow path's)."""


def _load(relative: str) -> Any:
    """A module of ``rollcage`` from its file, without the package's imports (each imports nothing of it)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relative)
    module = type(sys)("_rollcage_" + relative.replace("/", "_").removesuffix(".py"))
    module.__file__ = path
    with open(path, "rb") as file:
        exec(compile(file.read(), path, "exec"), module.__dict__)
    return module


enter: Any = _load("cage/_enter.py")
wire: Any = _load("forkserver/_wire.py")
_forkserver: Any = _load("forkserver/_server.py")
_ancillary: Any = _load("procs/_ancillary.py")

_ROOM = wire.room([wire.CommandStart])
_DEFAULTED = (_signal.SIGINT, _signal.SIGQUIT, _signal.SIGPIPE, _signal.SIGXFSZ)


def _reply(fd: int, message: Any, fds: list[int] | None = None) -> None:
    """Send ``message`` on the reply socket ``fd`` (left open: its owner closes it)."""
    sock = socket.socket(fileno=fd)
    try:
        wire.send(sock, message, fds or [], socket.MSG_DONTWAIT)
    except OSError:
        pass  # the provider gave up on this start: it kills what it was told of, or the sandbox does
    finally:
        sock.detach()


def _become(request: Any, fds: list[int]) -> None:
    """In the fork, born in the cage's PID namespace: take the command's place (never returns)."""
    holder, status, stdin, stdout, stderr = fds
    try:
        for procs in request.cgroups:
            descriptor = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(descriptor, b"0")  # this process
            finally:
                os.close(descriptor)
        os.setgroups([])
        enter.setns(holder, enter.JOIN)
        os.setsid()
        # The reply socket at 3, closed when the command executes; the rest of the joiner's closed now.
        os.dup2(status, 3, inheritable=False)
        status = 3
        os.dup2(stdin, 0)
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        if request.tty:
            # A PTY session: its terminal becomes the new session's controlling terminal, so the
            # shell has job control and the terminal's signals (^C) reach its foreground group.
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        os.closerange(4, 1 << 20)
        os.chdir(request.cwd)
        # A command finds every signal at its default, as in a container: Python ignores SIGPIPE and
        # SIGXFSZ at start, and a provider started as a shell's background job (``cmd &``) inherits
        # SIGINT and SIGQUIT ignored, which would make ^C and ``send_signal("SIGINT")`` do nothing.
        for number in _DEFAULTED:
            _signal.signal(number, _signal.SIG_DFL)
        enter.drop_privileges(request.uid, request.gid)
        os.execvpe(request.argv[0], request.argv, request.env)
    except BaseException as exc:
        try:
            _reply(status, wire.EnterFailed(reason=f"{type(exc).__name__}: {exc}"))
        except BaseException:
            pass
    os._exit(ENTER_FAILED)


class _Joiner:
    """The serving loop's state: the fork server and the requests it answers."""

    def __init__(self, control: socket.socket) -> None:
        self.server = _forkserver.ForkServer(control, enter)

    def serve(self) -> None:
        """Serve until the provider closes its socket (or dies)."""
        self.server.serve(self._start)

    def _start(self) -> bool:
        try:
            data, ancillary, flags, _ = self.server.control.recvmsg(_ROOM[0], socket.CMSG_SPACE(4 * _ROOM[1]))
        except (ConnectionError, OSError):
            return False
        fds, _ = _ancillary.unpack_ancillary(ancillary)
        if not data and not fds:
            return False
        try:
            request = wire.decode(data, fds, flags, expect=[wire.CommandStart])
        except wire.WireError:
            # Without its reply socket nobody can be told; the provider's wait on it is bounded.
            for fd in fds:
                os.close(fd)
            return True
        try:
            self._fork(request, fds)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def _fork(self, request: Any, fds: list[int]) -> None:
        why = self.server.join(fds[0])
        if why is not None:
            _reply(fds[1], wire.Unforked(reason=why))
            return
        try:
            child, pidfd = self.server.fork(sibling=True)
        except OSError as exc:
            _reply(fds[1], wire.Unforked(reason=f"cannot fork the command: {exc}"))
            return
        if child == 0:
            _become(request, fds)
        try:
            _reply(fds[1], wire.Forked(pid=child), [pidfd])
        finally:
            os.close(pidfd)


def main(argv: list[str]) -> int:
    """``THIS_FILE CTL PARENT``: serve on ``CTL``; exit at once if the parent is not ``PARENT``."""
    control_fd, parent = int(argv[0]), int(argv[1])
    enter.prctl(enter.PR_SET_PDEATHSIG, _signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    _Joiner(socket.socket(fileno=control_fd)).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
