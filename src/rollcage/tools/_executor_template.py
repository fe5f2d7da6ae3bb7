"""The executor template: a fresh interpreter that forks each ``repl`` executor into the cage made for it.

Run by the warm worker template (:mod:`rollcage.tools._forked`) as ``python -I -u THIS_FILE CTL
PARENT``: the same interpreter and flags as a started executor (``python -I -u -c BOOT``), so
what each fork inherits is what a fresh executor would have made for itself at start-up. It
never imports ``rollcage`` (its heap is every executor's, and holds no rollout's data but
the requests below); the system calls that join a cage are :mod:`rollcage.cage._enter`'s,
loaded from that file alone.

Why: a started executor spends CPU building an interpreter that is the same for every
rollout; a fork of this one costs a fraction of that (docs/benchmarks/index.md). The cage is
unchanged: the worker still makes it with the nested bubblewrap
(:mod:`rollcage.cage._nested`), around a holder instead of the interpreter, and a fork of
this process joins the holder's namespaces there, as a warm worker joins its sandbox's.

It is a :class:`rollcage.forkserver.ForkServer`, and speaks its messages (``SOCK_SEQPACKET``,
one codec: :mod:`rollcage.forkserver._wire`, loaded by path as the loop is):

* on ``CTL``, from the warm template (trusted), once per warm worker:
  :class:`~rollcage.forkserver.ExecutorClient` (what the worker itself takes on: the cage's ids,
  limits and umask) with this process's end of a socket pair whose other end the worker keeps,
  then the rollout's ``cgroup.procs`` files, opened for writing;
* on that socket, from the worker, once per executor start:
  :class:`~rollcage.forkserver.ExecutorStart` with four descriptors: a pidfd of the holder the
  executor joins, its control socket, its stdout and its stderr. The answer is
  :class:`~rollcage.forkserver.ExecutorStarted` with a pidfd of the executor, or
  :class:`~rollcage.forkserver.Refused` saying why (the worker then starts one as before); later
  :class:`~rollcage.forkserver.Exited` once it is reaped.

A worker's request is read by the executor itself, never by this process: the template takes
its header and its descriptors (``MSG_PEEK``), joins the holder's PID namespace for one fork,
and the fork, born there, reads the request, joins the rest of the cage and becomes the executor.
Not root (a non-root supervisor's worker: :attr:`~rollcage.forkserver.ExecutorClient.userns`),
the template may not join that PID namespace: its fork, born beside it, is a go-between that
reads the request, joins every namespace of the holder at once (its user namespace included:
the supervisor's uid owns the nested cage's) and forks the executor there as the template's
child (:func:`rollcage.cage.fork_into`), hands the template its PID and a pidfd of it, and exits.
So the heap every executor inherits holds no rollout's environment, paths or words (only
descriptors and PIDs), and agent code reading its own memory finds nothing of another rollout.
One fork per executor: a fork that read the request and forked the executor in turn cost
every rollout one more process's page faults and exit.

The values that set up an interpreter at its start (the locale's, the time zone's) are this
process's own: a request whose environment differs in them is refused, so every executor is
the one its environment would have started. What a fork cannot give: every executor forked
from one template has the template's string-hash seed (a started one draws its own).
"""

from __future__ import annotations

import sys

# Before anything else: the modules a fresh ``python -I -u`` has; each executor forgets the rest.
_FRESH = frozenset(sys.modules) - {"__future__"}

import contextlib  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import socket  # noqa: E402

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Loaded at start-up; ``import signal`` would add enum (and the executors would inherit it).
_signal: Any = sys.modules["_signal"]

_STARTUP_ENV = ("HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONUSERBASE", "TZ")
"""Variables an interpreter reads once, at start-up: the stdio and file system encodings, ``time.tzname``,
``site.USER_BASE`` (without ``HOME``, ``site`` even imports ``pwd`` to find it)."""


