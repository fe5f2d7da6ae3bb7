"""A fork server for tests: :class:`rollcage.forkserver.ForkServer` serving a toy request.

``python fork_server.py CTL``: each ``Exited(code=N)`` on ``CTL`` asks for a child that exits
with ``N``; the server answers ``Forked(pid)`` with a pidfd of it, and ``Exited(code=N)`` once it
has reaped it. It serves until ``CTL`` ends. No cage: the children are born where the server is.
"""

from __future__ import annotations

import os
import socket
import sys
from types import SimpleNamespace

from rollcage.forkserver import Exited, Forked, ForkServer, receive_now, send
from rollcage.procs import reap_children


def _clone_child() -> tuple[int, int]:
    pid = os.fork()
    return (pid, os.pidfd_open(pid)) if pid else (0, -1)


def main(control_fd: int) -> int:
    control = socket.socket(fileno=control_fd)

    def exited(pid: int, code: int) -> None:
        send(control, Exited(code=code))

    enter = SimpleNamespace(setns=lambda fd, flags: None, PID_NS=0, clone_child=_clone_child)
    server = ForkServer(control, enter, reap=reap_children, on_exit=exited)

    def serve() -> bool:
        got = receive_now(control, [Exited])
        if got.ended:
            return False
        if not isinstance(got.message, Exited):
            return True
        pid, pidfd = server.fork(sibling=False)
        if pid == 0:
            os._exit(got.message.code)
        send(control, Forked(pid=pid), [pidfd])
        os.close(pidfd)
        return True

    server.serve(serve)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
