"""One task per event loop serving a set of watches: started with the first watch, ended with the last.

The stop files (:mod:`rollcage.supervisor.stopfiles`) and the budgets (:mod:`rollcage.budgets`) of a loop's
supervisions are each looked at by one such task, in one thread hop per look.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["LoopPoller", "poller_for"]

W = TypeVar("W")
P = TypeVar("P", bound="LoopPoller[Any]")


class LoopPoller(Generic[W]):
    """The watches of one event loop, served by :meth:`_poll` in one task while any is watched."""

    def __init__(self) -> None:
        self.watches: set[W] = set()
        self.task: asyncio.Task[None] | None = None

    def add(self, watch: W) -> None:
        """Serve ``watch`` too (the task starts if none runs)."""
        self.watches.add(watch)
        self._added(watch)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._poll())

    def discard(self, watch: W) -> None:
        """Stop serving ``watch`` (the task ends with the last one)."""
        self.watches.discard(watch)
        if not self.watches and self.task is not None:
            # Nothing left to look at: the task ends now rather than after its next sleep.
            self.task.cancel()
            self.task = None

    @contextlib.contextmanager
    def watching(self, watch: W) -> Iterator[W]:
        """Serve ``watch`` for the block."""
        self.add(watch)
        try:
            yield watch
        finally:
            self.discard(watch)

    def _added(self, watch: W) -> None:
        """A new watch (for a task that sleeps towards a schedule it may change)."""

    async def _poll(self) -> None:
        raise NotImplementedError


def poller_for(pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, P], make: Callable[[], P]) -> P:
    """The running loop's poller in ``pollers``, made on first use."""
    loop = asyncio.get_running_loop()
    poller = pollers.get(loop)
    if poller is None:
        poller = pollers[loop] = make()
    return poller