def _initial_environment() -> dict[str, str]:
    """The environment this process was started with, as the kernel keeps it (``/proc/self/environ``).

    Not ``os.environ``: the interpreter may have added to that at start-up (PEP 538's
    ``LC_CTYPE=C.UTF-8``, in the C locale), and a started executor adds the same.
    """
    with open("/proc/self/environ", "rb") as file:
        entries = file.read().split(b"\0")
    pairs = (entry.partition(b"=") for entry in entries if b"=" in entry)
    return {os.fsdecode(name): os.fsdecode(value) for name, _, value in pairs}


_INITIAL = _initial_environment()
_STARTED_WITH = {name: value for name, value in _INITIAL.items() if name != "PATH"}
"""This process's own start-up environment (``PATH`` only finds the interpreter, named in full)."""
_ADDED_AT_START = {name: value for name, value in os.environ.items() if _INITIAL.get(name) != value}
"""What the interpreter set in its own environment at start-up: an executor started with the same
start-up environment would have set it too."""
_LIMITS = {
    getattr(resource, name): resource.getrlimit(getattr(resource, name))
    for name in dir(resource)
    if name.startswith("RLIMIT_")
}
"""The limits this process started with, the warm template's (and so a worker's, but for the ones the
rollout sets): each executor starts from them, whatever this process raised for itself."""

__all__ = ["main"]

_PR_SET_DUMPABLE = 4


def _load(relative: str) -> Any:
    """A module of ``rollcage`` from its file, without the package's imports (each imports nothing of it)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), relative)
    module = type(sys)("_rollcage_" + relative.replace("/", "_").removesuffix(".py"))
    module.__file__ = path
    with open(path, "rb") as file:
        exec(compile(file.read(), path, "exec"), module.__dict__)
    return module


enter: Any = _load("cage/_enter.py")
"""The system calls that join a cage (:mod:`rollcage.cage._enter`)."""
wire: Any = _load("forkserver/_wire.py")
"""The fork servers' messages and codec (:mod:`rollcage.forkserver._wire`)."""
_forkserver: Any = _load("forkserver/_server.py")
_ancillary: Any = _load("procs/_ancillary.py")
_reap: Any = _load("procs/_reap.py")

_REQUEST_FDS = wire.ExecutorStart.FDS[1]
_PID_BYTES = 4
"""After ``ok`` on the word socket, a go-between says its executor's PID in this many bytes."""
_CLIENT_ROOM = wire.room([wire.ExecutorClient])
_REQUEST_ROOM = wire.room([wire.ExecutorStart])


def _refusal(request: Any) -> str | None:
    """Why the (well-formed) ``request`` cannot be served as asked, if it cannot: an interpreter's
    start-up environment that differs from this one's."""
    env = request.env
    for name in sorted({*_STARTUP_ENV, *_STARTED_WITH}):
        if env.get(name) != _STARTED_WITH.get(name):
            return f"{name} differs from the template's"
    return None


def _join(client: Any, cgroups: list[int], holder: int) -> tuple[int, int]:
    """Join the rollout's cgroups and the holder's cage: ``(0, -1)`` in the executor, born in the cage.

    As root (this process's fork, born in the holder's PID namespace, is the executor): joins them
    itself. Not root (``client.userns``: this process may not join the PID namespace, nor come back
    from the user namespace), this fork is a go-between: it joins every namespace at once and forks
    the executor there (:func:`rollcage.cage.fork_into`), this template's child, and returns its PID
    (this template's PID namespace) and a pidfd of it, to hand over and exit. The executor takes on
    the rest itself (:func:`_become_executor`), as a warm worker does.

    Raises:
        OSError: A step failed (``enter.EntryFailed`` where the go-between's entry did).
    """
    # As a started executor is born: SIGINT held until its handler is in place (rollcage.tools._repl).
    _signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGINT])
    try:
        for procs in cgroups:
            os.write(procs, b"0")  # this process (a go-between's executor is born in them)
    except OSError as exc:
        raise enter.EntryFailed("move into the rollout's cgroups", exc, refused=False) from exc
    if client.userns:
        pid, pidfd = enter.fork_into(holder, cage="executor's cage", child="the executor")
        return int(pid), int(pidfd)
    os.setgroups([])
    # The PID namespace is already this process's own: joined again, it is the one its children are born in.
    enter.setns(holder, enter.JOIN)
    return 0, -1


