"""Warm worker starts, the supervisor's side: the template process and one start's pipes.

See :mod:`rollcage.warm` for what the template does with a request. Here:

* :class:`Template`: one per supervising process and bytecode cache, started on
  first use (its imports overlap the first cage's making), started again when it
  has died, killed and started again when it stops answering (:data:`TEMPLATE_ANSWER_S`);
* the *keeper*: one daemon thread per process (``rollcage-template-keeper``) that starts
  every process-wide template. A template dies with the thread that started it
  (``PR_SET_PDEATHSIG``), and a rollout's thread may be short-lived (on a Ray node each
  rollout runs on a thread of its own): started by the keeper, a template lives as long
  as the process and serves every rollout in it. :func:`stop_templates` stops the keeper
  too. ``--sandbox none``'s templates stay their thread's (the uncaged worker's
  parent-death signal is the starting thread's, as a cold worker's is the rollout's);
  those of threads that ended are closed by the next :func:`template_for`;
* :class:`WarmStart`: one rollout's start, on two channels of its own: the holder's
  socket (its stdin and stdout: it announces itself there, and the worker's exit
  status goes back there), and the report socket on which the template hands over
  a pidfd of the worker (this process's child, born in the cage) and the worker
  says it is in its cage. With the template's socket (shared) and the worker's to
  the executor template (:mod:`rollcage.tools._forked`), a start takes four channels.

Every message is one of :mod:`rollcage.forkserver`'s, through its one codec.

The holder's PID comes from the kernel (``SO_PASSCRED``: the credentials of the
process that wrote the byte, translated to this PID namespace), and is checked by
the rollout's token in its environment before a pidfd of it goes to the
template; the worker is named by a pidfd the kernel made at its fork
(``CLONE_PIDFD``), never by a number.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from rollcage.errors import SupervisorError
from rollcage.forkserver import (
    Entered,
    EnterFailed,
    Forked,
    Message,
    Unforked,
    WireError,
    WorkerStart,
    encode,
    receive_now,
)
from rollcage.procs import (
    ChildProcess,
    PidfdChild,
    PidHandle,
    environ_has,
    read_proc,
    reap_abandoned,
    receive_message,
    release_cancel_signals,
    signal_name,
    wait_readable,
    within,
)

__all__ = [
    "Template",
    "WarmStart",
    "cage_mounts",
    "refuse_cage_mounts",
    "refuse_userns",
    "stop_templates",
    "template_for",
    "userns_entry",
]

logger = logging.getLogger("rollcage.supervisor")

_REPORTS = (Forked, Unforked, Entered, EnterFailed)
"""What a start's report socket carries: the template's word on it, then the worker's."""

_GO_BETWEEN_EXIT_S = 5.0
"""How long a non-root start waits for its go-between to exit once it has spoken (it exits at once)."""

TEMPLATE_ANSWER_S = 30.0
"""How long a start waits for the template's word on it (:class:`Forked` or :class:`Unforked`), whatever the
rollout's deadline: it answers in milliseconds once its imports are done (a second or two under load).
A template that says nothing for this long is hung (stopped, deadlocked): it is killed and started
again, and the start fails as the infrastructure's (``infra_failure``, retried), for no worker ran."""

KEEPER_NAME = "rollcage-template-keeper"
"""The name of the thread that starts this process's templates (:class:`_Keeper`)."""
_KEEPER_ANSWER_S = 60.0
"""How long a caller waits for the keeper to start a template (milliseconds when all is well: a spawn)."""

templates_started = 0
"""How many template processes this process has started (a counter for benchmarks and logs)."""
_counter_lock = threading.Lock()

T = TypeVar("T")


