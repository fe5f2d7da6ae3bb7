"""Waiting for a file without waking to look: an inotify watch, and the polling it falls back to."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollcage import filewatch
from rollcage.filewatch import inotify_directory, wait_for_file

# Long enough that only the watch can end a wait within the test's bound.
NEVER_S = 3600.0
BOUND_S = 30.0


async def _started(path: Path, poll_s: float) -> asyncio.Task[None]:
    """The wait, run up to its first suspension (its watch is made before that)."""
    task = asyncio.create_task(wait_for_file(path, poll_s=poll_s))
    await asyncio.sleep(0)
    assert not task.done()
    return task


async def _turns(count: int = 5) -> None:
    """Let the event loop go round: a watch's event, queued by the write itself, is handled in two."""
    for _ in range(count):
        await asyncio.sleep(0)


def _make(path: Path) -> None:
    path.write_text("")


async def _made_and_seen(path: Path, waiting: asyncio.Task[None]) -> None:
    """Make ``path``; the wait ends (within the bound)."""
    _make(path)
    await asyncio.wait_for(waiting, BOUND_S)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_a_file_made_in_the_directory_ends_the_wait_without_a_look_by_polling(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    waiting = await _started(stop, NEVER_S)
    (tmp_path / "unrelated").write_text("")  # wakes the watch; the wait goes on
    await _turns()
    assert not waiting.done()
    await _made_and_seen(stop, waiting)


async def test_a_file_moved_into_the_directory_ends_the_wait(tmp_path: Path) -> None:
    watched, elsewhere = tmp_path / "rollout", tmp_path / "elsewhere"
    watched.mkdir()
    elsewhere.mkdir()
    (elsewhere / "stop").write_text("")
    waiting = await _started(watched / "stop", NEVER_S)
    os.replace(elsewhere / "stop", watched / "stop")
    await asyncio.wait_for(waiting, BOUND_S)


async def test_a_file_already_there_ends_the_wait_at_once(tmp_path: Path) -> None:
    (tmp_path / "stop").write_text("")
    await asyncio.wait_for(wait_for_file(tmp_path / "stop", poll_s=NEVER_S), BOUND_S)


async def test_without_a_watch_the_file_is_found_by_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filewatch, "inotify_directory", lambda directory: None)
    stop = tmp_path / "stop"
    waiting = await _started(stop, 0.01)
    await _made_and_seen(stop, waiting)


async def test_a_directory_that_cannot_be_watched_is_polled(tmp_path: Path) -> None:
    missing = tmp_path / "not-yet" / "stop"
    assert inotify_directory(missing.parent) is None
    waiting = await _started(missing, 0.01)
    missing.parent.mkdir()
    await _made_and_seen(missing, waiting)


async def test_a_watch_that_cannot_be_read_falls_back_to_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(filewatch, "_drain", lambda fd: False)
    stop = tmp_path / "stop"
    waiting = await _started(stop, 0.01)
    (tmp_path / "unrelated").write_text("")  # the wake-up whose read fails
    await _turns()
    assert not waiting.done()
    await _made_and_seen(stop, waiting)


async def test_a_cancelled_wait_closes_its_watch(tmp_path: Path) -> None:
    before = _open_fds()
    waiting = await _started(tmp_path / "stop", NEVER_S)
    assert len(_open_fds() - before) == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert _open_fds() == before


def test_the_watch_is_not_inherited_and_never_blocks(tmp_path: Path) -> None:
    fd = inotify_directory(tmp_path)
    assert fd is not None
    try:
        assert not os.get_inheritable(fd)
        assert not os.get_blocking(fd)
    finally:
        os.close(fd)
