"""The warm template: one pre-imported interpreter that forks each rollout's worker into its cage.

A cold start pays a fresh interpreter and the worker's imports (pydantic, the
models, httpx, asyncio: most of a cold rollout's CPU) in every rollout. The template
pays them once: ``python -I -B -m rollcage template FD PARENT`` imports the
worker, takes its allocator's free blocks (:func:`~rollcage.forkserver.fill_free_blocks`, so a
child's new objects fill pages of its own rather than holes all over the shared ones), freezes
its heap (``gc.freeze()``, so children do not dirty the shared pages by collecting them) and
then only waits on its socket. It runs no thread
and no event loop, holds no credential, and dies with its parent.

For each rollout the supervisor has bubblewrap build the cage as for a cold start,
with a holder in the worker's place (:data:`~rollcage.cage.HOLDER_SCRIPT`), and
sends the template one :class:`~rollcage.forkserver.WorkerStart` with three descriptors: a
pidfd of the holder, a report socket, and ``worker.log`` (and after them those a cold start's
worker inherits: a harness rollout's relay to the supervisor). The template (a
:class:`~rollcage.forkserver.ForkServer` that pre-imported the worker) joins the holder's
PID namespace for its next child only, forks the worker into it as the
*supervisor's* child (``clone3`` with ``CLONE_PARENT``: no process stands between
them), goes back to its own PID namespace, and sends the supervisor a pidfd of the
worker on the report socket (:class:`~rollcage.forkserver.Forked`). The supervisor
reaps the worker and writes its exit status to the holder, which exits with it:
bwrap reports it as it would the worker's own.

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
4. reports :class:`~rollcage.forkserver.Entered` on the report socket, with the roots of the
   tmpfs it mounted (the supervisor measures their budgets through them), or
   :class:`~rollcage.forkserver.EnterFailed` and exits.

Then it drops every capability, takes the sandbox's uid and gid, sets
``no_new_privs``, takes the cage's resource limits, keeps only ``/dev/null`` and
the log as its standard descriptors and the start's passed descriptors at the numbers a cold
start's worker has them (every other one is closed), starts a
session, takes the working directory and the exact environment a cold start would
have, and runs :func:`rollcage.worker.worker_main`; it always ends in ``os._exit``.
It has no parent-death signal: its parent is a thread of the supervisor's, which
may end before the rollout does, and a supervisor that dies closes the holder's
stdin, whose exit ends the cage's PID namespace with the worker in it.

A template that is not root (a non-root supervisor, :attr:`~rollcage.forkserver.WorkerStart.userns`)
owns the cage's user namespaces (bubblewrap made them as its uid) but may not join the cage's
PID namespace for one fork, nor leave the cage's user namespace once in it. It forks a
go-between instead, the supervisor's child, and names it (:class:`~rollcage.forkserver.Forked`
with ``go_between``); the go-between moves into the rollout's cgroups, joins every namespace of
the holder at once (the user namespace with the rest: one ``setns`` on the pidfd), takes the
holder's root, forks the worker there as the supervisor's child (born in the cage's PID
namespace), names it on the report socket and exits. The worker reports :class:`Entered` and
becomes the worker as above (no tmpfs to mount: bubblewrap's are the cage's). Its executors are
forked as a root worker's are, each through a go-between of the executor template's
(:mod:`rollcage.tools._executor_template`, :func:`rollcage.cage.fork_into`).

Without a sandbox (``--sandbox none``, :attr:`~rollcage.forkserver.WorkerStart.caged` false)
there is no cage to enter: the holder is a plain process the supervisor spawned, and the template
forks the worker beside it as the supervisor's child without joining anything. The worker takes
``PR_SET_PDEATHSIG`` (as ``setpriv --pdeathsig KILL`` gives a cold worker: its parent thread is the
one that started this template, one template per such thread), reports :class:`Entered`, and
becomes the worker as above but keeping its uid, gid and capabilities, with the supervisor's own
resource limits of the moment (read with ``prlimit``) in place of the cage's.

A template that dies takes only the starts it had not forked yet with it: their
holders see their stdin closed and exit with 125 (no result: ``infra_failure``);
workers already running are not its children and go on, and the supervisor starts
a new template for the next rollout. A template that stops answering (stopped, deadlocked) is
killed by the supervisor once a start has waited ``TEMPLATE_ANSWER_S`` for its word, with the
same effect (:mod:`rollcage.supervisor.warm`).
"""

from __future__ import annotations

