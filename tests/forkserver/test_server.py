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

from rollcage.forkserver import Exited, Forked, receive_now, send
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
