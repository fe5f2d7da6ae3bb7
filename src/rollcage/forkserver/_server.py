"""The fork server's loop: wait on its sockets, fork each child where it is asked to be born, reap.

One loop for both fork servers: the warm worker template (:mod:`rollcage.warm`, which pre-imports
the worker) and the executor template (:mod:`rollcage.tools._executor_template`, which pre-imports
nothing: a fresh interpreter's modules). What a child does once forked, and what a message asks
for, is the caller's; here:

* :meth:`ForkServer.serve`: a selector over the control socket and the clients' sockets, no thread,
  no event loop (a fork must copy one thread, and no loop's state);
* :meth:`ForkServer.join` and :meth:`ForkServer.fork`: the next child is born in a cage's PID
  namespace (``setns`` on a pidfd of its holder), the server's own children after it back home
  (:meth:`ForkServer.go_home`, or the server exits: a child born in a cage by mistake would be
  worse than a server started again);
* children of its own (``sibling=False``) are reaped on ``SIGCHLD`` and each exit handed to
  ``on_exit``; a child forked as its parent's (``sibling=True``: the warm worker, the supervisor's)
  is not this process's to reap.

Standard library only, imports nothing of ``rollcage`` and takes what it needs of the cage's
system calls (:mod:`rollcage.cage`), and of :func:`rollcage.procs.reap_children`, as arguments: the
executor template loads this file by path.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
from collections.abc import Callable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

__all__ = ["ForkServer", "fill_free_blocks"]

# Loaded at start-up; ``import signal`` would import enum into the executor template's heap.
_signal: Any = sys.modules["_signal"]


class ForkServer:
    """A fork server's state: its sockets, its own PID namespace, its children.

    Args:
        control: The socket its starter speaks on; its end of file ends :meth:`serve`.
        enter: The cage's system calls (``setns``, ``PID_NS``, ``clone_child``, ``clone_sibling``).
        reap: :func:`rollcage.procs.reap_children`, for a server whose children are its own;
            ``None``: it has none (its forks are its parent's).
        on_exit: Told ``(pid, exit code)`` of each child reaped.
    """

    def __init__(
        self,
        control: socket.socket,
        enter: Any,
        *,
        reap: Callable[[int], list[tuple[int, int]]] | None = None,
        on_exit: Callable[[int, int], None] | None = None,
    ) -> None:
        self.control = control
        self.enter = enter
        self.selector = selectors.DefaultSelector()
        self.home = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        """This process's own PID namespace: its children are born there but for one fork at a time."""
        self._reap = reap
        self._on_exit = on_exit
        self._away = False
        """A cage's PID namespace was joined for the next child (:meth:`join`): go home after the fork."""
        self._wake = -1
        if reap is not None:
            # SIGCHLD wakes the loop (a handler must be set for the wake-up byte to be written).
            self._wake, wake_w = os.pipe()
            os.set_blocking(wake_w, False)
            _signal.set_wakeup_fd(wake_w)
            _signal.signal(_signal.SIGCHLD, lambda *_: None)
            self.selector.register(self._wake, selectors.EVENT_READ, None)

    def watch(self, sock: socket.socket, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` whenever ``sock`` (a client's) is readable, until :meth:`forget`."""
        self.selector.register(sock, selectors.EVENT_READ, on_ready)

    def forget(self, sock: socket.socket) -> None:
        """Stop watching ``sock`` (the caller closes it)."""
        self.selector.unregister(sock)

    def serve(self, on_control: Callable[[], bool]) -> None:
        """Serve until ``on_control()`` (called when the control socket is readable) returns ``False``."""
        self.selector.register(self.control, selectors.EVENT_READ, on_control)
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    os.read(self._wake, 4096)
                    self.reap()
                elif key.data is on_control:
                    if not on_control():
                        return
                else:
                    key.data()

    def join(self, holder: int) -> str | None:
        """Have the next child born in the PID namespace of the process the pidfd ``holder`` names;
        ``None``, or why it cannot be (the next child is then born here)."""
        try:
            self.enter.setns(holder, self.enter.PID_NS)
        except OSError as exc:
            return f"cannot join the cage: OSError: {exc}"
        self._away = True
        return None

    def fork(self, *, sibling: bool) -> tuple[int, int]:
        """Fork: ``(pid, pidfd)`` here, ``(0, -1)`` in the child; the server's next children are born
        in its own PID namespace again. ``sibling``: the child is this process's parent's.

        Raises:
            OSError: The kernel refused (the server is home again).
        """
        try:
            forked: tuple[int, int] = (self.enter.clone_sibling if sibling else self.enter.clone_child)()
        except OSError:
            self.go_home()
            raise
        if forked[0] != 0:
            self.go_home()
        return forked

    def go_home(self) -> None:
        """Have this process's next children born in its own PID namespace again; exit if they cannot be.

        They would be born in a cage: whoever started this server starts another instead. Nothing
        to do where no cage was joined (a worker forked beside its holder, ``--sandbox none``: a
        server that is not root could not even name its own namespace again).
        """
        if not self._away:
            return
        self._away = False
        try:
            self.enter.setns(self.home, self.enter.PID_NS)
        except OSError as exc:
            with _suppressed():
                os.write(2, f"rollcage: a fork server cannot return to its PID namespace: {exc}\n".encode())
            os._exit(1)

    def reap(self, until: int = 0) -> None:
        """Reap every child that has exited (waiting for ``until`` first) and tell ``on_exit``."""
        if self._reap is None:
            return
        for pid, code in self._reap(until):
            if self._on_exit is not None:
                self._on_exit(pid, code)


class _suppressed:
    """``contextlib.suppress(OSError)`` without importing :mod:`contextlib` into the server's heap."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        return kind is not None and issubclass(kind, OSError)


_FILLERS: list[object] = []
"""What :func:`fill_free_blocks` allocated: held for the server's life, never read again."""


def fill_free_blocks() -> int:
    """Take every free block of the small-object allocator's partly used pools; how many it took.

    For a fork server, once, just before ``gc.freeze()``. Why: CPython's allocator (pymalloc)
    gives out a free block of a partly used pool before it opens a new pool, and a server's pools
    are full of holes (what its imports and warm-up freed). A child's every new object would land
    in one of them, on a page of the server's that the fork then copies: a page for each such
    object, scattered over the heap. With the holes taken here by objects that nothing touches
    again, a child's objects fill pools of its own, densely.

    The counts come from ``sys._debugmallocstats()`` (CPython's, written to the C ``stderr``: read
    here through a memory file); where it says nothing this can read (another allocator, another
    layout), no block is taken.
    """
    available = _available_blocks()
    overhead = sys.getsizeof(b"")  # a bytes object beyond its content: bytes(size - this) fills a block
    for size, count in available.items():
        if size >= 48:
            _FILLERS.extend(bytes(size - overhead) for _ in range(count))
        elif size == 32:
            _FILLERS.extend(float(index) + 0.5 for index in range(count))  # 24 bytes
        elif size == 16:
            _FILLERS.extend(object() for _ in range(count))  # 16 bytes
    return sum(available.values())


def _available_blocks() -> dict[int, int]:
    """Free blocks in partly used pools, by block size (bytes), as ``sys._debugmallocstats()`` says."""
    stats = getattr(sys, "_debugmallocstats", None)
    if stats is None:
        return {}
    try:
        memory = os.memfd_create("rollcage-mallocstats", os.MFD_CLOEXEC)
        try:
            saved = os.dup(2)
            try:
                os.dup2(memory, 2)
                stats()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            text = os.pread(memory, 1 << 20, 0)
        finally:
            os.close(memory)
    except OSError:
        return {}  # no memory file, no stderr to stand in for: nothing is taken
    found: dict[int, int] = {}
    for line in text.splitlines():
        # A row of its table: class, block size, pools, blocks in use, available blocks.
        words = line.split()
        if len(words) == 5 and all(word.isdigit() for word in words):
            found[int(words[1])] = int(words[4])
    return found