import fcntl
import gc
import locale
import os
import resource
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import rollcage.cage
from rollcage.budgets import attach_mounts, clone_mounts, mount_tmpfs
from rollcage.cage import (
    CAGE_ENV,
    JOIN,
    MOUNT_NS,
    PR_SET_PDEATHSIG,
    EntryFailed,
    Limits,
    drop_privileges,
    fork_into,
    prctl,
    setns,
    show_process,
)
from rollcage.forkserver import (
    MAX_PASS_FDS,
    Entered,
    EnterFailed,
    Forked,
    ForkServer,
    Message,
    Unforked,
    WireError,
    WorkerStart,
    decode,
    fill_free_blocks,
    send,
)
from rollcage.procs import hold_cancel_signals, unpack_ancillary

if TYPE_CHECKING:
    from rollcage.tools import ExecutorTemplateLink

__all__ = ["template_main"]

_REQUEST_ROOM = 2 << 20
"""Bytes a start is received with: more than :class:`WorkerStart`'s bound, so one over it is refused."""
_REQUEST_FDS = 3
"""Descriptors of a start before those it passes on: holder pidfd, report socket (``SOCK_SEQPACKET``),
worker.log."""


def template_main(argv: list[str]) -> int:
    """``rollcage template FD PARENT``: serve worker starts on socket ``FD`` until it closes.

    Exits at once if its parent is no longer ``PARENT`` (it would never be told to stop).
    """
    if len(argv) != 2 or not all(word.isdigit() for word in argv):
        sys.stderr.write("rollcage template: started by the supervisor only (FD PARENT), not by hand\n")
        return 2
    global _parent
    fd, parent = int(argv[0]), int(argv[1])
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    _parent = parent
    from rollcage.worker import warm_up

    warm_up()
    # Taken before the freeze, so that it is shared with every fork as the rest of the heap is.
    modules = frozenset(sys.modules)
    gc.collect()
    fill_free_blocks()  # a worker's new objects in pools of its own, not in the holes of the template's
    gc.freeze()
    # Its forks are the supervisor's children (clone_sibling): none is this process's to reap.
    server = ForkServer(socket.socket(fileno=fd), rollcage.cage)
    server.serve(lambda: _serve(server, modules))
    return 0


def _serve(server: ForkServer, modules: frozenset[str]) -> bool:
    """Take one start off the control socket and fork its worker; ``False`` once the socket has ended."""
    try:
        # Room for one descriptor more than a start carries: more is MSG_CTRUNC, refused. Close-on-exec
        # from the first instant: the executor template, spawned during a start (_link), must not inherit
        # them (its copy of the report socket kept a worker that died silent from ending its start); the
        # worker is forked and makes its passed ones inheritable itself.
        data, ancillary, flags, _ = server.control.recvmsg(
            _REQUEST_ROOM,
            socket.CMSG_SPACE(4 * (_REQUEST_FDS + MAX_PASS_FDS + 1)),
            socket.MSG_CMSG_CLOEXEC,
        )
    except InterruptedError:
        return True
    fds, _ = unpack_ancillary(ancillary)
    if not data and not fds:
        return False
    try:
        request: Message | WireError = decode(data, fds, flags, expect=[WorkerStart])
    except WireError as exc:
        request = exc
    try:
        if isinstance(request, WorkerStart):
            _start(server, request, fds, modules=modules)
        elif len(fds) >= _REQUEST_FDS:
            # Nothing is forked: the supervisor hears why on the start's report socket.
            _report(fds[1], Unforked(reason=f"a malformed start: {request}"))
    finally:
        for received in fds:
            os.close(received)
    return True


def _report(channel: int, message: Message, fds: list[int] | None = None) -> bool:
    """One message on the report socket (never blocks: one short message on a socket of its own); sent?

    The template says :class:`Forked` (with a pidfd) or :class:`Unforked`; the worker
    :class:`Entered` (with the tmpfs roots) or :class:`EnterFailed`.
    """
    try:
        with socket.socket(fileno=os.dup(channel)) as sock:
            send(sock, message, fds or [], socket.MSG_DONTWAIT)
    except OSError:
        return False
    return True


def _say(fd: int, text: str) -> None:
    try:
        os.write(fd, text.encode(errors="replace"))
    except OSError:
        pass


_executors: ExecutorTemplateLink | None = None
"""The executor template beside this one (started with the first worker that can use it)."""

_parent = 0
"""The supervisor's PID (this process's parent, and every worker's)."""

