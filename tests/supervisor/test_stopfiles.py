"""The stop files of a loop's supervisions, watched by one poller (rollcage.supervisor.stopfiles)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from rollcage.supervisor import stopfiles
from rollcage.supervisor.stopfiles import watch_stop_file
from tests.helpers.waiting import wait_for_async

PERIOD_S = 0.01


async def test_each_watch_sees_its_own_file_and_all_are_looked_at_in_one_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    looks: list[int] = []
    real = stopfiles._existing

    def counted(paths: list[Path]) -> list[bool]:
        looks.append(len(paths))
        return real(paths)

    monkeypatch.setattr(stopfiles, "_existing", counted)
    paths = [tmp_path / f"stop-{n}" for n in range(50)]
    async with contextlib.AsyncExitStack() as stack:
        seen = [await stack.enter_async_context(watch_stop_file(p, PERIOD_S)) for p in paths]
        await wait_for_async(lambda: len(looks) >= 3, what="the poller to look a few times")
        # Fifty files, one thread hop per look: never one per file.
        assert max(looks) == 50
        paths[7].touch()
        await asyncio.wait_for(seen[7].wait(), 10)
        assert [n for n, event in enumerate(seen) if event.is_set()] == [7]
        # A file seen is not looked at again.
        looks.clear()
        await wait_for_async(lambda: len(looks) >= 2, what="the poller to look again")
        assert set(looks) == {49}


async def test_a_file_already_there_is_seen_before_the_first_period(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    stop.touch()
    async with watch_stop_file(stop, period_s=3600) as seen:
        assert seen.is_set()


async def test_the_poller_ends_with_the_last_watch_and_a_new_one_starts_it_again(tmp_path: Path) -> None:
    poller = None
    async with watch_stop_file(tmp_path / "a", PERIOD_S), watch_stop_file(tmp_path / "b", PERIOD_S):
        poller = stopfiles._pollers[asyncio.get_running_loop()]
        task = poller.task
        assert task is not None and not task.done()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert poller.task is None and not poller.watches
    async with watch_stop_file(tmp_path / "c", PERIOD_S) as seen:
        assert poller.task is not None and not poller.task.done()
        (tmp_path / "c").touch()
        await asyncio.wait_for(seen.wait(), 10)


async def test_a_caller_that_just_looked_is_not_looked_for_again_before_the_first_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A supervision looks for its stop file itself first, then watches it to its end in one watch.
    hops: list[str] = []
    real = asyncio.to_thread

    async def counted(fn: object, /, *args: object) -> object:
        hops.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "to_thread", counted)
    stop = tmp_path / "stop"
    async with watch_stop_file(stop, period_s=3600, just_looked=True) as seen:
        assert hops == [] and not seen.is_set()
    async with watch_stop_file(stop, period_s=3600) as seen:
        assert hops == ["exists"] and not seen.is_set()
