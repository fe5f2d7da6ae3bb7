"""The budgets of a loop's supervisions, read together by one poller (rollcage.budgets)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable

import pytest

from rollcage.budgets import _polls as budgetpolls
from rollcage.budgets import watch_budget
from tests.helpers.waiting import wait_for_async

PERIOD_S = 0.4


Verdict = Callable[[], tuple[str, str] | None]


def _counter(readings: list[int], index: int, result: Verdict) -> budgetpolls.Check:
    """A check that counts its readings in ``readings[index]`` and returns ``result()``."""

    def check() -> tuple[str, str] | None:
        readings[index] += 1
        return result()

    return check


async def test_fifty_watches_are_read_in_one_hop_and_each_breach_is_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hops: list[int] = []
    real = budgetpolls._read_all

    def counted(checks: list[budgetpolls.Check]) -> list[tuple[str, str] | BaseException | None]:
        hops.append(len(checks))
        return real(checks)

    monkeypatch.setattr(budgetpolls, "_read_all", counted)
    readings = [0] * 50
    over: set[int] = set()

    def verdict(index: int) -> Verdict:
        def result() -> tuple[str, str] | None:
            if index == 13 and 13 in over:
                raise OSError("the cgroup is gone")
            return ("memory_bytes", f"watch {index}") if index in over else None

        return result

    async with contextlib.AsyncExitStack() as stack:
        breaches = [
            await stack.enter_async_context(watch_budget(_counter(readings, n, verdict(n)), PERIOD_S))
            for n in range(50)
        ]
        await wait_for_async(lambda: min(readings) >= 4, what="every watch to be read a few times")
        # Fifty supervisions, one thread hop per look: never one each.
        assert len(hops) < 2 * max(readings), hops
        assert max(hops) == 50
        over.update({7, 13})
        await asyncio.wait_for(asyncio.wait([breaches[7], breaches[13]]), 10)
        assert breaches[7].result() == ("memory_bytes", "watch 7")
        with pytest.raises(OSError, match="the cgroup is gone"):
            breaches[13].result()
        assert [n for n, breach in enumerate(breaches) if breach.done()] == [7, 13]
        # A watch with its breach is read no more; the others go on.
        before = list(readings)
        await wait_for_async(lambda: readings[0] >= before[0] + 2, what="the others to be read again")
        assert readings[7] == before[7] and readings[13] == before[13]


def test_the_first_reading_comes_early_and_the_interval_doubles_up_to_the_period() -> None:
    async def schedule() -> list[float]:
        watch = budgetpolls._Watch(lambda: None, 0.5, now=0.0)
        dues = [watch.due]
        for _ in range(6):
            watch.taken(watch.due)
            dues.append(watch.due)
        return dues

    dues = asyncio.run(schedule())
    steps = [round(later - earlier, 3) for earlier, later in itertools.pairwise(dues)]
    assert round(dues[0], 3) == 0.02 and steps == [0.04, 0.08, 0.16, 0.32, 0.5, 0.5]


async def test_the_poller_ends_with_the_last_watch_and_a_new_one_starts_it_again() -> None:
    readings = [0, 0]
    async with watch_budget(_counter(readings, 0, lambda: None), PERIOD_S):
        poller = budgetpolls._pollers[asyncio.get_running_loop()]
        task = poller.task
        assert task is not None and not task.done()
        await wait_for_async(lambda: readings[0] >= 1, what="a first reading")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert poller.task is None and not poller.watches
    async with watch_budget(_counter(readings, 1, lambda: ("pids", "over")), PERIOD_S) as breach:
        assert await asyncio.wait_for(breach, 10) == ("pids", "over")
