"""Wait for a file to appear without waking up to look: inotify where the kernel gives it, polling where not.

The worker watches its rollout's ``stop`` file for the whole rollout (a
supervisor that cannot signal it asks it to stop that way). Polling it every
0.1 s cost far more than the ``stat`` suggests: each wake-up of an idle
interpreter (event loop turn, timer, cold caches) costs CPU, and a rollout waiting
seconds on its model paid for dozens of looks, a noticeable share of all the CPU a
warm rollout costs (measured: docs/benchmarks/index.md). An inotify watch on the
file's directory costs nothing until something is created or moved into it.

inotify is not always there: the instances are counted per user across user
namespaces (``fs.inotify.max_user_instances``, 128 by default, shared by every
cage of the same host uid and by the agent code in them), and a watch sees only
changes made through the local kernel. So :func:`wait_for_file` falls back to
polling every ``poll_s`` when no watch can be made, and with a watch still looks
every ``SAFETY_POLL_S`` (a directory replaced, a network file system).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
from pathlib import Path

__all__ = ["SAFETY_POLL_S", "inotify_directory", "wait_for_file"]

SAFETY_POLL_S = 10.0
"""With a watch: how often the file is looked for anyway (changes a watch cannot see)."""

_IN_MOVED_TO = 0x00000080
_IN_CREATE = 0x00000100
_IN_ONLYDIR = 0x01000000

_libc = ctypes.CDLL(None, use_errno=True)


def inotify_directory(directory: Path) -> int | None:
    """A non-blocking, close-on-exec inotify descriptor on ``directory``'s new entries; ``None``: none.

    ``None`` when the kernel gives no instance (the per-user limit, no inotify) or the directory
    cannot be watched (gone, not a directory, no permission).
    """
    try:
        init1, add_watch = _libc.inotify_init1, _libc.inotify_add_watch
    except AttributeError:
        return None
    fd = init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0:
        return None
    if add_watch(fd, os.fsencode(directory), _IN_CREATE | _IN_MOVED_TO | _IN_ONLYDIR) < 0:
        os.close(fd)
        return None
    return int(fd)


def _drain(fd: int) -> bool:
    """Read every queued event (their words do not matter: the file is looked for after each); readable?"""
    try:
        while os.read(fd, 65536):
            pass
    except BlockingIOError:
        return True
    except OSError:
        return False
    return True


def _exists(path: Path) -> bool:
    """One ``stat`` in the event loop: of a local directory's entry (a thread hop costs 30 times more)."""
    return os.path.exists(path)


async def _poll(path: Path, period_s: float) -> None:
    while not _exists(path):  # noqa: ASYNC110 - a file, not an event, is the signal
        await asyncio.sleep(period_s)


async def wait_for_file(path: Path, *, poll_s: float) -> None:
    """Return once ``path`` exists: at once when an inotify watch sees it made, else at the next look.

    Looks every ``poll_s`` without a watch (or once the watch cannot be read), every
    :data:`SAFETY_POLL_S` with one.

    **Cancellation:** at any point; the watch is closed on the way out.
    """
    # Two system calls on a local directory: not worth a thread hop.
    fd = inotify_directory(path.parent)
    if fd is None:
        await _poll(path, poll_s)
        return
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()
    loop.add_reader(fd, woken.set)
    try:
        # Watched before this first look: a file made in between is seen by one or the other.
        while not _exists(path):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SAFETY_POLL_S):
                    await woken.wait()
            woken.clear()
            if not _drain(fd):
                break  # an unreadable watch would wake this loop for ever: look by polling instead
        else:
            return
        loop.remove_reader(fd)
        await _poll(path, poll_s)
    finally:
        loop.remove_reader(fd)
        os.close(fd)
