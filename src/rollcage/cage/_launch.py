"""Starting cages from a mount namespace that holds none of the other rollouts' mounts.

Why: as root, every rollout in flight has its bounded workspace (and for a cold
start its ``/tmp`` and ``/dev/shm``) mounted on the host, where a killed
supervisor's successor finds it and keeps the agent's files. But every outer
bubblewrap starts by copying its caller's whole mount table and reads
``/proc/self/mountinfo`` once per bind, so a launch costs more the more rollouts
are in flight elsewhere (``bench/mounts.py`` measures it; the figures are on the
benchmarks page, docs/benchmarks/index.md).

How: one thread of the process, the launcher, keeps the *base*: a private copy of
the host's mount namespace with every rollcage tmpfs (source ``rollcage-...``)
taken out. For each launch it makes a namespace of the launch's own from the base
(``unshare``: a copy of a table of the machine's size, not of the load's), binds
there the launch's own mounts, at the same paths as on the host, from detached
copies of them (:attr:`TmpfsVolume.launch_copy`: the same file systems), starts
the process, and goes back to the base. Nothing on the host changes, and nothing
about the command line: the cage sees what it would have seen, less the mounts of
rollouts that are not its own. The supervisor starts every rollout's sandbox this
way, and :func:`~rollcage.cage.run_contained` every grader's cage.

The base follows the host: a mount made or removed there (other than rollcage's
own tmpfs) is seen by the next launch, since the launcher polls the host's
mount table (``POLLPRI`` on ``mountinfo`` says it changed) and makes the base
again when it differs.

Where any of it is refused (not root; no ``fsmount``, before Linux 5.2; a kernel
that does not let a detached copy be bound, as older ones do not), a launch
happens in the caller's own thread and namespace, as it always did, and the
reason is logged once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import queue
import select
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from rollcage.cage._enter import CLONE_NEWNS, setns

__all__ = ["IDLE_S", "Launcher", "launcher", "release_launcher"]

logger = logging.getLogger("rollcage.cage")

T = TypeVar("T")

_CLONE_FS = 0x00000200
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2
IDLE_S = 10.0
"""How long the launcher keeps its namespaces without a launch: a private copy of the host's mounts
holds their file systems (an unmounted disk stays busy), so an idle one lets go of them."""
_OURS = "rollcage-"
"""The source of every tmpfs rollcage mounts on the host (``rollcage-PID.START``)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _ours(line: str) -> bool:
    """Whether a ``mountinfo`` line is a tmpfs rollcage mounted (a rollout's place, never a launch's need)."""
    _, _, right = line.partition(" - ")
    tail = right.split()
    return len(tail) > 1 and tail[0] == "tmpfs" and tail[1].startswith(_OURS)


def _mount_point(line: str) -> bytes:
    # mountinfo escapes space, tab, newline and backslash as a backslash and three octal digits.
    return line.split()[4].encode(errors="surrogateescape").decode("unicode_escape").encode("latin-1")


def bind_copy(copy: int, path: str) -> None:
    """Bind the detached mount ``copy`` at ``path`` in the caller's mount namespace.

    Raises:
        OSError: The kernel refused (one that does not let a detached copy be bound).
    """
    source = f"/proc/self/fd/{copy}".encode()
    _check(_libc.mount(source, os.fsencode(path), None, _MS_BIND, None), f"bind at {path}")


_Job = tuple["Callable[[], object] | None", Sequence[tuple[int, str]], "concurrent.futures.Future[object]"]
"""(what starts the process, or ``None`` to let go of the namespaces; its binds; its answer)."""


class _Plain:
    """The launcher's answer when it could not make the launch's namespace: start it the plain way."""


_PLAIN = _Plain()


