"""Bounded waits on a condition, for tests.

A file, a process or a counter that another process changes cannot be awaited
directly; these poll it briefly and fail the test with what was awaited once the
bound passes. They are not sleeps standing in for synchronisation.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = [
    "DEADLINE_S",
    "alive",
    "processes_mentioning",
    "wait_for",
    "wait_for_async",
    "wait_for_records",
]

DEADLINE_S = 120.0
_T = TypeVar("_T")


def wait_for(
    predicate: Callable[[], _T],
    *,
    timeout: float = DEADLINE_S,
    what: str = "condition",
    interval: float = 0.01,
) -> _T:
    """Poll ``predicate`` until it returns a truthy value and return it; fail after ``timeout``.

    The predicate may raise to stop waiting early (e.g. the process it waits on died).
    """
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def wait_for_async(
    predicate: Callable[[], _T],
    *,
    within_s: float = DEADLINE_S,
    what: str = "condition",
    interval: float = 0.01,
) -> _T:
    """``wait_for`` for coroutines: the event loop keeps running between polls."""
    try:
        async with asyncio.timeout(within_s):
            while not (value := predicate()):  # noqa: ASYNC110 - another process changes what we poll
                await asyncio.sleep(interval)
    except TimeoutError:
        raise AssertionError(f"timed out after {within_s}s waiting for {what}") from None
    return value


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X", b"x")


def reaped(pid: int) -> bool:
    """Whether this process's child ``pid`` has been reaped (looked at without reaping it)."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def processes_mentioning(marker: str) -> list[int]:
    """Pids of processes (other than this one) whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def wait_for_records(path: Path, count: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    """Wait until ``path`` holds ``count`` lines (a run's own progress); fail if ``proc`` exits first."""

    def enough() -> bool:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return True
        if proc.poll() is not None:
            raise AssertionError(f"rollcage run exited early: {proc.communicate()[0]}")
        return False

    wait_for(enough, timeout=timeout, what=f"{path} to reach {count} records", interval=0.05)