_RLIMITS = tuple(getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_"))
"""Every per-process limit: an uncaged worker takes the supervisor's, as a cold one inherits them."""


def _start(server: ForkServer, request: WorkerStart, fds: list[int], *, modules: frozenset[str]) -> None:
    """Fork the worker into the holder's PID namespace as the supervisor's child; hand over a pidfd of it.

    Not root (:attr:`WorkerStart.userns`), this process may not join the cage's PID namespace (that
    needs ``CAP_SYS_ADMIN`` in its own user namespace), nor come back from the cage's user namespace
    once joined: it forks a go-between instead, which does both for good and forks the worker
    (:func:`_go_between`), and hands over a pidfd of the go-between. Either way the worker's
    executors are forked by the executor template (:func:`_link`).
    """
    holder, report, log, *passed = fds
    env = _worker_environment(request)
    through = request.userns
    channel = _link(request, env)
    try:
        # An uncaged worker (--sandbox none) is born here, beside its holder: no namespace to join; nor is
        # a go-between, which joins them all itself.
        why = server.join(holder) if request.caged and not through else None
        if why is not None:
            _report(report, Unforked(reason=f"cannot enter the sandbox's PID namespace: {why}"))
            return
        # The worker is born with SIGTERM and SIGINT held until its handlers are in place: one sent while
        # it enters its cage cancels the rollout then, instead of killing it with no result (a go-between
        # passes them on held).
        mask = hold_cancel_signals()
        try:
            pid, pidfd = server.fork(sibling=True)
        except OSError as exc:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            what = "the warm start's go-between" if through else "the worker"
            _report(report, Unforked(reason=f"cannot fork {what}: {exc}"))
            return
        if pid == 0:
            server.control.close()
            (_go_between if through else _enter)(
                request,
                env,
                holder=holder,
                report=report,
                log=log,
                passed=passed,
                modules=modules,
                channel=channel,
            )
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the template's own again
    finally:
        if channel >= 0:
            # The worker's copy is its own (it gone, or never forked: the executor template sees the end).
            os.close(channel)
    # The supervisor reaps the worker (or the go-between, which names the worker) by this pidfd: until
    # it does, the zombie holds the sandbox's PID namespace (and so bwrap) open. It reads this message
    # before it lets go of the socket.
    _report(report, Forked(pid=pid, go_between=through), [pidfd])
    os.close(pidfd)


def _go_between(
    request: WorkerStart,
    env: dict[str, str],
    *,
    holder: int,
    report: int,
    log: int,
    passed: list[int],
    modules: frozenset[str],
    channel: int,
) -> NoReturn:
    """The go-between of a non-root start, the supervisor's child: move into the rollout's cgroups, join
    every namespace of the holder at once, take its root, fork the worker there as the supervisor's
    child, name it, exit.

    It needs no privilege: the template's uid owns the cage's (outer) user namespace, so it holds
    every capability there, and joining the holder's user namespace with the rest at once (one
    ``setns`` on the pidfd) is allowed to it as it is to root (:func:`rollcage.cage.fork_into`, the
    executor template's go-between's entry too). The PID namespace takes effect for its child, the
    worker, born in the cage as a cold worker is.
    """
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        try:
            for path in request.cgroups:
                # Here, with the host's view of the cgroup tree: the worker is born in them.
                procs = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(procs, b"0")
                finally:
                    os.close(procs)
        except OSError as exc:
            raise EntryFailed("move into the rollout's cgroups", exc, refused=False) from exc
        pid, pidfd = fork_into(holder, cage="sandbox", child="the worker")
    except BaseException as exc:
        _say(log, f"rollcage: the warm start could not enter its cage: {exc}\n")
        refused = isinstance(exc, EntryFailed) and exc.refused
        _report(report, Unforked(reason=str(exc), refused=refused))
        os._exit(1)
    if pid == 0:
        _enter(
            request,
            env,
            holder=holder,
            report=report,
            log=log,
            passed=passed,
            modules=modules,
            channel=channel,
        )
    _report(report, Forked(pid=pid), [pidfd])
    os._exit(0)


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


def _link(request: WorkerStart, env: dict[str, str]) -> int:
    """The worker's socket to the executor template, if its executors can be forked there; else -1.

    ``env`` is the worker's environment (:func:`_worker_environment`), its executors' too.
    """
    if request.env.get(CAGE_ENV, "none") == "none":
        return -1  # no executor's cage to fork into
    global _executors
    if _executors is None:
        # Here, not at the top: the tools
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
        userns=request.userns,
    )


def _worker_environment(request: WorkerStart) -> dict[str, str]:
    """The environment the worker runs with: the request's, and what a cold worker's start adds to it."""
    return {**request.env, **_coerced_locale(request.env)}