class Launcher:
    """The process's launcher thread and its base namespace (see the module's docstring).

    Made by :func:`launcher`; :meth:`run` and :meth:`release` are safe from any thread. The
    thread never ends before the process (only :meth:`close` ends it): bubblewrap's
    ``--die-with-parent`` watches the thread that started it, not the process.
    """

    def __init__(self, *, idle_s: float = IDLE_S) -> None:
        self.pid = os.getpid()
        self._idle_s = idle_s
        self.plain_reason: str | None = None
        """Why launches go the plain way (``None`` while they need not)."""
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # The thread's alone, made at its first launch and let go by release(): the host's mount
        # namespace and table (through /proc/self: the main thread's, which never changes namespace)
        # and the base.
        self._host_ns: int | None = None
        self._host_table: int | None = None
        self._base: int | None = None
        self._seen: tuple[str, ...] | None = None
        if os.geteuid() != 0:
            self.plain_reason = "not root: only root makes mount namespaces for its launches"
            return
        self._thread = threading.Thread(target=self._serve, name="cage-launcher", daemon=True)
        self._thread.start()

    def release(self, timeout_s: float = 60.0) -> None:
        """Let go of every descriptor and namespace the launcher holds (blocking).

        The thread stays, parked, so what it started keeps its parent; the next launch
        makes them again. For a caller that goes on once its rollouts are over.
        """
        if self._thread is not None:
            future: concurrent.futures.Future[object] = concurrent.futures.Future()
            self._jobs.put((None, (), future))
            future.result(timeout=timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """:meth:`release`, and end the thread: only once nothing it started runs any more (blocking).

        What it started and still runs gets its parent-death signal, if it asked for one.
        """
        self.plain_reason = self.plain_reason or "closed"
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout_s)
            self._thread = None

    def run(
        self,
        start: Callable[[], T],
        binds: Sequence[tuple[int, str]] | None,
        *,
        timeout_s: float,
        late: Callable[[T], None],
    ) -> T:
        """Call ``start`` (which starts a process) in a mount namespace of the base and ``binds``.

        Args:
            start: Starts the process and returns its handle; blocking, short.
            binds: ``(detached copy, host path)`` of every mount the launch needs that the base
                lacks; ``None``: it needs the host's own (start it the plain way).
            timeout_s: How long to wait for the launcher thread.
            late: Called with what ``start`` returned if that comes after ``timeout_s`` (kill it).

        Raises:
            TimeoutError: The launcher thread did not answer in time.
        """
        if binds is None or self.plain_reason is not None:
            return start()
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        self._jobs.put((start, binds, future))
        try:
            answer = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:

            def _late(done: concurrent.futures.Future[object]) -> None:
                if done.exception() is None and not isinstance(done.result(), _Plain):
                    late(done.result())  # type: ignore[arg-type]

            future.add_done_callback(_late)
            raise TimeoutError(f"the launcher thread started nothing within {timeout_s:g} s") from None
        if isinstance(answer, _Plain):
            return start()
        return answer  # type: ignore[return-value]

    # ------------------------------------------------------------------ the launcher thread

    def _give_up(self, reason: str) -> None:
        if self.plain_reason is None:
            self.plain_reason = reason
            logger.info("cages start from the host's mount namespace: %s", reason)

    def _serve(self) -> None:
        try:
            # The thread's own root and working directory, so that it alone may change namespace.
            _check(_libc.unshare(_CLONE_FS), "unshare(CLONE_FS)")
        except OSError as exc:
            self._give_up(str(exc))
        # Nothing may end this loop but close(): the thread's end would kill what it started.
        while True:
            try:
                job = self._jobs.get(timeout=self._idle_s if self._host_ns is not None else None)
            except queue.Empty:
                with contextlib.suppress(Exception):
                    self._let_go()
                continue
            if job is None:
                break
            start, binds, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._do(start, binds))
            except BaseException as exc:
                future.set_exception(exc)
        with contextlib.suppress(Exception):
            self._let_go()

    def _do(self, start: Callable[[], object] | None, binds: Sequence[tuple[int, str]]) -> object:
        """One job of the thread's: a release (``start`` is ``None``) or a launch."""
        if start is None:
            self._let_go()
            return None
        if self.plain_reason is not None:
            return _PLAIN
        try:
            self._enter(binds)
        except Exception as exc:
            self._give_up(f"a launch's namespace could not be made: {exc}")
            self._leave()
            return _PLAIN
        try:
            return start()
        finally:
            self._leave()

    def _let_go(self) -> None:
        # Into the host's namespace: the base then goes with its descriptor.
        self._back_to(self._host_ns, "the host's namespace")
        for fd in (self._base, self._host_ns, self._host_table):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._base = self._host_ns = self._host_table = None
        self._seen = None

    def _enter(self, binds: Sequence[tuple[int, str]]) -> None:
        """Into a new namespace made from a base that is up to date, with ``binds`` bound."""
        if self._host_ns is None:
            self._host_ns = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            self._host_table = os.open("/proc/self/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        if self._base is None or self._host_changed():
            self._make_base()
        assert self._base is not None
        setns(self._base, CLONE_NEWNS)
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        for copy, path in binds:
            bind_copy(copy, path)

    def _leave(self) -> None:
        # Back to the base: the launch's namespace is then held by what was started alone.
        self._back_to(self._base, "the base namespace")

    def _back_to(self, namespace: int | None, name: str) -> None:
        if namespace is not None:
            try:
                setns(namespace, CLONE_NEWNS)
            except OSError as exc:
                self._give_up(f"cannot go back to {name}: {exc}")

    def _host_changed(self) -> bool:
        assert self._host_table is not None
        poller = select.poll()
        poller.register(self._host_table, select.POLLPRI)
        # The poll itself marks the change seen: the table is read only when something happened.
        if not poller.poll(0):
            return False
        return self._read_host() != self._seen

    def _read_host(self) -> tuple[str, ...]:
        assert self._host_table is not None
        chunks = []
        os.lseek(self._host_table, 0, os.SEEK_SET)
        while chunk := os.read(self._host_table, 1 << 16):
            chunks.append(chunk)
        lines = b"".join(chunks).decode(errors="surrogateescape").splitlines()
        return tuple(line for line in lines if not _ours(line))

    def _make_base(self) -> None:
        assert self._host_ns is not None
        seen = self._read_host()
        setns(self._host_ns, CLONE_NEWNS)
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        # Private: nothing made here reaches the host, and the host's later mounts come by a new base.
        _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making the base private")
        with open("/proc/thread-self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
            theirs = [_mount_point(line) for line in file.read().splitlines() if _ours(line)]
        for point in reversed(theirs):
            _libc.umount2(point, _MNT_DETACH)
        base = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        if self._base is not None:
            os.close(self._base)
        self._base, self._seen = base, seen


_launcher: Launcher | None = None
_launcher_lock = threading.Lock()


def launcher() -> Launcher:
    """This process's launcher, made at the first call (again in a forked child: threads do not fork)."""
    global _launcher
    with _launcher_lock:
        if _launcher is None or _launcher.pid != os.getpid():
            _launcher = Launcher()
        return _launcher


def release_launcher() -> None:
    """Let this process's launcher go of its descriptors and namespaces (:meth:`Launcher.release`).

    For a caller that goes on once its rollouts are over (a controller whose run has
    ended): nothing of the run is held; another run's launches, even in flight, are
    not disturbed (the next one makes them again).
    """
    with _launcher_lock:
        mine = _launcher if _launcher is not None and _launcher.pid == os.getpid() else None
    if mine is not None:
        mine.release()
