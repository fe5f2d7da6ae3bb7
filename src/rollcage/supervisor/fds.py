"""File descriptors: the process's open-file limit, the share the egress proxies may use, EMFILE retries.

One process supervises many rollouts, and every connection a sandbox opens to
its egress proxy costs this process up to two descriptors (the sandbox's side
and the upstream's). Left alone, one rollout opening thousands of connections
exhausts the limit and every other rollout fails with "Too many open files". So:

* the soft limit is raised to the hard limit once (:func:`raise_open_file_limit`);
* a **reserve** of descriptors is never handed to proxy connections
  (:func:`reserve_for`): receipts, logs, pidfds and the controller's own files
  always find one (the controller refuses a concurrency whose rollouts' own
  files would not fit in it);
* what is left is shared by the proxies alive in this process
  (:class:`ConnectionBudget`): each rollout gets at most its configured cap and at
  most an equal share, so a flooding rollout is refused at accept long before its
  neighbours are;
* a blocking open that still meets ``EMFILE``/``ENFILE`` waits briefly for
  descriptors to come back rather than failing the rollout (:func:`retry_on_emfile`).
"""

from __future__ import annotations

import errno
import logging
import resource
import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = [
    "DESCRIPTORS_PER_CONNECTION",
    "ConnectionBudget",
    "connection_budget",
    "is_out_of_descriptors",
    "open_file_limit",
    "raise_open_file_limit",
    "reserve_for",
    "retry_on_emfile",
]

logger = logging.getLogger("rollcage.supervisor")

_P = ParamSpec("_P")
_T = TypeVar("_T")

DESCRIPTORS_PER_CONNECTION = 2
"""What one proxied connection costs this process: the sandbox's socket and the upstream's."""

_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
_raise_lock = threading.Lock()
_raised = False


def open_file_limit() -> int:
    """This process's soft ``RLIMIT_NOFILE`` (``RLIM_INFINITY`` is taken as 1 << 20)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard limit (once per process); return the soft limit now.

    A limit that cannot be raised (a sandbox that forbids it) is kept and logged.
    """
    global _raised
    with _raise_lock:
        if not _raised:
            _raised = True
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            if hard == resource.RLIM_INFINITY or soft < hard:
                # Linux caps RLIMIT_NOFILE at fs.nr_open whatever the hard limit says.
                target = hard if hard != resource.RLIM_INFINITY else _nr_open()
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                except (ValueError, OSError) as exc:
                    logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return open_file_limit()


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open", "rb") as file:
            return int(file.read())
    except (OSError, ValueError):
        return 1 << 20


def reserve_for(limit: int) -> int:
    """Descriptors never handed to proxy connections under ``limit``: a quarter, at least 64."""
    return max(64, limit // 4)


def is_out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` is ``EMFILE`` (this process) or ``ENFILE`` (the whole system)."""
    return isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS


def retry_on_emfile(fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Call ``fn``; while it fails for want of descriptors, retry for up to 10 s (blocking: use a thread).

    Descriptors come back as connections over a rollout's budget are refused and
    closed, so a short wait usually suffices; after it the last error is raised.
    """
    end = time.monotonic() + 10.0
    pause = 0.01
    while True:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            if not is_out_of_descriptors(exc) or time.monotonic() >= end:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.2)


class ConnectionBudget:
    """The proxy connections this process can afford, shared fairly by the proxies alive in it.

    ``capacity`` is ``(limit - reserve) // DESCRIPTORS_PER_CONNECTION``, re-read
    on every admission (the limit may be raised after start). A proxy may hold a
    new connection while all of these hold: it is under its own cap, under an
    equal share of the capacity, and the process is under the capacity.
    Thread-safe (proxies may live in several event loops).
    """

    def __init__(self, limit: Callable[[], int] = open_file_limit) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._members = 0
        self._in_use = 0

    @property
    def in_use(self) -> int:
        """Connections held now, every proxy together."""
        return self._in_use

    def capacity(self) -> int:
        """Connections every proxy together may hold."""
        limit = self._limit()
        return max(0, (limit - reserve_for(limit)) // DESCRIPTORS_PER_CONNECTION)

    def join(self) -> None:
        """A proxy starts sharing the budget."""
        with self._lock:
            self._members += 1

    def leave(self) -> None:
        """A proxy stops sharing the budget (its connections must be released first)."""
        with self._lock:
            self._members = max(0, self._members - 1)

    def share(self, cap: int) -> int:
        """The most connections one proxy with its own ``cap`` may hold right now (at least 1)."""
        with self._lock:
            members = max(1, self._members)
        return max(1, min(cap, self.capacity() // members))

    def try_acquire(self, held: int, cap: int) -> bool:
        """Take one connection for a proxy that holds ``held``; ``False``: refuse it."""
        if held >= self.share(cap):
            return False
        with self._lock:
            if self._in_use >= self.capacity():
                return False
            self._in_use += 1
            return True

    def release(self) -> None:
        """Give one connection back."""
        with self._lock:
            self._in_use = max(0, self._in_use - 1)


_budget = ConnectionBudget()


def connection_budget() -> ConnectionBudget:
    """The process-wide budget every egress proxy in this process shares."""
    return _budget
