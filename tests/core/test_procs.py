"""The process-lifecycle room: stopping real process trees, the stop's state, and the cancellation dialect."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rollcage.procs import (
    GroupTree,
    PidfdChild,
    StopPhase,
    StopStrategy,
    TreeStop,
    cancel_and_wait,
    command_name,
    first_of,
    is_running,
    live_members,
    reap_abandoned,
    shielded,
    stop_tree,
    wait_shared,
)
from tests.helpers.waiting import reaped, wait_for_async

pytestmark = pytest.mark.timeout(60)

# Notes SIGTERM in a file and carries on: only SIGKILL ends it. Its background child does the same.
_STUBBORN = (
    "trap ': > term' TERM; (trap '' TERM; while :; do sleep 0.1; done) & "
    ": > started; while :; do sleep 0.1; done"
)
# A member that leaves the group (setpgid) but stays in the session, then says so.
_ESCAPER = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setpgid(0, 0)\n"
    "    open('escaped', 'w').write(str(os.getpid()))\n"
    "    while True: time.sleep(0.1)\n"
    "while True: time.sleep(0.1)\n"
)


async def _spawn(tmp_path: Path, *argv: str) -> tuple[asyncio.subprocess.Process, asyncio.Future[int]]:
    proc = await asyncio.create_subprocess_exec(*argv, cwd=tmp_path, start_new_session=True)
    return proc, asyncio.ensure_future(proc.wait())


@pytest.fixture
async def stubborn(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, asyncio.Future[int]]]:
    """A process group that ignores SIGTERM; killed at teardown whatever the test did."""
    proc, exited = await _spawn(tmp_path, "/bin/sh", "-c", _STUBBORN)
    try:
        await wait_for_async(lambda: (tmp_path / "started").exists(), what="the shell to start")
        yield proc, exited
    finally:
        for member in live_members(proc.pid) or []:
            os.kill(member.pid, signal.SIGKILL)
        await asyncio.wait({exited}, timeout=10)


async def test_stop_tree_sends_sigterm_then_kills_the_whole_group_after_the_grace(
    stubborn: tuple[asyncio.subprocess.Process, asyncio.Future[int]], tmp_path: Path
) -> None:
    proc, exited = stubborn
    gone = await stop_tree(GroupTree(proc.pid, exited), StopStrategy(grace_s=0.5, kill_wait_s=10))
    assert gone
    assert (tmp_path / "term").exists()  # the polite signal went first
    assert exited.result() == -signal.SIGKILL
    assert live_members(proc.pid) == []  # the background child too


async def test_a_tree_that_honours_sigterm_is_never_sent_sigkill(tmp_path: Path) -> None:
    proc, exited = await _spawn(tmp_path, "/bin/sh", "-c", ": > started; exec sleep 30")
    await wait_for_async(lambda: (tmp_path / "started").exists(), what="the shell to start")
    assert await stop_tree(GroupTree(proc.pid, exited), StopStrategy(grace_s=30, kill_wait_s=10))
    assert exited.result() == -signal.SIGTERM


async def test_the_sweep_kills_a_member_that_left_the_group_but_not_the_session(tmp_path: Path) -> None:
    proc, exited = await _spawn(tmp_path, sys.executable, "-c", _ESCAPER)
    escaped = await wait_for_async(
        lambda: (tmp_path / "escaped").exists() and (tmp_path / "escaped").read_text(), what="the escape"
    )
    pid = int(escaped)
    assert is_running(pid) and os.getpgid(pid) != proc.pid
    assert await stop_tree(GroupTree(proc.pid, exited), StopStrategy(grace_s=0, kill_wait_s=10))
    assert not is_running(pid)


async def test_stop_tree_finishes_the_stop_before_a_cancellation_propagates(
    stubborn: tuple[asyncio.subprocess.Process, asyncio.Future[int]], tmp_path: Path
) -> None:
    proc, exited = stubborn
    stopping = asyncio.ensure_future(
        stop_tree(GroupTree(proc.pid, exited), StopStrategy(grace_s=1.0, kill_wait_s=10))
    )
    await wait_for_async(lambda: (tmp_path / "term").exists(), what="SIGTERM")
    stopping.cancel()  # during the grace period
    with pytest.raises(asyncio.CancelledError):
        await stopping
    assert exited.done() and exited.result() == -signal.SIGKILL


async def test_a_stop_resumes_where_a_cancellation_left_it(
    stubborn: tuple[asyncio.subprocess.Process, asyncio.Future[int]], tmp_path: Path
) -> None:
    proc, exited = stubborn
    stop = TreeStop(GroupTree(proc.pid, exited), StopStrategy(grace_s=60, kill_wait_s=10))
    first = asyncio.ensure_future(stop.run())
    await wait_for_async(lambda: (tmp_path / "term").exists(), what="SIGTERM")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert stop.phase is StopPhase.TERMINATING and not exited.done()
    stop.hurry()  # the rest of the grace period is skipped; SIGTERM is not sent again
    assert await stop.run()
    assert stop.phase is StopPhase.STOPPED and exited.result() == -signal.SIGKILL


async def test_a_stop_taken_out_of_order_fails_loudly(
    stubborn: tuple[asyncio.subprocess.Process, asyncio.Future[int]],
) -> None:
    proc, exited = stubborn
    stop = TreeStop(GroupTree(proc.pid, exited), StopStrategy(grace_s=0, kill_wait_s=10))
    with pytest.raises(RuntimeError, match="no grace period"):
        await stop.wait_grace()
    await stop.kill("stop")
    with pytest.raises(RuntimeError, match="from killing to terminating"):
        await stop.terminate()
    assert await stop.sweep()
    with pytest.raises(RuntimeError, match="already swept"):
        await stop.sweep()
    with pytest.raises(RuntimeError, match="from stopped to killing"):
        await stop.kill("stop")


def test_a_strategy_refuses_negative_or_endless_waits() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        StopStrategy(grace_s=-1, kill_wait_s=1)
    with pytest.raises(ValueError, match="kill_wait_s"):
        StopStrategy(grace_s=1, kill_wait_s=float("inf"))


# --------------------------------------------------------------------------- the cancellation dialect


async def test_shielded_work_finishes_however_often_the_caller_is_cancelled() -> None:
    release = asyncio.Event()
    finished: list[str] = []
    hurried: list[int] = []

    async def close() -> str:
        await release.wait()
        finished.append("closed")
        return "closed"

    caller = asyncio.ensure_future(shielded(close(), on_cancel=lambda: hurried.append(1)))
    await asyncio.sleep(0)
    for _ in range(3):
        caller.cancel()
        await asyncio.sleep(0)
    assert not caller.done()  # still waiting for the work, not gone
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert finished == ["closed"] and len(hurried) == 3


async def test_a_failure_under_cancellation_still_raises_the_cancellation() -> None:
    release = asyncio.Event()

    async def failing() -> None:
        await release.wait()
        raise OSError("disk gone")

    caller = asyncio.ensure_future(shielded(failing()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0)
    release.set()
    with pytest.raises(asyncio.CancelledError) as caught:
        await caller
    assert isinstance(caught.value.__cause__, OSError)


async def test_wait_shared_leaves_at_once_and_the_shared_future_runs_on() -> None:
    shared: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_shared(shared))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not shared.cancelled()
    shared.set_result("still here")
    assert await wait_shared(shared) == "still here"


async def test_first_of_ends_the_other_waits_and_says_which_finished() -> None:
    quick = asyncio.Event()
    never = asyncio.Event()
    quick.set()
    finished, cut = await first_of(quick.wait(), never.wait())
    assert not finished.cancelled() and cut.cancelled()
    (timed_out,) = await first_of(never.wait(), seconds=0.01)
    assert timed_out.cancelled()


@pytest.fixture
def no_collector() -> Iterator[None]:
    """The cyclic garbage collector off for the test: what is freed, is freed by reference counts."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class _Owner:
    """What a supervision is to its tasks: it holds the task, and the task's coroutine holds it."""

    task: asyncio.Task[None] | None = None


