"""The warm template: one pre-imported interpreter that forks each rollout's worker into its cage.

A cold start pays a fresh interpreter and the worker's imports (pydantic, the
models, httpx, asyncio: most of a cold rollout's CPU) in every rollout. The template
pays them once: ``python -I -B -m rollcage template FD PARENT`` imports the
worker, freezes its heap (``gc.freeze()``, so children do not dirty the shared
pages by collecting them) and then only waits on its socket. It runs no thread
and no event loop, holds no credential, and dies with its parent.

For each rollout the supervisor has bubblewrap build the cage as for a cold start,
with a holder in the worker's place (:data:`~rollcage.cage.HOLDER_SCRIPT`), and
sends the template one :class:`WarmRequest` with three descriptors: a pidfd of
the holder, a report socket, and ``worker.log``. The template joins the holder's
PID namespace for its next child only, forks the worker into it as the
*supervisor's* child (``clone3`` with ``CLONE_PARENT``: no process stands between
them), goes back to its own PID namespace, and sends the supervisor a pidfd of the
worker on the report socket. The supervisor reaps the worker and writes its exit
status to the holder, which exits with it: bwrap reports it as it would the
worker's own.

The worker then, before it runs anything of the rollout's:

1. opens the rollout's ``cgroup.procs`` files and moves itself into them, as the
   host's root still;
2. clears its supplementary groups, joins the holder's mount namespace alone and
   mounts the bounded ``/tmp`` and ``/dev/shm`` the request asks for there (over
   bubblewrap's own), so the host's mount table never holds them; what the cage
   shows under them (a Python environment in ``/tmp``) is copied first and put
   back on top, as bubblewrap had mounted it;
3. joins the holder's user, network, IPC, UTS and cgroup namespaces at once
   (``setns`` on the pidfd);
4. reports ``ok`` on the report socket, with the roots of the tmpfs it mounted
   (the supervisor measures their budgets through them), or ``error ...`` and
   exits.

Then it drops every capability, takes the sandbox's uid and gid, sets
``no_new_privs``, takes the cage's resource limits, keeps only ``/dev/null`` and
the log as its standard descriptors (every other one is closed), starts a
session, takes the working directory and the exact environment a cold start would
have, and runs :func:`rollcage.worker.worker_main`; it always ends in ``os._exit``.
It has no parent-death signal: its parent is a thread of the supervisor's, which
may end before the rollout does, and a supervisor that dies closes the holder's
stdin, whose exit ends the cage's PID namespace with the worker in it.

A template that dies takes only the starts it had not forked yet with it: their
holders see their stdin closed and exit with 125 (no result: ``infra_failure``);
workers already running are not its children and go on, and the supervisor starts
a new template for the next rollout. A template that stops answering (stopped, deadlocked) is
killed by the supervisor once a start has waited ``TEMPLATE_ANSWER_S`` for its word, with the
same effect (:mod:`rollcage.supervisor.warm`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import locale
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rollcage.cage import (
    CAGE_ENV,
    JOIN,
    MOUNT_NS,
    PID_NS,
    PR_SET_PDEATHSIG,
    Limits,
    attach_mounts,
    clone_mounts,
    clone_sibling,
    drop_privileges,
    mount_tmpfs,
    prctl,
    setns,
    show_process,
)

if TYPE_CHECKING:
    from rollcage.tools import ExecutorTemplateLink

__all__ = ["MAX_REQUEST_BYTES", "REQUEST_FDS", "WarmRequest", "template_main"]

MAX_REQUEST_BYTES = 1 << 20
"""The largest request the template reads (a worker's argv and environment)."""

REQUEST_FDS = 3
"""Descriptors sent with each request: holder pidfd, report socket (``SOCK_SEQPACKET``), worker.log."""


@dataclass(frozen=True)
class WarmRequest:
    """One worker to start in a cage (sent as JSON; the descriptors travel beside it).

    Attributes:
        argv: The worker's arguments (``INPUT RESULT --checkpoint PATH``, paths as the cage sees them).
        env: Its entire environment.
        cwd: Its working directory in the cage.
        uid: The uid it runs as, in the cage's user namespace.
        gid: Likewise, the gid.
        limits: The cage's :class:`~rollcage.cage.Limits`, by field name (soft = hard).
        umask: Its file-mode creation mask.
        cgroups: The rollout's ``cgroup.procs`` files it is moved into before it runs.
        clear_groups: Clear the supplementary groups first (the template is root).
        mounts: Bounded tmpfs to mount in the cage before the worker starts, each
            ``{"path", "size", "inodes", "uid", "gid"}`` (``/tmp``, ``/dev/shm``: mode 1777,
            owned by the host's ``uid``); the report sends their roots back, in this order.
        keep: Paths the cage shows under those places (a Python environment in ``/tmp``): their
            mounts are copied before the tmpfs goes over them and put back on top of it.
    """

    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    limits: dict[str, int | None] = field(default_factory=dict)
    umask: int = 0o022
    cgroups: list[str] = field(default_factory=list)
    clear_groups: bool = True
    mounts: list[dict[str, Any]] = field(default_factory=list)
    keep: list[str] = field(default_factory=list)

    def encode(self) -> bytes:
        """The request as the template reads it."""
        # Its fields hold JSON values only: no deep copy of them (dataclasses.asdict) to encode them.
        return json.dumps({name: getattr(self, name) for name in self.__dataclass_fields__}).encode()

    @classmethod
    def decode(cls, data: bytes) -> WarmRequest:
        """Parse a request (from the trusted supervisor; a malformed one raises)."""
        return cls(**json.loads(data))


def template_main(argv: list[str]) -> int:
    """``rollcage template FD PARENT``: serve worker starts on socket ``FD`` until it closes.

    Exits at once if its parent is no longer ``PARENT`` (it would never be told to stop).
    """
    if len(argv) != 2 or not all(word.isdigit() for word in argv):
        sys.stderr.write("rollcage template: started by the supervisor only (FD PARENT), not by hand\n")
        return 2
    fd, parent = int(argv[0]), int(argv[1])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    from rollcage.worker import warm_up

    warm_up()
    # Taken before the freeze, so that it is shared with every fork as the rest of the heap is.
    modules = frozenset(sys.modules)
    gc.collect()
    gc.freeze()
    # Where each worker is born is set for one fork at a time, and set back after.
    home = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    sock = socket.socket(fileno=fd)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST_BYTES, REQUEST_FDS + 1)
        except InterruptedError:
            continue
        if not message:
            return 0
        if len(fds) == REQUEST_FDS:
            _start(message, fds, home=home, listening=fd, modules=modules)
        for received in fds:
            os.close(received)


