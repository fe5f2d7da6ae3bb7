"""Reaping a fork server's own children, with nothing but the standard library.

The executor template (a fork server that imports nothing of ``rollcage``) loads this file by
path; the process-lifecycle room keeps every wait on a process, this one included.
"""

from __future__ import annotations

import os

__all__ = ["reap_children"]


def reap_children(until: int = 0) -> list[tuple[int, int]]:
    """Reap every child of this process that has exited, waiting for ``until`` first (0: for none).

    Returns:
        ``(pid, exit code)`` of each, the code as ``os.waitstatus_to_exitcode`` gives it (``-N``
        for signal N).
    """
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            pid, status, _ = os.wait3(0 if until else os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, os.waitstatus_to_exitcode(status)))
        if pid == until:
            until = 0
