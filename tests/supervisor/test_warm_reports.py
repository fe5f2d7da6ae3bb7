"""A warm start's report socket (rollcage.supervisor.warm._Reports): every worker forked is known.

The template names the worker it forked (``Forked`` with a pidfd); the worker says whether it
entered its cage (``Entered`` / ``EnterFailed``). The two words come from two processes in either
order. The worker is the supervisor's own child, and until the supervisor reaps it, its zombie
holds the sandbox's PID namespace, and so bwrap, open: a start must never end knowing one word
and not the worker. Here a real child plays the worker and the test plays the template.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence

from rollcage.forkserver import Entered, EnterFailed, Forked, encode, send
from rollcage.procs import PidfdChild
from rollcage.supervisor.warm import _Reports
from tests.helpers.waiting import reaped, wait_for_async


def _worker_saying(words: bytes, channel: socket.socket, *, then: str) -> int:
    """A child that sends ``words`` on ``channel`` (its own copy), then runs ``then``; its PID."""
    fd = channel.fileno()
    os.set_inheritable(fd, True)
    code = f"import os, socket; held = socket.socket(fileno={fd}); held.send({words!r}); {then}"
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))


def _heard(reports: _Reports) -> bool:
    """Whether the worker's word has come (taking what is waiting on the socket)."""
    reports.receive()
    return reports.verdict is not None


def _holder(start: object) -> subprocess.Popen[bytes]:
    """A stand-in for bwrap's holder: announces itself on the start's socket, marked ``ROLE=holder``.

    It stays the one process that announced itself, reading with the shell's own ``read`` as the
    real holder does: an ``exec`` after the announcement raced the start's check of its
    environment (empty while the exec replaces it).
    """
    from rollcage.supervisor.warm import WarmStart

    assert isinstance(start, WarmStart)
    return subprocess.Popen(
        ["/bin/sh", "-c", "printf r; while IFS= read -r _; do :; done"],
        stdin=start.holder_stdin,
        stdout=start.holder_stdout,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "ROLE": "holder"},
    )


def _both_spoken(reports: _Reports) -> bool:
    return reports.verdict is not None and reports.settled


async def _end(worker: PidfdChild | None) -> None:
    assert worker is not None
    worker.kill()
    await asyncio.wait_for(worker.wait(), 30)
    assert worker.reap() == 128 + signal.SIGKILL


async def test_a_workers_error_before_its_templates_word_waits_for_the_word_and_knows_the_worker() -> None:
    reports = _Reports()
    try:
        failed = encode(EnterFailed(reason="boom"))
        pid = _worker_saying(failed, reports.end, then="import signal; signal.pause()")
        spoken = asyncio.ensure_future(reports.until(lambda: _both_spoken(reports)))
        await wait_for_async(lambda: reports.verdict is not None, what="the worker's word")
        # Known by the credentials of its message already, but the start waits for the template.
        assert reports.worker is not None and reports.worker.pid == pid
        assert not spoken.done()
        template = os.pidfd_open(pid)
        try:
            send(reports.end, Forked(pid=pid), [template])
        finally:
            os.close(template)
        assert await asyncio.wait_for(spoken, 30)
        assert reports.template_spoke and reports.verdict == EnterFailed(reason="boom")
        await _end(reports.worker)
    finally:
        reports.close()


async def test_a_worker_whose_template_died_before_it_spoke_is_known_by_its_own_word() -> None:
    reports = _Reports()
    try:
        pid = _worker_saying(encode(Entered()), reports.end, then="import signal; signal.pause()")
        reports.end.close()  # the template is gone without a word: only the worker holds the socket
        await wait_for_async(lambda: _heard(reports), what="the worker's word")
        assert reports.worker is not None and reports.worker.pid == pid and not reports.settled
        worker = reports.worker
        worker.kill()
        # Its copy of the socket closes with it: the start is settled, with the worker known.
        assert await asyncio.wait_for(reports.until(lambda: reports.settled), 30)
        assert reports.ended and reports.worker is worker
        await asyncio.wait_for(worker.wait(), 30)
        assert worker.reap() == 128 + signal.SIGKILL
    finally:
        reports.close()


