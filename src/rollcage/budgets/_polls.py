"""The budgets of a loop's supervisions, read together: one thread hop per look for all that are due.

Each supervision used to read its sandbox's counters (cgroup files, the tmpfs'
``statvfs``) from a thread hop of its own, 20, 40, 80 ms ... after its start and
then every ``budget_poll_s``: at C=256 about nine hops a rollout, each costing more
CPU in the hand-over (a pool thread woken, the loop woken back) than in the
reading. Now one task per event loop takes every reading that is due, or due
within a quarter of its period, in one hop, and a supervision awaits its breach.
The schedule of each is the one it had, except that a reading may come up to a
quarter of a period sooner (so watches started apart are read together), never later.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable

from rollcage.procs import LoopPoller, poller_for, within

__all__ = ["watch_budget"]

_FIRST_S = 0.02
"""The first reading after a watch begins; the interval then doubles up to the period."""
_SLACK = 0.25
"""A reading due within this share of its period is taken with the ones due now."""

_IDLE_S = 60.0
"""How long the task waits for a new watch when every watch it has is over (it is cancelled sooner)."""

Breach = tuple[str, str]
Check = Callable[[], Breach | None]


class _Watch:
    """One supervision's budgets: read on its own schedule; its future holds the first breach."""

    def __init__(self, check: Check, period_s: float, now: float) -> None:
        self.check = check
        self.period_s = period_s
        self.interval = min(_FIRST_S, period_s)
        self.due = now + self.interval
        self.breach: asyncio.Future[Breach] = asyncio.get_running_loop().create_future()

    def taken(self, now: float) -> None:
        """A reading was taken now: the next is due one (doubled) interval later."""
        self.interval = min(self.interval * 2, self.period_s)
        self.due = now + self.interval


class _Poller(LoopPoller[_Watch]):
    """The budget watches of one event loop, read together by one task while any is watched."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = asyncio.Event()

    def _added(self, watch: _Watch) -> None:
        self.changed.set()  # it may be due before the reading the task sleeps towards

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        while self.watches:
            self.changed.clear()
            # A watch whose breach is known is read no more (its supervision ends it soon).
            pending = [watch for watch in self.watches if not watch.breach.done()]
            wait = min((watch.due for watch in pending), default=loop.time() + _IDLE_S) - loop.time()
            if wait > 0 and await within(self.changed.wait(), wait) is not None:
                continue  # a new watch: look at the schedule again
            now = loop.time()
            due = [w for w in pending if w.due <= now + _SLACK * w.period_s]
            for watch in due:
                watch.taken(now)
            if not due:
                continue
            results = await asyncio.to_thread(_read_all, [watch.check for watch in due])
            for watch, result in zip(due, results, strict=True):
                if watch.breach.done() or result is None:
                    continue
                if isinstance(result, BaseException):
                    watch.breach.set_exception(result)
                else:
                    watch.breach.set_result(result)


def _read_all(checks: list[Check]) -> list[Breach | BaseException | None]:
    """Each check's breach, or the exception it raised (one rollout's failure is not the others')."""
    results: list[Breach | BaseException | None] = []
    for check in checks:
        try:
            results.append(check())
        except Exception as exc:
            results.append(exc)
    return results


_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def watch_budget(check: Check, period_s: float) -> AsyncIterator[asyncio.Future[Breach]]:
    """A future that holds the first breach ``check`` (blocking) returns, read on the loop's schedule.

    ``check`` runs in a thread, with the other due checks of the loop: first 20 ms after
    the watch begins, then at doubling intervals up to every ``period_s``. An exception
    it raises is the future's, and ends this watch's readings.

    **Cancellation:** the watch ends with the block, whatever ends it.
    """
    watch = _Watch(check, period_s, asyncio.get_running_loop().time())
    try:
        with poller_for(_pollers, _Poller).watching(watch):
            yield watch.breach
    finally:
        if not watch.breach.done():
            watch.breach.cancel()
