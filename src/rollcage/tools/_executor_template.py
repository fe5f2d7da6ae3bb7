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

Protocol (``SOCK_SEQPACKET``, one message each, JSON):

* on ``CTL``, from the warm template (trusted), once per warm worker: ``{"uid", "gid",
  "limits", "umask"}`` (what the worker itself takes on: the cage's ids, ``[[RLIMIT, value],
  ...]``) with this process's end of a socket pair whose other end the worker keeps, then the
  rollout's ``cgroup.procs`` files, opened for writing;
* on that socket, from the worker, once per executor start: ``{"cwd", "env", "argv",
  "boot"}`` with four descriptors: a pidfd of the holder the executor joins, its control
  socket, its stdout and its stderr. The answer is ``b"pid"`` with a pidfd of the executor,
  or ``b"refused WHY"`` (the worker then starts one as before); later ``b"exit CODE"`` (as
  ``os.waitstatus_to_exitcode``) once it is reaped.

A worker's request is read by the executor itself, never by this process: the template takes
one byte of it and its descriptors (``MSG_PEEK``), joins the holder's PID namespace for one fork,
and the fork, born there, reads the request, joins the rest of the cage and becomes the executor.
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

import array  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import selectors  # noqa: E402
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
MAX_MESSAGE = 1 << 20
WORKER_FDS = 4


