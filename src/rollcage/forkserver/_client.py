"""A fork server's client side: take its messages off a socket, whole and checked, or as errors.

Descriptors come through :func:`rollcage.procs.unpack_ancillary` (and the sender's PID, where the
socket passes credentials); every datagram goes through the codec's one :func:`decode`, and the
descriptors of one it refuses are closed here, so a malformed message leaks nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import NamedTuple

from rollcage.forkserver._wire import Message, WireError, decode, room
from rollcage.procs import CREDENTIALS_SPACE, unpack_ancillary, wait_readable

__all__ = ["Received", "receive", "receive_now"]


class Received(NamedTuple):
    """One datagram taken off a socket.

    Attributes:
        message: The message; ``None`` at the end of file, or where :attr:`error` says why not.
        fds: The descriptors that came with it (the receiver's to close; none with an error).
        sender: The sender's PID here, where the socket passes credentials (``SO_PASSCRED``); else 0.
        error: Why the datagram is not a message of the kinds expected (its descriptors closed).
    """

    message: Message | None
    fds: list[int]
    sender: int
    error: WireError | None = None

    @property
    def ended(self) -> bool:
        """Whether it is the end of file (the peer is gone)."""
        return self.message is None and self.error is None


def receive_now(
    sock: socket.socket, expect: Sequence[type[Message]], *, credentials: bool = False
) -> Received:
    """The next datagram of ``sock``, waiting only if the socket blocks.

    Raises:
        BlockingIOError: A non-blocking socket has nothing yet.
        OSError: The socket failed (other than a peer gone, which is an end of file).
    """
    size, fds = room(expect)
    ancillary_room = socket.CMSG_SPACE(4 * fds) + (CREDENTIALS_SPACE if credentials else 0)
    try:
        # Close-on-exec from the first instant: a process this one spawns meanwhile inherits none of them.
        data, ancillary, flags, _ = sock.recvmsg(size, ancillary_room, socket.MSG_CMSG_CLOEXEC)
    except (ConnectionResetError, BrokenPipeError):
        return Received(None, [], 0)
    received, sender = unpack_ancillary(ancillary)
    if not data and not received:
        return Received(None, [], sender)
    try:
        return Received(decode(data, received, flags, expect=expect), received, sender)
    except WireError as exc:
        _close(received)
        return Received(None, [], sender, exc)


async def receive(
    sock: socket.socket, expect: Sequence[type[Message]], *, credentials: bool = False
) -> Received:
    """The next datagram of the non-blocking ``sock``, once it comes (bound the wait: ``asyncio.timeout``).

    **Cancellation:** nothing is read.
    """
    while True:
        await wait_readable(sock.fileno())
        try:
            return receive_now(sock, expect, credentials=credentials)
        except BlockingIOError:
            continue


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
