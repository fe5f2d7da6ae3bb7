"""A warm start's report socket (rollcage.supervisor.warm._Reports): every worker forked is known.

The template names the worker it forked (``pid N`` with a pidfd); the worker says whether it
entered its cage (``ok`` / ``error ...``). The two words come from two processes in either
order. The worker is the supervisor's own child, and until the supervisor reaps it, its zombie
holds the sandbox's PID namespace, and so bwrap, open: a start must never end knowing one word
and not the worker. Here a real child plays the worker and the test plays the template.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

from rollcage.procs import PidfdChild
from rollcage.supervisor.warm import _Reports
from tests.helpers.waiting import wait_for_async


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
        pid = _worker_saying(b"error boom", reports.end, then="import time; time.sleep(60)")
        spoken = asyncio.ensure_future(reports.until(lambda: _both_spoken(reports)))
        await wait_for_async(lambda: reports.verdict is not None, what="the worker's word")
        # Known by the credentials of its message already, but the start waits for the template.
        assert reports.worker is not None and reports.worker.pid == pid
        assert not spoken.done()
        template = os.pidfd_open(pid)
        try:
            socket.send_fds(reports.end, [f"pid {pid}".encode()], [template])
        finally:
            os.close(template)
        assert await asyncio.wait_for(spoken, 30)
        assert reports.template_spoke and reports.verdict == b"error boom"
        await _end(reports.worker)
    finally:
        reports.close()


async def test_a_worker_whose_template_died_before_it_spoke_is_known_by_its_own_word() -> None:
    reports = _Reports()
    try:
        pid = _worker_saying(b"ok", reports.end, then="import time; time.sleep(60)")
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
    from rollcage.supervisor import warm
    from rollcage.warm import WarmRequest

    before = list(warm._unsettled)
    start = warm.WarmStart()
    start.spawned()  # as if bwrap held its ends, then failed before its holder spoke
    request = WarmRequest(argv=[], env={}, cwd="/", uid=0, gid=0)
    worker = await start.start(warm.Template(None), request, log_fd=2, marked="X=y", timeout_s=0.05)
    assert worker is None
    await asyncio.wait_for(start.relay(), 10)
    start.close()
    # Nothing was handed to a template, so nothing can have been forked: no socket kept for later.
    assert warm._unsettled == before
    assert start._reports.sock.fileno() == -1 and start._reports.end.fileno() == -1