class _Keeper:
    """This process's template keeper: a daemon thread that runs what it is handed, one at a time.

    A template started from it has it as its parent thread, so the template's parent-death signal
    fires when the keeper ends (with the process, or :meth:`stop`), not when a rollout's thread
    does. It lets SIGTERM and SIGINT go, whatever the thread that made it held: a template, and so
    every worker it forks, inherits its mask, and a worker must be able to be stopped politely
    (Ray blocks SIGINT in its worker processes; a rollout's thread there lets it go, see
    :mod:`rollcage.controller._ray`).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[object]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._serve, name=KEEPER_NAME, daemon=True)
        self._thread.start()

    def call(
        self, job: Callable[[], T], *, late: Callable[[T], None], timeout_s: float = _KEEPER_ANSWER_S
    ) -> T:
        """Run ``job`` on the keeper's thread and return what it returned (blocking, briefly).

        ``late`` is given what ``job`` returns after the caller gave up on it (to close it).

        Raises:
            SupervisorError: The keeper did not run it within ``timeout_s``.
            Exception: What ``job`` raised.
        """
        if threading.current_thread() is self._thread:
            return job()
        future: Future[object] = Future()
        self._jobs.put((job, future))
        try:
            return future.result(timeout=timeout_s)  # type: ignore[return-value]
        except TimeoutError:
            if not future.cancel():  # running: what it starts is closed when it is done

                def _late(done: Future[object]) -> None:
                    if not done.cancelled() and done.exception() is None:
                        late(done.result())  # type: ignore[arg-type]

                future.add_done_callback(_late)
            raise SupervisorError(f"the template keeper started nothing within {timeout_s:g} s") from None

    def stop(self, timeout_s: float = _KEEPER_ANSWER_S) -> None:
        """End the thread (its templates get their parent-death signal) and wait for it."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        release_cancel_signals()
        while (item := self._jobs.get()) is not None:
            job, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as exc:
                future.set_exception(exc)


_keeper: _Keeper | None = None
_keeper_lock = threading.Lock()


def _the_keeper() -> _Keeper:
    """This process's keeper, started on first use (again in a forked child: threads do not fork)."""
    global _keeper
    with _keeper_lock:
        if _keeper is None or _keeper.pid != os.getpid():
            _keeper = _Keeper()
        return _keeper


def _stop_keeper() -> None:
    global _keeper
    with _keeper_lock:
        keeper, _keeper = _keeper, None
    if keeper is not None and keeper.pid == os.getpid():
        keeper.stop()


def _close_late(started: tuple[socket.socket, ChildProcess]) -> None:
    """Close a template the keeper started after its caller gave up waiting."""
    ours, process = started
    ours.close()
    process.kill_alone()


