"""The fork server's loop (:class:`rollcage.forkserver.ForkServer`), in a real process of its own.

Its children are reaped as they exit and each exit is told to its client. A client gone in the
middle of its request: ``tests/tools/test_executor_template.py`` (the executor template's loop)
and ``tests/supervisor/test_warm_reports.py`` (the warm template's).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.forkserver import Exited, Forked, Unforked, WorkerStart, encode, receive_now, send
from tests.helpers.paths import REPO
from tests.helpers.waiting import wait_for

SERVER = REPO / "tests" / "helpers" / "fork_server.py"


@pytest.fixture
def server() -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = subprocess.Popen(
        [sys.executable, str(SERVER), str(theirs.fileno())], pass_fds=(theirs.fileno(),), cwd=REPO
    )
    theirs.close()
    ours.settimeout(60)
    try:
        yield ours, process
    finally:
        ours.close()
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def test_each_child_is_reaped_and_its_exit_told(
    server: tuple[socket.socket, subprocess.Popen[bytes]],
) -> None:
    control, process = server
    for code in (0, 7, 3):
        send(control, Exited(code=code))
        forked = receive_now(control, [Forked, Exited])
        assert isinstance(forked.message, Forked), forked
        os.close(forked.fds[0])
        told = receive_now(control, [Forked, Exited])
        assert told.message == Exited(code=code)
    # Reaped, not left a zombie: the server has no child at all.
    assert wait_for(lambda: _children(process.pid) == [], timeout=60, what="no child of the server")


@pytest.fixture
def warm_template() -> Iterator[socket.socket]:
    """A real warm worker template (``rollcage template FD PARENT``) and its control socket."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    process = subprocess.Popen(
        [sys.executable, "-I", "-B", "-m", "rollcage", "template", str(theirs.fileno()), str(os.getpid())],
        pass_fds=(theirs.fileno(),),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    theirs.close()
    try:
        yield ours
    finally:
        ours.close()
        try:
            process.wait(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def _start(control: socket.socket, frame: bytes, *, gone: bool = False) -> socket.socket:
    """Send a start (``frame``, with /dev/null for the holder and the log); its report socket, ours
    (``gone``: closed before the start is sent, as by a supervisor gone before the answer)."""
    report, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if gone:
        report.close()
    null = os.open("/dev/null", os.O_RDWR)
    try:
        socket.send_fds(control, [frame], [null, theirs.fileno(), null])
    finally:
        os.close(null)
        theirs.close()
    if not gone:
        report.settimeout(60)
    return report


def test_the_warm_template_answers_every_start_and_outlives_a_supervisor_gone_mid_start(
    warm_template: socket.socket,
) -> None:
    # A pidfd that is not one: the template cannot join the holder's PID namespace, and says so.
    start = WorkerStart(argv=[], env={}, cwd="/", uid=65534, gid=65534)
    with _start(warm_template, encode(start)) as report:
        said = receive_now(report, [Unforked])
        assert isinstance(said.message, Unforked), said
        assert said.message.reason.startswith("cannot enter the sandbox's PID namespace"), said
    # Malformed: nothing is forked, and the start hears why.
    with _start(warm_template, encode(start)[:-1]) as report:
        said = receive_now(report, [Unforked])
        assert isinstance(said.message, Unforked), said
        assert said.message.reason.startswith("a malformed start: WorkerStart: a body of"), said
    # Gone before its answer (a supervisor cancelled or killed): the answer finds no one.
    _start(warm_template, encode(start), gone=True)
    with _start(warm_template, encode(start)) as report:
        said = receive_now(report, [Unforked])
        assert isinstance(said.message, Unforked), said