def _load_enter() -> Any:
    """:mod:`rollcage.cage._enter` from its file, without the ``rollcage`` package's imports."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cage", "_enter.py")
    module = type(sys)("_rollcage_enter")
    module.__file__ = path
    with open(path, "rb") as file:
        exec(compile(file.read(), path, "exec"), module.__dict__)
    return module


enter: Any = _load_enter()


def _refusal(request: object, fds: list[int]) -> str | None:
    """Why ``request`` cannot be served as asked, if it cannot."""
    if not isinstance(request, dict) or len(fds) != WORKER_FDS:
        return "malformed request"
    env = request.get("env")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        return "malformed environment"
    if not (isinstance(request.get("cwd"), str) and isinstance(request.get("boot"), str)):
        return "malformed request"
    argv = request.get("argv")
    if not isinstance(argv, list) or not all(isinstance(word, str) for word in argv):
        return "malformed command line"
    for name in sorted({*_STARTUP_ENV, *_STARTED_WITH}):
        if env.get(name) != _STARTED_WITH.get(name):
            return f"{name} differs from the template's"
    return None


def _join(cgroups: list[int], holder: int) -> None:
    """In the executor, born in the holder's PID namespace: join the rollout's cgroups and the cage.

    It takes on the rest itself (:func:`_become_executor`), as a warm worker does.
    """
    # As a started executor is born: SIGINT held until its handler is in place (rollcage.tools._repl).
    _signal.pthread_sigmask(_signal.SIG_BLOCK, [_signal.SIGINT])
    for procs in cgroups:
        os.write(procs, b"0")  # this process
    os.setgroups([])
    # The PID namespace is already this process's own: joined again, it is the one its children are born in.
    enter.setns(holder, enter.JOIN)


def _become_executor(meta: dict[str, Any], request: dict[str, Any], fds: list[int]) -> None:
    """In the executor, born in its cage: what a warm worker takes on, then its boot program; never returns.

    The command line and environment it shows, no privilege, the worker's limits and umask, its
    own session, its descriptors, directory, environment and modules.
    """
    argv = [*request["argv"][:-1], "3"]  # its control socket, as numbered below
    try:
        enter.show_process(argv, request["env"])
        for which, (soft, hard) in _LIMITS.items():
            resource.setrlimit(which, (soft, hard))
        enter.drop_privileges(meta["uid"], meta["gid"])
        # The change of uid made it undumpable (its /proc files root's): an exec'd one is not.
        enter.prctl(_PR_SET_DUMPABLE, 1)
        for which, value in meta["limits"]:
            resource.setrlimit(which, (value, value))
        os.umask(meta["umask"])
        # SIGCHLD as a started executor has it: the template's handler and wake-up are not its own.
        _signal.set_wakeup_fd(-1)
        _signal.signal(_signal.SIGCHLD, _signal.SIG_DFL)
        _, control, out, err = fds
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.dup2(control, 3)
        # Every descriptor of the template (other workers' sockets among them) is closed here, whatever
        # this executor's own limit on open files: a descriptor numbered above it is still open.
        os.closerange(4, 1 << 20)
        os.chdir(request["cwd"])
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.write(2, f"rollcage: the forked executor could not take its cage's place: {exc}\n".encode())
        os._exit(125)
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(_ADDED_AT_START)
    sys.argv = ["-c", "3"]
    sys.orig_argv = argv
    main = type(sys)("__main__")
    main.__dict__["__builtins__"] = __builtins__
    for name in set(sys.modules) - _FRESH:
        del sys.modules[name]
    sys.modules["__main__"] = main
    exec(compile(request["boot"], "<string>", "exec"), main.__dict__)
    os._exit(0)


def _serve_one(
    worker: socket.socket, rollout: tuple[dict[str, Any], list[int]], word: int, unjoinable: str | None
) -> None:
    """In a fork of this process, born in the holder's PID namespace: read one request, become its executor.

    Says ``ok`` on ``word`` once it stands in the cage (the template then hands the worker a
    pidfd of it, reaps it and tells the worker its exit code), or answers the worker itself
    and returns: the request's fault first, then ``unjoinable`` (why the template could not
    join the holder's PID namespace for this fork, which was then born outside it).

    Parsed here, not in the template: nothing of a rollout enters the heap every executor
    inherits; and as JSON, which malformed or hostile bytes cannot turn into anything
    but an error (``marshal`` makes no such promise).
    """
    meta, cgroups = rollout
    try:
        message, fds, flags, _ = socket.recv_fds(worker, MAX_MESSAGE, WORKER_FDS)
    except OSError:
        return
    try:
        request = json.loads(message)
    except ValueError:
        request = None
    why = "malformed request" if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) else _refusal(request, fds)
    if why is not None or unjoinable is not None:
        why = why or unjoinable
        _send(worker, f"refused {why}".encode())
        return
    try:
        _join(cgroups, fds[0])
    except BaseException as exc:
        _send(worker, f"refused cannot join the cage: {type(exc).__name__}: {exc}"[:1000].encode())
        return
    os.write(word, b"ok")
    os.close(word)
    _become_executor(meta, request, fds)


def _peek(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """The first byte of the next message and its descriptors, the message left where it is (``MSG_PEEK``).

    The kernel gives a peek copies of the descriptors. ``socket.recv_fds`` drops its ``flags`` before
    Python 3.12, so ``recvmsg`` here, unpacked as ``rollcage.procs.unpack_ancillary`` does (this
    program imports nothing of ``rollcage``).
    """
    size = WORKER_FDS * array.array("i").itemsize
    data, ancillary, flags, _ = sock.recvmsg(1, socket.CMSG_LEN(size), socket.MSG_PEEK)
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds), flags


def _send(sock: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    try:
        socket.send_fds(sock, [data], fds or [], socket.MSG_DONTWAIT)
    except OSError:
        pass  # the worker is gone, or not reading: its executor is killed with its sandbox


class _Template:
    """The serving loop's state: the template's socket, the workers', and the executors to reap."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.selector = selectors.DefaultSelector()
        self.executors: dict[int, socket.socket] = {}
        """Each live executor's PID (this process's child) -> its worker's socket."""
        self.home = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        """This process's own PID namespace: its children are born there but for one fork at a time."""
        # SIGCHLD wakes the loop (a handler must be set for the wake-up to be written).
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        _signal.set_wakeup_fd(wake_w)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)
        self.selector.register(control, selectors.EVENT_READ, "control")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")

    def serve(self) -> None:
        """Serve until the template closes its socket."""
        while True:
            for key, _ in self.selector.select():
                if key.data == "control":
                    if not self._register():
                        return
                elif key.data == "wake":
                    os.read(self.wake_r, 4096)
                    self._reap()
                else:
                    self._start(*key.data)

    def _register(self) -> bool:
        message, fds, flags, _ = socket.recv_fds(self.control, MAX_MESSAGE, 64)
        if not message:
            return False
        meta = json.loads(message)
        if flags & socket.MSG_CTRUNC or len(fds) != 1 + meta["cgroups"]:
            # Descriptors lost on the way (this process's limit): without all its cgroups an executor
            # would escape the rollout's budgets. Its worker, finding its socket closed, starts its own.
            for fd in fds:
                os.close(fd)
            return True
        worker = socket.socket(fileno=fds[0])
        worker.setblocking(False)
        self.selector.register(worker, selectors.EVENT_READ, (worker, (meta, fds[1:])))
        return True

    def _start(self, worker: socket.socket, rollout: tuple[dict[str, Any], list[int]]) -> None:
        try:
            # One byte and the descriptors, peeked: whether the worker is gone, and the holder whose
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
            if flags & socket.MSG_CTRUNC or len(fds) != WORKER_FDS:
                self._refuse(worker, "malformed request")
                return
            self._fork(worker, rollout, fds[0])
        finally:
            for fd in fds:
                os.close(fd)

    def _fork(self, worker: socket.socket, rollout: tuple[dict[str, Any], list[int]], holder: int) -> None:
        """Fork the executor into ``holder``'s PID namespace; it reads its request (:func:`_serve_one`)."""
        # Not joinable: forked here all the same, to read the request and say what is wrong with it first.
        unjoinable: str | None = None
        try:
            enter.setns(holder, enter.PID_NS)
        except OSError as exc:
            unjoinable = f"cannot join the cage: OSError: {exc}"
        word_r, word_w = os.pipe()
        try:
            child, pidfd = enter.clone_child()
        except OSError as exc:
            os.close(word_r)
            os.close(word_w)
            self._go_home()
            self._refuse(worker, f"cannot fork the executor: {exc}")
            return
        if child == 0:
            try:
                os.close(word_r)
                _serve_one(worker, rollout, word_w, unjoinable)
            finally:
                os._exit(0)
        if unjoinable is None:
            self._go_home()
        os.close(word_w)
        word = b""
        try:
            # Until it stands in the cage (not until it exits: it goes on making itself the executor).
            while len(word) < 2 and (chunk := os.read(word_r, 2 - len(word))):
                word += chunk
        finally:
            os.close(word_r)
        try:
            if word != b"ok":
                self._reap(until=child)  # it answered the worker itself
                return
            self.executors[child] = worker  # before any reaping: it may be gone already
            _send(worker, b"pid", [pidfd])
        finally:
            os.close(pidfd)

    def _go_home(self) -> None:
        """Have this process's next children born in its own PID namespace again; exit if they cannot be."""
        try:
            enter.setns(self.home, enter.PID_NS)
        except OSError:
            # They would be born in a cage: the warm template starts a new executor template instead.
            os._exit(1)

    def _refuse(self, worker: socket.socket, why: str) -> None:
        """Take the request off the socket unread (one byte of it, the rest cut) and tell the worker why."""
        with contextlib.suppress(OSError):
            _, fds, _, _ = socket.recv_fds(worker, 1, WORKER_FDS)
            for fd in fds:
                os.close(fd)
        _send(worker, f"refused {why}"[:1000].encode())

    def _drop(self, worker: socket.socket, rollout: tuple[dict[str, Any], list[int]]) -> None:
        """Forget a worker that is gone: its socket and its cgroups' files."""
        self.selector.unregister(worker)
        worker.close()
        for fd in rollout[1]:
            os.close(fd)

    def _reap(self, until: int = 0) -> None:
        """Reap every child that has exited (waiting for ``until`` first); say how each executor ended."""
        while True:
            try:
                pid, status, _ = os.wait3(0 if until else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = self.executors.pop(pid, None)
            if worker is not None and worker.fileno() >= 0:
                _send(worker, f"exit {os.waitstatus_to_exitcode(status)}".encode())
            if pid == until:
                until = 0


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
    gc.freeze()
    template.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
