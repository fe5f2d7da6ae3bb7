"""Stop files, watched for every supervision of an event loop by one poller.

A rollout is stopped by its ``stop`` file as well as by its stop event. Each
supervision used to poll its own file from a thread every ``stop_poll_s``: at
C=256 every rollout is supervised from the start (most of them wait for a start-up
slot), so that was over a thousand thread hops a second to learn that nothing had
changed (a measurable share of a rollout's CPU at C=256: docs/benchmarks/index.md). Now every file of
the loop is looked at in one thread hop per period, and a supervision waits on an
event.

A file already there when its watch begins is found at once, as before, unless the
caller has just looked for it itself (a supervision watches its file from its first look
to its end, in one watch).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from rollcage.procs import LoopPoller, poller_for

__all__ = ["watch_stop_file"]


class _Watch:
    """One supervision's stop file: its event is set once the file is seen."""

    def __init__(self, path: Path, period_s: float) -> None:
        self.path = path
        self.period_s = period_s
        self.seen = asyncio.Event()


class _Poller(LoopPoller[_Watch]):
    """The stop files of one event loop, looked at together by one task while any is watched."""

    async def _poll(self) -> None:
        while self.watches:
            await asyncio.sleep(min(w.period_s for w in self.watches))
            watches = [w for w in self.watches if not w.seen.is_set()]
            if not watches:
                continue
            found = await asyncio.to_thread(_existing, [w.path for w in watches])
            for watch, exists in zip(watches, found, strict=True):
                if exists:
                    watch.seen.set()


def _existing(paths: list[Path]) -> list[bool]:
    return [os.path.exists(path) for path in paths]


_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def watch_stop_file(
    path: Path, period_s: float, *, just_looked: bool = False
) -> AsyncIterator[asyncio.Event]:
    """An event set once ``path`` exists, looked at now and then every ``period_s`` (or sooner).

    ``just_looked``: the caller has just found no file there itself, so the watch does not look
    again before its first period (a thread hop saved).

    **Cancellation:** the watch ends with the block, whatever ends it.
    """
    watch = _Watch(path, period_s)
    if not just_looked and await asyncio.to_thread(os.path.exists, path):
        watch.seen.set()
    with poller_for(_pollers, _Poller).watching(watch):
        yield watch.seen
