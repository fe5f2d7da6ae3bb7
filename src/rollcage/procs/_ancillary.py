"""A message's ancillary data unpacked: the descriptors (``SCM_RIGHTS``) and the sender (``SCM_CREDENTIALS``).

Standard library only: the executor template, which imports nothing of ``rollcage`` (its heap is
every executor's), loads this file by path, as the rest of the house imports it from
:mod:`rollcage.procs`.
"""

from __future__ import annotations

import array
import socket
import struct

__all__ = ["CREDENTIALS_SPACE", "unpack_ancillary"]

_UCRED = struct.Struct("iII")
CREDENTIALS_SPACE = socket.CMSG_SPACE(_UCRED.size)
"""Ancillary room for one ``SCM_CREDENTIALS`` (the sender's PID, uid and gid; ``SO_PASSCRED`` on)."""


def unpack_ancillary(ancillary: list[tuple[int, int, bytes]]) -> tuple[list[int], int]:
    """(descriptors, sender's PID in this namespace, 0 if unknown) of a message's ancillary data."""
    fds: list[int] = []
    sender = 0
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", payload[: len(payload) - len(payload) % 4])
        elif level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            sender = _UCRED.unpack(payload[: _UCRED.size])[0]
    return fds, sender