class Template:
    """The template process for one bytecode cache (see :mod:`rollcage.warm`).

    Args:
        bytecode: The compiled bytecode cache the template (and so every worker) reads
            its ``.pyc`` files from; ``None``: none.
        owner: The thread whose template this is: started from it, it dies with it (``--sandbox
            none``: see :func:`template_for`); ``None``: the process's, started by the keeper.
    """

    def __init__(self, bytecode: str | None, *, owner: threading.Thread | None = None) -> None:
        self.bytecode = bytecode
        self._owner = None if owner is None else weakref.ref(owner)
        self._lock = threading.Lock()
        self._process: ChildProcess | None = None
        self._socket: socket.socket | None = None

    def owner_alive(self) -> bool:
        """Whether the thread it belongs to still runs (always, for the process's)."""
        if self._owner is None:
            return True
        owner = self._owner()
        return owner is not None and owner.is_alive()

    def _ensure(self) -> tuple[socket.socket, int]:
        """The live template's socket and PID, starting one if there is none (blocking, but quick)."""
        with self._lock:
            if self._process is not None and self._process.poll() is None and self._socket is not None:
                return self._socket, self._process.pid
            self._close_locked()
            # The process's template is the keeper's child: it outlives the thread asking for it.
            if self._owner is not None:
                ours, process = self._spawn()
            else:
                ours, process = _the_keeper().call(self._spawn, late=_close_late)
            self._socket, self._process = ours, process
            return ours, process.pid

    def _spawn(self) -> tuple[socket.socket, ChildProcess]:
        """Start a template process from this thread (it dies with it); our end of its socket, and it."""
        global templates_started
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        prefix = ["-X", f"pycache_prefix={self.bytecode}"] if self.bytecode is not None else []
        argv = [sys.executable, "-I", "-B", *prefix, "-m", "rollcage", "template"]
        try:
            process = ChildProcess.spawn(
                [*argv, str(theirs.fileno()), str(os.getpid())],
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
                cwd="/",
                stdout=subprocess.DEVNULL,
                # Its own failures (an import that breaks) are the supervisor's to see: its stderr.
                stderr=2,
                pass_fds=(theirs.fileno(),),
            )
        except OSError as exc:
            ours.close()
            raise SupervisorError(f"cannot start the warm worker template ({sys.executable}): {exc}") from exc
        finally:
            theirs.close()
        with _counter_lock:
            templates_started += 1
            count = templates_started
        logger.debug(
            "started the warm worker template (PID %d, %s; %d in this process)",
            process.pid,
            "its thread's" if self._owner is not None else "the process's",
            count,
        )
        return ours, process

    def start(self) -> None:
        """Start the template now if none runs (blocking, a few ms: its imports go on by themselves).

        The template dies with the *thread* that started it (``PR_SET_PDEATHSIG``): the process's
        is started by the keeper, whatever thread asks; a thread's own (``owner``) from that
        thread, which must be the one calling.
        """
        self._ensure()

    async def send(self, request: WorkerStart, fds: Sequence[int]) -> int:
        """Hand one start to the template; a dead template is started again, once. The PID of the
        template that took it (for :meth:`replace`).

        From the event loop, never blocking it: the descriptors are the caller's to close
        afterwards, so the send is never left running in a thread.

        Raises:
            SupervisorError: No template could take it.

        **Cancellation:** a message is sent whole or not at all; the descriptors stay the caller's.
        """
        data = encode(request)
        for attempt in (1, 2):
            sock, pid = self._ensure()
            try:
                while True:
                    try:
                        socket.send_fds(sock, [data], list(fds), socket.MSG_DONTWAIT)
                        return pid
                    except BlockingIOError:
                        # Its queue is full (many starts at once): rare and brief. Not add_writer:
                        # rollouts of one loop share the socket, and a second writer would replace the first.
                        await asyncio.sleep(0.002)
            except OSError as exc:
                if attempt == 2:
                    raise SupervisorError(f"the warm worker template refused a start: {exc}") from exc
                with self._lock:
                    self._close_locked()
        raise AssertionError("unreachable: the second attempt returns or raises")

    @property
    def pid(self) -> int | None:
        """The template's PID while it runs."""
        process = self._process
        return process.pid if process is not None and process.poll() is None else None

    def close(self) -> None:
        """Stop the template (its in-flight starts fail; their holders exit with 125)."""
        with self._lock:
            self._close_locked()

    def replace(self, pid: int) -> bool:
        """Kill the template ``pid`` if it is still this one's (a hung one: SIGKILL ends a stopped
        process too) and reap it; the next start starts another. Whether it was.

        Its starts not forked yet fail at once (their report sockets end with it); workers it
        forked are not its children and go on. A template started since (by another rollout
        that found this one dead) is left alone.
        """
        with self._lock:
            if self._process is None or self._process.pid != pid:
                return False
            self._close_locked()
            return True

    def _close_locked(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        process, self._process = self._process, None
        if process is not None:
            # The template alone: a worker it forked may still be in its group, not yet in a session
            # of its own, and goes on.
            process.kill_alone()


_cage_mounts_refused: list[str] = []


def refuse_cage_mounts(reason: str) -> None:
    """Have the later warm starts of this process mount ``/tmp`` and ``/dev/shm`` on the host."""
    if not _cage_mounts_refused:
        logger.warning(
            "a warm start could not mount /tmp and /dev/shm in its cage (%s); they are mounted on the host "
            "from now on",
            reason,
        )
        _cage_mounts_refused.append(reason)


def cage_mounts() -> bool:
    """Whether warm starts mount the cage's ``/tmp`` and ``/dev/shm`` inside it (none here was refused)."""
    return not _cage_mounts_refused


_userns_refused: list[str] = []


def refuse_userns(reason: str) -> None:
    """Have this process's later non-root starts be cold: the kernel refused a warm one's entry into
    its cage (no unprivileged user namespaces to join, a seccomp filter, ...). One warning."""
    if not _userns_refused:
        logger.warning(
            "a warm start could not enter its cage without root (%s); this process starts its workers cold "
            "from now on",
            reason,
        )
        _userns_refused.append(reason)


def userns_entry() -> bool:
    """Whether non-root warm starts may be tried here (none was refused by the kernel in this process)."""
    return not _userns_refused


_templates: dict[tuple[int, str | None, int | None], Template] = {}
_templates_lock = threading.Lock()


def template_for(bytecode: str | None, *, thread: int | None = None) -> Template:
    """This process's template for ``bytecode`` (one per process: a forked child gets its own),
    started by the keeper so that it outlives the thread that asks (see :class:`_Keeper`).

    ``thread``: one of that thread's own (started by it: its forks die with it, see
    :meth:`Template.start`), for workers that take a parent-death signal (``--sandbox none``).
    The templates of threads that have ended (killed with them) are closed here, so that a
    later thread given the same identifier gets a template of its own.
    """
    key = (os.getpid(), bytecode, thread)
    with _templates_lock:
        ended = [k for k, t in _templates.items() if k[0] == key[0] and not t.owner_alive()]
        gone = [_templates.pop(k) for k in ended]
        template = _templates.get(key)
        if template is None:
            owner = None if thread is None else _thread_of(thread) or threading.current_thread()
            template = _templates[key] = Template(bytecode, owner=owner)
    for dead in gone:
        # Killed with its thread, or here if it outran its parent-death signal (set once it runs);
        # reaped either way.
        dead.close()
    return template


def _thread_of(ident: int) -> threading.Thread | None:
    """The running thread ``ident`` names (the caller's, as a rule)."""
    current = threading.current_thread()
    if current.ident == ident:
        return current
    return next((t for t in threading.enumerate() if t.ident == ident), None)


def stop_templates() -> int:
    """Stop this process's templates and its keeper (blocking; a later warm start starts them again);
    how many templates ran.

    A template dies with its parent anyway; this is for a caller that goes on (a
    controller whose run has ended) and should leave no helper process or thread behind.
    """
    with _templates_lock:
        mine = [key for key in _templates if key[0] == os.getpid()]
        templates = [_templates.pop(key) for key in mine]
    running = 0
    for template in templates:
        running += template.pid is not None
        template.close()
    _stop_keeper()
    return running


class _Reports:
    """One start's report socket (``SOCK_SEQPACKET``): the template's word and the worker's.

    The template says :class:`Forked` with a pidfd of the worker (or :class:`Unforked`: there is
    none); the worker says :class:`Entered` with the roots of the tmpfs it mounted, or
    :class:`EnterFailed`. Each message comes with its sender's credentials (``SO_PASSCRED``), so a
    worker whose template died before it spoke is known all the same: it is this process's child
    until reaped, so its PID is safe. A datagram that is not one of these (the codec refuses it)
    is a failed start, in its words.
    """

    def __init__(self) -> None:
        self.sock, self.end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.setblocking(False)
        self.worker: PidfdChild | None = None
        self.verdict: Message | WireError | None = None
        """The start's outcome: :class:`Entered`, or why not (:class:`EnterFailed`, :class:`Unforked`,
        a :class:`~rollcage.forkserver.WireError`)."""
        self.roots: list[int] = []
        self.go_between: PidfdChild | None = None
        """A non-root start's go-between (:attr:`~rollcage.forkserver.Forked.go_between`): this
        process's child, reaped once it has named the worker (:meth:`release_go_between`)."""
        self.template_spoke = False
        """Whether the worker's forker spoke (the template, or its go-between for a non-root start)."""
        self.ended = False

    @property
    def settled(self) -> bool:
        """Whether every worker the start may have forked is known (the template spoke, or all are gone)."""
        return self.template_spoke or self.ended

    @property
    def entered(self) -> bool:
        """Whether the worker said it stands in its cage."""
        return isinstance(self.verdict, Entered)

    def failure(self) -> tuple[str, bool] | None:
        """Why the start failed, in the words it was given, and whether a mount was refused; ``None``:
        no word of failure (yet)."""
        verdict = self.verdict
        if isinstance(verdict, EnterFailed):
            return verdict.reason, verdict.mount
        if isinstance(verdict, Unforked):
            return verdict.reason, False
        if isinstance(verdict, WireError):
            return f"a malformed report: {verdict}", False
        return None

    async def until(self, done: Callable[[], bool]) -> bool:
        """Read messages until ``done()`` or the socket's end; ``True``.

        **Cancellation:** what was read stays read.
        """
        while not done() and not self.ended:
            await wait_readable(self.sock.fileno())
            self.receive()
        return True

    def receive(self) -> None:
        """Take the messages waiting now (never blocks)."""
        while not self.ended and self.sock.fileno() >= 0:
            try:
                got = receive_now(self.sock, _REPORTS, credentials=True)
            except BlockingIOError:
                return
            except OSError:
                self.ended = True
                return
            if got.ended:
                self.ended = True
                return
            self._take(got.message, got.error, list(got.fds), got.sender)

    def _take(self, message: Message | None, error: WireError | None, fds: list[int], sender: int) -> None:
        if isinstance(message, Forked) and message.go_between:
            # Not the worker: the go-between forks it and speaks for it next (or dies, and the socket ends).
            if self.go_between is None:
                self.go_between = PidfdChild(message.pid, fds.pop(0))
            for fd in fds:
                os.close(fd)
            return
        if isinstance(message, Forked | Unforked):
            self.template_spoke = True
        if isinstance(message, Forked) and self.worker is None:
            self.worker = PidfdChild(message.pid, fds.pop(0))
        elif isinstance(message, Entered | EnterFailed) and self.worker is None and sender:
            self.worker = PidfdChild.of_child(sender)  # its template died before it spoke
        if self.verdict is None:
            if isinstance(message, Entered):
                self.verdict, self.roots, fds = message, self.roots + fds, []
            elif isinstance(message, EnterFailed | Unforked):
                self.verdict = message
            elif error is not None:
                self.verdict = error
        for fd in fds:
            os.close(fd)

    async def release_go_between(self) -> None:
        """Reap the go-between once it has spoken (it exits at once); kill and leave it to
        :func:`~rollcage.procs.reap_abandoned` if it has not, or is slow to go.

        **Cancellation:** the go-between is abandoned (killed, reaped later).
        """
        go_between, self.go_between = self.go_between, None
        if go_between is None:
            return
        try:
            if self.template_spoke and await within(_exit_of(go_between), _GO_BETWEEN_EXIT_S):
                go_between.reap()
        finally:
            if not go_between.reaped:
                go_between.abandon()

    def close(self) -> None:
        """Close the socket and the roots not taken (idempotent)."""
        if self.go_between is not None:
            self.go_between.abandon()
            self.go_between = None
        self.sock.close()
        self.end.close()
        for fd in self.roots:
            os.close(fd)
        self.roots = []


async def _exit_of(child: PidfdChild) -> bool:
    """``True`` once ``child`` has exited (for :func:`~rollcage.procs.within`: ``None`` is its timeout)."""
    await child.wait()
    return True


_unsettled: list[_Reports] = []
_unsettled_lock = threading.Lock()


def _settle_later(reports: _Reports) -> None:
    """Keep a start's report socket whose template has not spoken yet: a later start reads it."""
    with _unsettled_lock:
        _unsettled.append(reports)


def _settle_leftovers() -> None:
    """Read the kept report sockets: end each worker they name (so its PID namespace can end)."""
    with _unsettled_lock:
        for reports in list(_unsettled):
            reports.receive()
            if reports.worker is not None:
                reports.worker.abandon()
                reports.worker = None
            if reports.settled:
                _unsettled.remove(reports)
                reports.close()
    reap_abandoned()


def _silence(worker: PidfdChild | None) -> str:
    """Why a start heard nothing from its worker, as far as this process can tell (for its failure)."""
    if worker is None:
        return "the template named no worker"
    code = worker.exited()
    if code is None:
        return "its worker was still running"
    if code > 128:
        return f"its worker was killed by {signal_name(code - 128)} before it spoke"
    return f"its worker exited with {code} before it spoke"


class WarmStart:
    """One rollout's warm start: the sockets bwrap's holder, the template and the worker speak on.

    Make it before bwrap is spawned; give bwrap :attr:`holder_stdin` and :attr:`holder_stdout`
    (one socket: the holder announces itself on it, and reads the worker's exit status back),
    call :meth:`spawned` once it is, then :meth:`start`, then :meth:`relay` until the worker
    exits. :meth:`close` in every case: our end of the holder's socket closed without a status
    makes the holder exit (125: no worker).

    Args:
        passed: Descriptors the worker inherits, for the request's
            :attr:`~rollcage.forkserver.WorkerStart.pass_fds` (a harness rollout's relay to the
            supervisor). They stay the caller's: the start holds copies of its own until it has
            sent them to the template (or :meth:`close`), so that the reader sees their end once
            the worker's copies are gone, started or not.
    """

    def __init__(self, passed: Sequence[int] = ()) -> None:
        _settle_leftovers()
        self._passed: list[int] = []
        self._holder_sock, self._holder_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._holder_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._holder_sock.setblocking(False)
        self._reports = _Reports()
        self._handed_over = False
        self.failure: str | None = None
        """Why the worker was not started, in words (its holder then exits with 125)."""
        self.mount_refused = False
        """The start failed because a tmpfs could not be mounted in the cage."""
        self.refused = False
        """The start failed in words (the template, its go-between or the worker said why), before
        any worker ran: a holder that can run the cold worker may."""
        self.kernel_refused = False
        """The kernel refused a non-root start's entry into its cage (:attr:`Unforked.refused`)."""
        try:
            for fd in passed:
                self._passed.append(os.dup(fd))  # close-on-exec: no bwrap spawned meanwhile inherits it
        except OSError:
            self.close()
            raise

    @property
    def holder_stdin(self) -> int:
        """The descriptor bwrap is given as stdin: the holder reads the worker's exit status on it."""
        return self._holder_end.fileno()

    @property
    def holder_stdout(self) -> int:
        """The descriptor bwrap is given as stdout: the holder announces itself on it (the same socket)."""
        return self._holder_end.fileno()

    def spawned(self) -> None:
        """bwrap holds its end now: close ours."""
        self._holder_end.close()

    async def start(
        self, template: Template, request: WorkerStart, *, log_fd: int, marked: str, timeout_s: float
    ) -> PidHandle | None:
        """Wait for the holder, have the template fork the worker into its cage; the worker's handle.

        ``None`` when there is no worker: the holder never came (bwrap failed: its words are in
        the log), or the start failed (:attr:`failure` says why; the holder exits with 125).

        **Cancellation:** nothing is left running that :meth:`close` does not end.
        """
        reports = self._reports
        deadline = time.monotonic() + timeout_s
        holder = await self._holder(marked, timeout_s)
        if holder is None:
            return None
        try:
            try:
                pid = await template.send(request, [holder.fd, reports.end.fileno(), log_fd, *self._passed])
                self._handed_over = True  # sent whole: a worker may be forked from now on
            except SupervisorError as exc:
                self.failure = str(exc)
                return None
            finally:
                # The template holds its own copy now: once it and the worker are done, the report ends.
                reports.end.close()
                self._close_passed()
            if await self._answered(template, pid, deadline - time.monotonic()):
                left = deadline - time.monotonic()
                if await within(reports.until(lambda: reports.verdict is not None), left) is None:
                    self.failure = "the warm start did not report in time"
        finally:
            holder.close()
            await reports.release_go_between()
        if not reports.entered or reports.worker is None:
            self.refused = isinstance(reports.verdict, Unforked | EnterFailed)
            self.kernel_refused = isinstance(reports.verdict, Unforked) and reports.verdict.refused
            words, self.mount_refused = reports.failure() or (
                f"no report ({_silence(reports.worker)})",
                False,
            )
            self.failure = self.failure or f"the warm start failed: {words}"
            return None
        return reports.worker.handle()

    async def _answered(self, template: Template, pid: int, timeout_s: float) -> bool:
        """Wait for the template's word on this start, up to :data:`TEMPLATE_ANSWER_S` or ``timeout_s``
        (the rollout's time left), whichever is shorter; whether it came (or the report ended: the
        template died, and the start failed). If not, :attr:`failure` says why.

        A template that says nothing within :data:`TEMPLATE_ANSWER_S` is hung: it is replaced.

        **Cancellation:** the template is left as it is.
        """
        reports = self._reports
        bound = min(timeout_s, TEMPLATE_ANSWER_S)
        if await within(reports.until(lambda: reports.settled), bound) is not None:
            return True
        if bound < TEMPLATE_ANSWER_S:
            self.failure = "the warm start did not report in time"
        elif reports.go_between is not None:
            # The template answered: its go-between is what hangs (killed with the start).
            self.failure = f"the warm start's go-between did not answer in {TEMPLATE_ANSWER_S:g} s"
        else:
            replaced = template.replace(pid)
            logger.error(
                "the warm worker template (PID %d) did not answer a start in %g s: %s",
                pid,
                TEMPLATE_ANSWER_S,
                "killed, a new one takes the next start" if replaced else "it was replaced already",
            )
            self.failure = (
                f"the warm worker template (PID {pid}) did not answer in {TEMPLATE_ANSWER_S:g} s "
                "(hung): it was killed and replaced; no worker was started"
            )
        return False

    async def _holder(self, marked: str, timeout_s: float) -> PidHandle | None:
        """A verified handle on the holder once it has announced itself; ``None`` if it never did
        (bwrap failed: its words are in the log) or is not this rollout's (:attr:`failure` says so)."""
        holder_pid = await within(self._holder_pid(), timeout_s)
        if holder_pid is None:
            return None
        info = await asyncio.to_thread(read_proc, holder_pid)
        holder = None if info is None else PidHandle.open_checked(info, lambda pid: environ_has(pid, marked))
        if holder is None:
            self.failure = f"the sandbox's holder (PID {holder_pid}) is gone or is not this rollout's"
        return holder

    async def relay(self, *, uncaged: bool = False, cold: bool | None = None) -> bool:
        """Until the worker exits: reap it and pass its exit status to the holder, which exits with it.

        A start that failed passes none (the holder exits with 125), and its worker is killed first.
        An ``uncaged`` holder (:data:`~rollcage.supervisor.sandbox.NONE_HOLDER_SCRIPT`) is told a
        signal apart from a code (``sN``: it dies of it, as its worker did, where no bwrap reports
        it as 128 + N). A holder told ``cold`` (for a start that failed; by default an uncaged one;
        :data:`~rollcage.supervisor.sandbox.USERNS_HOLDER_SCRIPT` when the kernel refused a step)
        runs the cold worker instead: whether it was told.

        **Cancellation:** the worker is left to :meth:`close`.
        """
        reports = self._reports
        if self._handed_over:
            # A worker forked after the start gave up on it is known once the template speaks.
            await reports.until(lambda: reports.settled)
        worker = reports.worker
        if worker is not None:
            if self.failure is not None:
                worker.kill()
            await worker.wait()
            status = worker.reap_status()
            reports.worker = None
            word: int | str | None = None if status is None else status.code
            if uncaged and status is not None and status.signal is not None:
                word = f"s{status.signal}"
            elif status is not None and status.signal is not None:
                word = 128 + status.signal
            if word is not None and self.failure is None:
                with contextlib.suppress(OSError):  # a holder killed already: EPIPE
                    self._holder_sock.send(f"{word}\n".encode())
        told = False
        if (uncaged if cold is None else cold) and self.failure is not None:
            with contextlib.suppress(OSError):
                self._holder_sock.send(b"cold\n")
                told = True
        self._holder_sock.close()
        return told

    def take_roots(self) -> list[int]:
        """The roots of the tmpfs the start mounted in the cage (``O_PATH``; the caller's to close)."""
        roots, self._reports.roots = self._reports.roots, []
        return roots

    def _close_passed(self) -> None:
        passed, self._passed = self._passed, []
        for fd in passed:
            os.close(fd)

    def close(self) -> None:
        """Close every end still ours and end a worker not reaped yet (idempotent)."""
        self._holder_sock.close()
        self._close_passed()
        reports = self._reports
        if not self._handed_over:
            reports.ended = True  # nothing was sent to the template: nothing was forked
        reports.receive()  # a worker forked while the start was being cut short
        if reports.worker is not None:
            reports.worker.abandon()
            reports.worker = None
        if reports.settled:
            reports.close()
        else:
            _settle_later(reports)
        self._holder_end.close()

    async def _holder_pid(self) -> int | None:
        """The PID of the process that wrote the holder's byte; ``None`` if the holder never came."""
        data, _, sender = await receive_message(self._holder_sock, 16, credentials=True)
        return (sender or None) if data else None