async def test_a_start_whose_holder_never_came_leaves_nothing_to_settle() -> None:
    from rollcage.forkserver import WorkerStart
    from rollcage.supervisor import warm

    before = list(warm._unsettled)
    start = warm.WarmStart()
    start.spawned()  # as if bwrap held its ends, then failed before its holder spoke
    request = WorkerStart(argv=[], env={}, cwd="/", uid=0, gid=0)
    worker = await start.start(warm.Template(None), request, log_fd=2, marked="X=y", timeout_s=0.05)
    assert worker is None
    await asyncio.wait_for(start.relay(), 10)
    start.close()
    # Nothing was handed to a template, so nothing can have been forked: no socket kept for later.
    assert warm._unsettled == before
    assert start._reports.sock.fileno() == -1 and start._reports.end.fileno() == -1


async def test_a_start_whose_worker_fails_before_its_template_names_it_still_reaps_it() -> None:
    """The race of a real start, played in order: the worker's error is read, the template's
    ``pid N`` comes after. The start must wait for it, and its relay must reap that worker."""
    from rollcage.forkserver import WorkerStart
    from rollcage.supervisor import warm

    start = warm.WarmStart()
    holder = _holder(start)
    start.spawned()
    forked: list[int] = []
    naming: list[asyncio.Future[None]] = []

    class Template(warm.Template):
        """Forks a 'worker' that says ``error boom`` and exits; names it once that word was read."""

        async def send(self, request: WorkerStart, fds: Sequence[int]) -> None:
            channel = socket.socket(fileno=os.dup(fds[1]))
            forked.append(_worker_saying(encode(EnterFailed(reason="boom")), channel, then="pass"))

            async def name_it() -> None:
                await wait_for_async(lambda: start._reports.verdict is not None, what="the worker's word")
                pidfd = os.pidfd_open(forked[0])
                with channel:
                    send(channel, Forked(pid=forked[0]), [pidfd])
                os.close(pidfd)

            naming.append(asyncio.ensure_future(name_it()))

    try:
        request = WorkerStart(argv=[], env={}, cwd="/", uid=0, gid=0)
        worker = await start.start(Template(None), request, log_fd=2, marked="ROLE=holder", timeout_s=30)
        assert worker is None and start.failure is not None and "boom" in start.failure
        await asyncio.wait_for(start.relay(), 30)
        await naming[0]
        assert reaped(forked[0]), "the failed worker was left a zombie: its PID namespace would never end"
    finally:
        start.close()
        holder.kill()
        await asyncio.to_thread(holder.wait)


async def test_a_start_whose_worker_died_without_a_word_says_how_it_died() -> None:
    """A worker killed before it reported (its cgroup killed, its PID namespace ended): the failure
    says so, and the start still reaps it."""
    from rollcage.forkserver import WorkerStart
    from rollcage.supervisor import warm

    start = warm.WarmStart()
    holder = _holder(start)
    start.spawned()
    forked: list[int] = []

    class Template(warm.Template):
        """Forks a 'worker' that is killed before it says anything, and names it once it is dead."""

        async def send(self, request: WorkerStart, fds: Sequence[int]) -> None:
            with socket.socket(fileno=os.dup(fds[1])) as channel:
                forked.append(_dying_worker(channel))
                pidfd = os.pidfd_open(forked[0])
                await wait_for_async(lambda: _exited(pidfd), what="the worker's death")
                send(channel, Forked(pid=forked[0]), [pidfd])
                os.close(pidfd)

    try:
        request = WorkerStart(argv=[], env={}, cwd="/", uid=0, gid=0)
        worker = await start.start(Template(None), request, log_fd=2, marked="ROLE=holder", timeout_s=30)
        assert worker is None
        words = "no report (its worker was killed by SIGKILL before it spoke)"
        assert start.failure == f"the warm start failed: {words}"
        await asyncio.wait_for(start.relay(), 30)
        assert reaped(forked[0])
    finally:
        start.close()
        holder.kill()
        await asyncio.to_thread(holder.wait)


def _dying_worker(channel: socket.socket) -> int:
    """A child holding its copy of ``channel`` (as a real worker) that is SIGKILLed before a word; its PID."""
    os.set_inheritable(channel.fileno(), True)
    code = "import os; os.kill(os.getpid(), 9)"
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code], dict(os.environ))


def _exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` (a child) has exited, leaving it unreaped."""
    return os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