async def _wait_forever(owner: _Owner, started: asyncio.Event) -> None:
    started.set()
    await asyncio.Event().wait()


@pytest.mark.usefixtures("no_collector")
async def test_cancel_and_wait_ends_the_tasks_and_leaves_no_cycle_for_the_collector() -> None:
    owner, started = _Owner(), asyncio.Event()
    owner.task = task = asyncio.ensure_future(_wait_forever(owner, started))
    finished = asyncio.ensure_future(asyncio.sleep(0, result="done"))
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(finished, 10)
    await asyncio.wait_for(cancel_and_wait(task, None, finished), 10)
    assert task.cancelled() and finished.result() == "done"
    # The task's CancelledError (its traceback holds the coroutine's frame, which holds the owner,
    # which holds the task) is gone from it: the owner goes with its last reference, not at the
    # next full collection.
    gone = weakref.ref(owner)
    del owner, task
    assert gone() is None


async def test_command_name_names_a_live_process_and_none_once_it_is_gone(tmp_path: Path) -> None:
    proc, exited = await _spawn(tmp_path, "sleep", "30")
    try:
        # The spawn returns once exec has closed the error pipe, which the kernel does a
        # moment before it renames the process: "python" until then.
        await wait_for_async(lambda: command_name(proc.pid) == "sleep", what="the child to exec sleep")
    finally:
        proc.kill()
        await asyncio.wait_for(exited, 10)
    assert command_name(proc.pid) is None


def _held_child(code: str) -> PidfdChild:
    """A child of this process running ``code``, held by a pidfd and by nothing else (no Popen)."""
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))
    return PidfdChild(pid, os.pidfd_open(pid))


async def test_a_pidfd_child_is_awaited_reaped_and_reported_as_a_shell_would() -> None:
    quits, killed = _held_child("raise SystemExit(3)"), _held_child("import signal; signal.pause()")
    assert killed.reap() is None and not killed.reaped, "reaped while it runs"
    killed.kill()
    codes = []
    for child in (quits, killed):
        await asyncio.wait_for(child.wait(), 30)
        codes.append(child.reap())
        assert child.reaped and reaped(child.pid)
    assert codes == [3, 128 + signal.SIGKILL]


async def test_how_a_pidfd_child_ended_is_seen_without_reaping_it() -> None:
    child = _held_child("import signal; signal.pause()")
    assert child.exited() is None, "seen as ended while it runs"
    child.kill()
    await asyncio.wait_for(child.wait(), 30)
    assert child.exited() == 128 + signal.SIGKILL
    # Looked at, not reaped: its zombie (and so its PID) is still this process's to reap.
    assert not child.reaped and not reaped(child.pid)
    assert child.reap() == 128 + signal.SIGKILL and reaped(child.pid)


async def test_an_abandoned_child_is_killed_and_reaped_by_a_later_sweep() -> None:
    child = _held_child("import signal; signal.pause()")
    handle = child.handle()
    assert handle is not None
    try:
        child.abandon()
        await asyncio.wait_for(handle.wait(), 30)

        def swept() -> bool:
            reap_abandoned()
            return reaped(child.pid)

        await wait_for_async(swept, what="the abandoned child's reaping")
    finally:
        handle.close()