def _control_number(argv: list[str]) -> int:
    """The descriptor number a started executor has its control socket at: its command line's last word
    (the worker's number for it, which it inherits), or 3 where that is not a number past stdio."""
    last = argv[-1] if argv else ""
    return int(last) if last.isascii() and last.isdigit() and 3 <= int(last) < 1 << 20 else 3


def _become_executor(client: Any, request: Any, fds: list[int]) -> None:
    """In the executor, born in its cage: what a warm worker takes on, then its boot program; never returns.

    The command line and environment it shows, no privilege, the worker's limits and umask, its
    own session, its descriptors, directory, environment and modules.
    """
    # Its control socket at the number a started one inherits it at (the worker's, its last argument).
    number = _control_number(request.argv)
    argv = [*request.argv[:-1], str(number)]
    try:
        enter.show_process(argv, request.env)
        _, control, out, err = fds
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        # Before the worker's limits: a started executor inherits a number past its RLIMIT_NOFILE,
        # where a new descriptor is refused.
        os.dup2(control, number)
        # Every descriptor of the template (other workers' sockets among them) is closed here, whatever
        # this executor's own limit on open files: a descriptor numbered above it is still open.
        os.closerange(3, number)
        os.closerange(number + 1, 1 << 20)
        for which, (soft, hard) in _LIMITS.items():
            resource.setrlimit(which, (soft, hard))
        enter.drop_privileges(client.uid, client.gid)
        # The change of uid made it undumpable (its /proc files root's): an exec'd one is not.
        enter.prctl(_PR_SET_DUMPABLE, 1)
        for which, value in client.limits:
            resource.setrlimit(which, (value, value))
        os.umask(client.umask)
        # SIGCHLD as a started executor has it: the template's handler and wake-up are not its own.
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        os.setsid()
        os.chdir(request.cwd)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"rollcage: the forked executor could not take its cage's place: {exc}\n".encode())
        os._exit(125)
    os.environ.clear()
    os.environ.update(request.env)
    os.environ.update(_ADDED_AT_START)
    sys.argv = ["-c", str(number)]
    sys.orig_argv = argv
    main = type(sys)("__main__")
    main.__dict__["__builtins__"] = __builtins__
    for name in set(sys.modules) - _FRESH:
        del sys.modules[name]
    sys.modules["__main__"] = main
    exec(compile(request.boot, "<string>", "exec"), main.__dict__)
    os._exit(0)


def _serve_one(
    worker: socket.socket, rollout: tuple[Any, list[int]], word: socket.socket, unjoinable: str | None
) -> None:
    """In a fork of this process, born in the holder's PID namespace: read one request, become its executor.

    Says ``ok`` on ``word`` (a socket of the template's own) once it stands in the cage (the template
    then hands the worker a pidfd of it, reaps it and tells the worker its exit code), or answers
    the worker itself and returns: the request's fault first, then ``unjoinable`` (why the template
    could not join the holder's PID namespace for this fork, which was then born outside it). For
    a client that is not root (``userns``) this fork, born beside the template, is a go-between:
    it says ``ok`` and the PID of the executor it forked into the cage (:func:`_join`), with a pidfd
    of it, and returns.

    Parsed here, not in the template: nothing of a rollout enters the heap every executor
    inherits; and by the codec, which malformed or hostile bytes cannot turn into anything
    but an error (``marshal`` makes no such promise).
    """
    client, cgroups = rollout
    try:
        data, ancillary, flags, _ = worker.recvmsg(
            _REQUEST_ROOM[0], socket.CMSG_SPACE(4 * (_REQUEST_FDS + 1))
        )
    except OSError:
        return
    fds, _ = _ancillary.unpack_ancillary(ancillary)
    try:
        request = wire.decode(data, fds, flags, expect=[wire.ExecutorStart])
        differs = _refusal(request)
        why = differs or unjoinable
    except wire.WireError as exc:
        request, differs, why = None, None, str(exc)
    if why is not None:
        # An environment that differs will differ at every start of this worker: it asks no more.
        _send(worker, wire.Refused(reason=why, final=differs is not None))
        return
    try:
        executor, pidfd = _join(client, cgroups, fds[0])
    except BaseException as exc:
        # The kernel's refusal of the entry (not root: no user namespace to join, a seccomp filter)
        # would refuse every later one too: this worker starts its executors itself from now on.
        final = getattr(exc, "refused", False) is True
        _send(worker, wire.Refused(reason=f"cannot join the cage: {type(exc).__name__}: {exc}", final=final))
        return
    if executor != 0:
        socket.send_fds(word, [b"ok" + executor.to_bytes(_PID_BYTES, "little")], [pidfd])
        return  # the go-between: its work is done
    if not client.userns:
        word.send(b"ok")
    word.close()
    _become_executor(client, request, fds)