def _report(channel: int, text: str, fds: list[int] | None = None) -> bool:
    """One message on the report socket (never blocks: one short message on a socket of its own); sent?

    The template says ``pid N`` (with a pidfd) or ``unforked ...``; the worker ``ok`` (with the tmpfs
    roots) or ``error ...``. The supervisor tells the two apart by the words.
    """
    try:
        with socket.fromfd(channel, socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            socket.send_fds(sock, [text.encode(errors="replace")], fds or [], socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


def _say(fd: int, text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, text.encode(errors="replace"))


_executors: ExecutorTemplateLink | None = None
"""The executor template beside this one (started with the first worker that can use it)."""


def _start(message: bytes, fds: list[int], *, home: int, listening: int, modules: frozenset[str]) -> None:
    """Fork the worker into the holder's PID namespace as the supervisor's child; hand over a pidfd of it."""
    holder, report, log = fds
    # Decoded once, here: the worker is forked with it (a malformed one is the worker's to report).
    request: WarmRequest | Exception
    try:
        request = WarmRequest.decode(message)
    except (TypeError, ValueError) as exc:
        request = exc
    env = _worker_environment(request) if isinstance(request, WarmRequest) else {}
    channel = _link(request, env) if isinstance(request, WarmRequest) else -1
    pid, pidfd = _fork_into(holder, home=home, log=log, report=report)
    if pid == 0:
        os.close(listening)
        _enter(request, env, holder=holder, report=report, log=log, modules=modules, channel=channel)
    if channel >= 0:
        # The worker's copy is its own (with it gone, or never forked, the executor template sees the end).
        os.close(channel)
    if pid < 0:
        return
    _go_home(home, log)
    # The supervisor reaps the worker by this pidfd: until it does, the zombie holds the sandbox's PID
    # namespace (and so bwrap) open. It reads this message before it lets go of the socket.
    _report(report, f"pid {pid}", [pidfd])
    os.close(pidfd)


def _fork_into(holder: int, *, home: int, log: int, report: int) -> tuple[int, int]:
    """``clone_sibling`` born in the holder's PID namespace: ``(pid, pidfd)``, or ``(-1, -1)`` reported."""
    try:
        setns(holder, PID_NS)
    except OSError as exc:
        _report(report, f"unforked cannot enter the sandbox's PID namespace: {exc}")
        return -1, -1
    try:
        return clone_sibling()
    except OSError as exc:
        _go_home(home, log)
        _report(report, f"unforked cannot fork the worker: {exc}")
        return -1, -1


_COERCION_TARGETS = ("C.UTF-8", "C.utf8", "UTF-8")
"""The locales a starting interpreter tries in place of the C locale, in its order (PEP 538)."""


def _coerced_locale(env: Mapping[str, str]) -> dict[str, str]:
    """What an interpreter started with ``env`` adds to its own environment: ``LC_CTYPE``, or nothing.

    Started in the C (or POSIX) locale and without ``LC_ALL``, an interpreter moves to a UTF-8 one
    and says so in its environment (PEP 538), which every process it starts then inherits: a
    cold worker's executor and tools see ``LC_CTYPE=C.UTF-8``. A forked worker did not start, so
    it takes what that start would have added.
    """
    if env.get("LC_ALL"):
        return {}
    name = env.get("LC_CTYPE") or env.get("LANG") or "C"
    before = locale.setlocale(locale.LC_CTYPE)
    try:
        if name not in ("C", "POSIX"):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
                return {}
            except locale.Error:
                pass  # not installed: the C library stays in C, and so does the interpreter
        for target in _COERCION_TARGETS:
            try:
                locale.setlocale(locale.LC_CTYPE, target)
            except locale.Error:
                continue
            return {"LC_CTYPE": target}
        return {}
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


def _link(request: WarmRequest, env: dict[str, str]) -> int:
    """The worker's socket to the executor template, if its executors can be forked there; else -1.

    ``env`` is the worker's environment (:func:`_worker_environment`), its executors' too.
    """
    if request.env.get(CAGE_ENV, "none") == "none":
        return -1  # no executor's cage to fork into
    global _executors
    if _executors is None:
        # Here, not at the top: the supervisor imports this module for WarmRequest, and the tools
        # are the worker's side of the sandbox's wall (tests/core/test_architecture.py).
        from rollcage.tools import ExecutorTemplateLink

        _executors = ExecutorTemplateLink()
    return _executors.attach(
        uid=request.uid,
        gid=request.gid,
        limits=Limits(**request.limits),
        umask=request.umask,
        cgroups=request.cgroups,
        env=env,
    )


def _worker_environment(request: WarmRequest) -> dict[str, str]:
    """The environment the worker runs with: the request's, and what a cold worker's start adds to it."""
    return {**request.env, **_coerced_locale(request.env)}


def _go_home(home: int, log: int) -> None:
    """Have the template's next children born in its own PID namespace again; exit if they cannot be."""
    try:
        setns(home, PID_NS)
    except OSError as exc:
        # They would be born in this cage: the supervisor starts a new template instead.
        _say(log, f"rollcage: the warm worker template cannot return to its PID namespace: {exc}\n")
        os._exit(1)


def _enter(
    request: WarmRequest | Exception,
    env: dict[str, str],
    *,
    holder: int,
    report: int,
    log: int,
    modules: frozenset[str],
    channel: int,
) -> NoReturn:
    """The worker, born in the cage's PID namespace: move into its cgroups, join the cage, report, run."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if isinstance(request, Exception):
            raise request
        for path in request.cgroups:
            procs = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(procs, b"0")  # this process
            finally:
                os.close(procs)
        if request.clear_groups:
            os.setgroups([])
        setns(holder, MOUNT_NS)
        roots = _mount_scratch(request)
        setns(holder, JOIN & ~MOUNT_NS)
    except BaseException as exc:
        _say(log, f"rollcage: the warm worker could not enter its cage: {exc}\n")
        # "mount": the supervisor mounts on the host for its next rollouts instead.
        _report(report, f"error {'mount: ' if isinstance(exc, _MountRefused) else ''}{exc}")
        os._exit(1)
    # The supervisor measures the tmpfs through these roots, whoever outlives whom.
    _report(report, "ok", roots)
    _become_worker(request, env, log=log, modules=modules, channel=channel)


class _MountRefused(OSError):
    """A bounded tmpfs could not be mounted in the cage."""


def _mount_scratch(request: WarmRequest) -> list[int]:
    """Mount the request's bounded tmpfs in the cage, keeping what the cage shows under them; their roots."""
    kept: list[tuple[str, int]] = []
    try:
        # Copied as bubblewrap mounted them (read-only, nosuid, nodev), before the tmpfs hides them.
        for path in request.keep:
            kept.append((path, clone_mounts(path)))
        roots = [_mount(mount) for mount in request.mounts]
        for path, tree in kept:
            attach_mounts(tree, path)
        return roots
    except OSError as exc:
        raise _MountRefused(exc.errno, exc.strerror or str(exc)) from exc
    finally:
        for _, tree in kept:
            os.close(tree)


def _mount(mount: dict[str, Any]) -> int:
    """Mount one bounded tmpfs in the cage (this process is in its mount namespace); its root, ``O_PATH``.

    Mounted by the host's root, so its owner is a host uid, and seen only by the cage.
    """
    path = str(mount["path"])
    mount_tmpfs(
        Path(path),
        size=int(mount["size"]),
        inodes=int(mount["inodes"]),
        uid=int(mount["uid"]),
        gid=int(mount["gid"]),
        mode=0o1777,
        source="rollcage",
    )
    return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def _become_worker(
    request: WarmRequest, env: dict[str, str], *, log: int, modules: frozenset[str], channel: int
) -> NoReturn:
    """The worker, in its cage: become what a cold start runs, then run it."""
    out = log
    try:
        # The supervisor knows a rollout's processes by the token in their environment, and people
        # know a worker by its command line: not the template's, which a fork would show.
        show_process([sys.executable, "-m", "rollcage", "worker", *request.argv], request.env)
        drop_privileges(request.uid, request.gid)
        Limits(**request.limits).apply()
        os.umask(request.umask)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        out = 2
        if channel >= 0:
            # Kept: the worker's socket to the executor template (see rollcage.tools._forked).
            os.closerange(3, channel)
            os.closerange(channel + 1, 1 << 20)
            from rollcage.tools import adopt_executor_template

            adopt_executor_template(channel)
        else:
            os.closerange(3, 1 << 20)
        os.chdir(request.cwd)
        os.setsid()
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["rollcage", "worker", *request.argv]
    except BaseException as exc:
        _say(out, f"rollcage: the warm worker could not take its cage's place: {exc}\n")
        os._exit(125)
    from rollcage.worker import run_worker

    run_worker(request.argv, forked_from=modules)