def _enter(
    request: WorkerStart,
    env: dict[str, str],
    *,
    holder: int,
    report: int,
    log: int,
    passed: list[int],
    modules: frozenset[str],
    channel: int,
) -> NoReturn:
    """The worker, born in the cage's PID namespace: move into its cgroups, join the cage, report, run.

    ``passed``: the start's descriptors for :attr:`WorkerStart.pass_fds`, in its order. Uncaged
    (``--sandbox none``), it only takes the cold worker's parent-death signal and reports.
    """
    if not request.caged:
        _enter_uncaged(request, env, report=report, log=log, passed=passed, modules=modules)
    if request.userns:
        # Its go-between moved it into its cgroups and joined the cage for it: it is there.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _report(report, Entered())
        _become_worker(request, env, log=log, passed=passed, modules=modules, channel=channel)
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
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
        # A mount refused: the supervisor mounts on the host for its next rollouts instead.
        _report(report, EnterFailed(reason=str(exc), mount=isinstance(exc, _MountRefused)))
        os._exit(1)
    # The supervisor measures the tmpfs through these roots, whoever outlives whom.
    _report(report, Entered(), roots)
    _become_worker(request, env, log=log, passed=passed, modules=modules, channel=channel)


def _enter_uncaged(
    request: WorkerStart,
    env: dict[str, str],
    *,
    report: int,
    log: int,
    passed: list[int],
    modules: frozenset[str],
) -> NoReturn:
    """The worker without a cage: the supervisor's child, dying with it as a cold worker does."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # As setpriv --pdeathsig gives a cold worker: killed when the supervisor's thread that
        # started this template ends (the thread that spawns the cold worker; see
        # rollcage.supervisor.launch: one template per such thread). Checked after it is set: a
        # parent gone before would never send it.
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != _parent:
            os._exit(1)
    except BaseException as exc:
        _say(log, f"rollcage: the warm worker could not start: {exc}\n")
        _report(report, EnterFailed(reason=str(exc), mount=False))
        os._exit(1)
    _report(report, Entered())
    _become_worker(request, env, log=log, passed=passed, modules=modules, channel=-1)


class _MountRefused(OSError):
    """A bounded tmpfs could not be mounted in the cage."""


def _mount_scratch(request: WorkerStart) -> list[int]:
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
    request: WorkerStart,
    env: dict[str, str],
    *,
    log: int,
    passed: list[int],
    modules: frozenset[str],
    channel: int,
) -> NoReturn:
    """The worker, in its cage: become what a cold start runs, then run it."""
    out = log
    try:
        # The supervisor knows a rollout's processes by the token in their environment, and people
        # know a worker by its command line: not the template's, which a fork would show.
        show_process([sys.executable, "-m", "rollcage", "worker", *request.argv], request.env)
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        out = 2
        # Before the cage's limits: a number a cold worker inherits may lie past its RLIMIT_NOFILE,
        # which refuses a new descriptor there, not an inherited one.
        channel = _place(passed, request.pass_fds, channel)
        # Kept: the passed descriptors, and the worker's socket to the executor template
        # (see rollcage.tools._forked); every other one is closed.
        _close_all_but({*request.pass_fds, *([channel] if channel >= 0 else [])})
        if request.caged:
            drop_privileges(request.uid, request.gid)
            Limits(**request.limits).apply()
        else:
            # The supervisor's limits as they are now (a cold worker inherits them; they may have
            # changed since this template started: the open-file limit is raised under load).
            for which in _RLIMITS:
                resource.setrlimit(which, resource.prlimit(_parent, which))
        os.umask(request.umask)
        if channel >= 0:
            from rollcage.tools import adopt_executor_template

            adopt_executor_template(channel)
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


def _place(passed: list[int], numbers: list[int], channel: int) -> int:
    """Put each of ``passed`` at its number of ``numbers``, inheritable as a cold start's worker holds
    it; where the executor template's ``channel`` is then (moved if it stood at one of them).

    Each descriptor is first moved above every number involved, so that putting one in place never
    closes another still to be placed (a number may be the place of another received descriptor).
    """
    floor = max([2, channel, *numbers, *passed]) + 1
    if channel in numbers:
        inheritable = os.get_inheritable(channel)
        channel = fcntl.fcntl(channel, fcntl.F_DUPFD_CLOEXEC, floor)
        os.set_inheritable(channel, inheritable)
    lifted = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, floor) for fd in passed]
    for fd, number in zip(lifted, numbers, strict=True):
        os.dup2(fd, number, inheritable=True)
    for fd in lifted:
        os.close(fd)
    return channel


def _close_all_but(kept: set[int]) -> None:
    """Close every descriptor from 3 up but ``kept``."""
    low = 3
    for fd in sorted(kept):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 20)