def _peek(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """The header of the next message and its descriptors, the message left where it is (``MSG_PEEK``).

    The kernel gives a peek copies of the descriptors. ``socket.recv_fds`` drops its ``flags`` before
    Python 3.12, so ``recvmsg`` here, unpacked by :func:`rollcage.procs.unpack_ancillary`.
    """
    room = socket.CMSG_SPACE(4 * (_REQUEST_FDS + 1))
    data, ancillary, flags, _ = sock.recvmsg(wire.HEADER.size, room, socket.MSG_PEEK)
    return data, _ancillary.unpack_ancillary(ancillary)[0], flags


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    try:
        wire.send(sock, message, fds or [], socket.MSG_DONTWAIT)
    except OSError:
        pass  # the worker is gone, or not reading: its executor is killed with its sandbox


class _Template:
    """The serving loop's state: the fork server, the workers' sockets, and the executors to reap."""

    def __init__(self, control: socket.socket) -> None:
        self.executors: dict[int, socket.socket] = {}
        """Each live executor's PID (this process's child) -> its worker's socket."""
        self.server = _forkserver.ForkServer(control, enter, reap=_reap.reap_children, on_exit=self._exited)

    def serve(self) -> None:
        """Serve until the template closes its socket."""
        self.server.serve(self._register)

    def _register(self) -> bool:
        data, ancillary, flags, _ = self.server.control.recvmsg(
            _CLIENT_ROOM[0], socket.CMSG_SPACE(4 * _CLIENT_ROOM[1])
        )
        fds, _ = _ancillary.unpack_ancillary(ancillary)
        if not data and not fds:
            return False
        try:
            client = wire.decode(data, fds, flags, expect=[wire.ExecutorClient])
        except wire.WireError:
            # Descriptors lost on the way (this process's limit): without all its cgroups an executor
            # would escape the rollout's budgets. Its worker, finding its socket closed, starts its own.
            for fd in fds:
                os.close(fd)
            return True
        worker = socket.socket(fileno=fds[0])
        worker.setblocking(False)
        rollout = (client, fds[1:])
        self.server.watch(worker, lambda: self._start(worker, rollout))
        return True

    def _start(self, worker: socket.socket, rollout: tuple[Any, list[int]]) -> None:
        try:
            # The header and the descriptors, peeked: whether the worker is gone, and the holder whose
            # PID namespace the executor is born in, without reading the request here.
            peeked, fds, flags = _peek(worker)
        except BlockingIOError:
            return
        except OSError:
            peeked, fds, flags = b"", [], 0
        try:
            if not peeked:
                self._drop(worker, rollout)
                return
            try:
                kind, _ = wire.kind_of(peeked, expect=[wire.ExecutorStart])
                lost = "descriptors were lost on the way (MSG_CTRUNC)" if flags & socket.MSG_CTRUNC else None
                problem = lost or wire.descriptors_problem(kind, len(fds))
            except wire.WireError as exc:
                problem = str(exc)
            if problem is not None:
                self._refuse(worker, problem)
                return
            self._fork(worker, rollout, fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, worker: socket.socket, rollout: tuple[Any, list[int]], holder: int) -> None:
        """Fork the executor into ``holder``'s PID namespace; it reads its request (:func:`_serve_one`).

        Not root (the client's ``userns``), the fork is born here, a go-between that forks the executor.
        """
        # Not joinable: forked here all the same, to read the request and say what is wrong with it first.
        unjoinable = None if rollout[0].userns else self.server.join(holder)
        word_r, word_w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            child, pidfd = self.server.fork(sibling=False)
        except OSError as exc:
            word_r.close()
            word_w.close()
            self._refuse(worker, f"cannot fork the executor: {exc}")
            return
        if child == 0:
            try:
                word_r.close()
                _serve_one(worker, rollout, word_w, unjoinable)
            finally:
                os._exit(0)
        word_w.close()
        # Not root: the fork is a go-between, and says its executor's PID too, with a pidfd of it.
        size = 2 + (_PID_BYTES if rollout[0].userns else 0)
        try:
            # Until it stands in the cage (not until it exits: it goes on making itself the executor).
            word, ancillary, _, _ = word_r.recvmsg(size, socket.CMSG_SPACE(4))
        except OSError:
            word, ancillary = b"", []
        finally:
            word_r.close()
        handed, _ = _ancillary.unpack_ancillary(ancillary)
        try:
            if len(word) != size or not word.startswith(b"ok") or len(handed) != (size > 2):
                self.server.reap(until=child)  # it answered the worker itself
                if handed or len(word) == size:
                    # A go-between's executor with no pidfd of it (this process's limit): not to run
                    # unseen by its worker, which starts one instead (its cage's end ends this one).
                    _send(worker, wire.Refused(reason="cannot hold the forked executor"))
                return
            if handed:
                # The executor the go-between forked, this process's child: held by its own pidfd.
                os.close(pidfd)
                child, pidfd = int.from_bytes(word[2:], "little"), handed.pop()
            self.executors[child] = worker  # before any reaping: it may be gone already
            _send(worker, wire.ExecutorStarted(), [pidfd])
        finally:
            os.close(pidfd)
            for fd in handed:
                os.close(fd)

    def _refuse(self, worker: socket.socket, why: str) -> None:
        """Take the request off the socket unread (its header, the rest cut) and tell the worker why."""
        with contextlib.suppress(OSError):
            _, ancillary, _, _ = worker.recvmsg(1, socket.CMSG_SPACE(4 * (_REQUEST_FDS + 1)))
            for fd in _ancillary.unpack_ancillary(ancillary)[0]:
                os.close(fd)
        _send(worker, wire.Refused(reason=why))

    def _drop(self, worker: socket.socket, rollout: tuple[Any, list[int]]) -> None:
        """Forget a worker that is gone: its socket and its cgroups' files."""
        self.server.forget(worker)
        worker.close()
        for fd in rollout[1]:
            os.close(fd)

    def _exited(self, pid: int, code: int) -> None:
        """Tell an executor's worker how it ended (a fork that answered its worker itself is no executor)."""
        worker = self.executors.pop(pid, None)
        if worker is not None and worker.fileno() >= 0:
            _send(worker, wire.Exited(code=code))


def main(argv: list[str]) -> int:
    """``THIS_FILE CTL PARENT``: serve on ``CTL``; exit at once if the parent is not ``PARENT``."""
    control_fd, parent = int(argv[0]), int(argv[1])
    enter.prctl(enter.PR_SET_PDEATHSIG, _signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    # A worker's socket and its cgroups' files each (its executors get none of them): as many as the
    # hard limit allows, not the soft one a worker starts with (restored in each executor).
    soft, hard = _LIMITS[resource.RLIMIT_NOFILE]
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    template = _Template(socket.socket(fileno=control_fd))
    # Shared with every executor as they are; a collection would write every page again.
    gc.collect()
    _forkserver.fill_free_blocks()  # an executor's new objects in pools of its own (see there)
    gc.freeze()
    template.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
