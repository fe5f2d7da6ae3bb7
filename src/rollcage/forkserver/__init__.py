"""The fork servers: a pre-imported process that forks each child into the cage made for it.

Warm workers and forked executors are one idea: a process that has paid its imports once (the
worker's, for the warm worker template; a fresh interpreter's, for the executor template) waits on
a socket, and for each start joins the PID namespace of the cage's holder for one fork, forks the
child there, and goes home. The child joins the rest of the cage and becomes what a cold start
would have run. This room holds what both servers and their clients share:

* the messages and their one codec (:func:`encode`, :func:`send`, :func:`decode`:
  one framing, bounded sizes, every malformed datagram a :class:`WireError` that says why);
* the server's loop and its forks (:class:`ForkServer`), which imports nothing heavy itself:
  what a server pre-imports is its starter's choice;
* the client's side (:func:`receive`, :func:`receive_now`), descriptors through
  :func:`rollcage.procs.unpack_ancillary`.

The codec and the loop import nothing of ``rollcage``: the executor template, which must not (its
heap is every executor's), loads their files by path.

The two servers themselves: :mod:`rollcage.warm` (workers) and
:mod:`rollcage.tools._executor_template` (executors).
"""

from __future__ import annotations

from rollcage.forkserver._client import receive, receive_now
from rollcage.forkserver._server import ForkServer, fill_free_blocks
from rollcage.forkserver._wire import (
    MAX_PASS_FDS,
    MESSAGES,
    CommandStart,
    Entered,
    EnterFailed,
    ExecutorClient,
    ExecutorStart,
    ExecutorStarted,
    Exited,
    Forked,
    Message,
    Refused,
    Unforked,
    WireError,
    WorkerStart,
    decode,
    encode,
    pass_fds_problem,
    send,
)

__all__ = [
    "MAX_PASS_FDS",
    "MESSAGES",
    "CommandStart",
    "EnterFailed",
    "Entered",
    "ExecutorClient",
    "ExecutorStart",
    "ExecutorStarted",
    "Exited",
    "ForkServer",
    "Forked",
    "Message",
    "Refused",
    "Unforked",
    "WireError",
    "WorkerStart",
    "decode",
    "encode",
    "fill_free_blocks",
    "pass_fds_problem",
    "receive",
    "receive_now",
    "send",
]
