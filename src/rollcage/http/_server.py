"""One HTTP/1.1 server loop on h11, with every bound and timeout: the egress proxy's and the forwarder's.

Two servers take requests from code rollcage does not trust: the supervisor's
egress proxy (a Unix socket bound into the sandbox) and the harness's forwarder
(``127.0.0.1`` inside it). Whatever serves them must bound what a client can
make it hold and close every connection on every path; that is done here, once.
A server is an :class:`HttpServer` on a listening socket and a :class:`Service`
that says what each request means::

    accept ──► admit? ──no──► the busy answer (503), closed
                 │yes
                 ▼
    ┌──► next request's head ──(idle: closed quietly; slow, too large, malformed: 408/431/400)
    │            │
    │      service.begin(head)                         the service classifies the request
    │            │
    │      the body, whole ──(slow: 408; too large: 413; all connections' bodies too large: 503)
    │            │
    │      service.respond(exchange, reply)            streams its answer through ``reply``
    │            │
    │      service.finish(exchange)                    exactly once per exchange, whatever ended
    │            │                                     it (the capture hook), shielded
    └──keep-alive┘

Each bound and timeout of :class:`ServerLimits` is enforced in one place:

* ``idle_timeout_s``: no request in progress (after the accept, between
  requests): the connection is closed quietly, nothing to record. It also bounds
  each send of an answer to a client that reads nothing (``ConnectionAbortedError``).
* ``head_timeout_s``: from a request's first byte to the end of its head: 408.
  A slow client cannot hold a connection by trickling its head (slow loris).
* ``max_head_bytes``: a head larger than this: 431 (h11's hint); a malformed one: 400.
* ``body_timeout_s``: from the end of the head to the end of the body: 408.
* ``max_body_bytes``: a body larger than this, told up front (``Content-Length``)
  or found out while reading: 413.
* ``max_held_bytes``: the request bytes all connections hold at once (a service
  may count more, through :attr:`HttpServer.held`): 503.
* ``max_connections``: connections open at once, unless the server is given its own
  ``admit``; more get the ``busy`` answer at accept and are closed.

A request the server answers itself (the 4xx and 503 above) is an exchange too: the
service formats the answer (:meth:`Service.answer`) and sees it in ``finish``, and the
connection is then closed, after briefly reading what the client still sends so that
the client sees the answer rather than a reset. Requests pipelined behind one
another are served in order; a next request's bytes are never read before its turn.

The server runs its own accept loop rather than ``asyncio.start_server``: out of
descriptors (``EMFILE``), asyncio's server logs an error and retries a second
later, and if the server is closed meanwhile the retry raises ``ValueError:
Invalid file descriptor: -1``; here accepting backs off briefly, and every accepted
socket is closed on every path.

Why h11 and not uvicorn: one proxy runs per rollout, many in one event loop;
``uvicorn.Server`` installs process-wide signal handlers while it serves and
brings lifespan machinery we do not need, whereas a small h11 loop gives exact
control over byte bounds, streaming and shutdown. h11 is httpx's HTTP/1.1 engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, Self, TypeVar

import h11

from rollcage.procs import AsyncClosing, cancel_and_wait, shielded

__all__ = ["ABORTED", "Answer", "Exchange", "HttpServer", "Reply", "ServerLimits", "Service"]

logger = logging.getLogger("rollcage.http")

ABORTED = "aborted: the rollout ended while the exchange was in progress"
"""The error of an exchange cut short by the server's shutdown."""

_CHUNK = 65536
_ACCEPT_RETRY_S = 0.05
# While the server is over its connection cap, each refusal is followed by this pause: a client
# that floods the socket costs the event loop at most ~100 accepts a second, and waits in the
# kernel's backlog meanwhile (its connect() blocks) rather than in this process.
_REFUSE_PAUSE_S = 0.01
_DISCARD_S = 1.0
_OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})

_T = TypeVar("_T")


@dataclass(frozen=True)
class ServerLimits:
    """What one client may make a server hold, and for how long (see the module docstring)."""

    max_head_bytes: int = 64 * 1024
    """Largest request head (request line and headers); larger: 431."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body; larger: 413."""
    max_held_bytes: int = 64 * 1024 * 1024
    """Request bytes held at once over all connections (and what the service adds); past it: 503."""
    idle_timeout_s: float = 30.0
    """A connection with no request in progress is closed after this long; also bounds one send."""
    head_timeout_s: float = 10.0
    """From a request's first byte to the end of its head; past it: 408."""
    body_timeout_s: float = 30.0
    """From the end of a request's head to the end of its body; past it: 408."""
    max_connections: int = 64
    """Connections open at once, when the server has no ``admit`` of its own."""


@dataclass
class Exchange:
    """One request and what became of it, filled in as it happens; a service may subclass it."""

    method: str
    """The request's method ("" when its head could not be read)."""
    target: str
    """The request target as sent ("" when its head could not be read)."""
    request_headers: list[tuple[bytes, bytes]]
    """The request's headers as sent (``[]`` when its head could not be read)."""
    started_at: float
    """Unix time of the request's first byte."""
    request_body: bytes = b""
    """The request body, read whole before :meth:`Service.respond`."""
    status: int | None = None
    """The response status sent; ``None``: none was."""
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    """The response headers sent (without framing headers the server adds)."""
    error: str | None = None
    """Why the exchange did not end normally; ``None``: it did."""
    held: int = 0
    """Request bytes of this exchange counted in :attr:`HttpServer.held` until it is finished."""


@dataclass(frozen=True)
class Answer:
    """A whole response that a server or service makes up itself (a refusal, an error).

    Attributes:
        status: Its status.
        headers: Its headers, without ``Content-Length`` (added when it is sent).
        body: Its body.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


_E = TypeVar("_E", bound=Exchange)


class Service(Protocol[_E]):
    """What a server's requests mean: the part of a server that is not HTTP/1.1."""

    def begin(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        started_at: float,
        *,
        readable: bool,
    ) -> _E:
        """A new exchange for a request whose head has arrived (``readable``) or could not be read."""
        ...

    def answer(self, exchange: _E, status: int, message: str) -> Answer:
        """The server's own answer ``status`` to ``exchange``, saying ``message`` (a refusal)."""
        ...

    async def respond(self, exchange: _E, reply: Reply) -> bool:
        """Answer ``exchange`` (its body read whole) through ``reply``; whether the connection may go on.

        **Cancellation:** the server is closing: the exchange is aborted, and still finished.
        """
        ...

    async def finish(self, exchange: _E) -> bool:
        """Called exactly once per exchange, however it ended; whether the connection may go on.

        **Cancellation:** never: the server shields it.
        """
        ...


class Reply:
    """The response side of one connection, as a service writes an answer through it.

    Every send waits at most ``idle_timeout_s`` for a client that reads nothing, then raises
    ``ConnectionAbortedError``.
    """

    def __init__(self, sock: socket.socket, conn: h11.Connection, idle_timeout_s: float) -> None:
        self._sock = sock
        self._conn = conn
        self._idle_s = idle_timeout_s

    async def head(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"") -> None:
        """Send the response head.

        **Cancellation:** the connection is left mid-answer (the server closes it).
        """
        await self._send(self._conn.send(h11.Response(status_code=status, headers=headers, reason=reason)))

    async def data(self, chunk: bytes) -> None:
        """Send a piece of the body.

        **Cancellation:** as for :meth:`head`.
        """
        await self._send(self._conn.send(h11.Data(data=chunk)))

    async def end(self) -> None:
        """End the response.

        **Cancellation:** as for :meth:`head`.
        """
        await self._send(self._conn.send(h11.EndOfMessage()))

    async def answer(self, exchange: Exchange, answer: Answer) -> None:
        """Send ``answer`` whole, and note its status and headers on ``exchange``.

        **Cancellation:** as for :meth:`head`.
        """
        exchange.status = answer.status
        exchange.response_headers = list(answer.headers)
        headers = [*answer.headers, (b"content-length", b"%d" % len(answer.body))]
        data = self._conn.send(h11.Response(status_code=answer.status, headers=headers)) or b""
        data += self._conn.send(h11.Data(data=answer.body)) or b""
        data += self._conn.send(h11.EndOfMessage()) or b""
        await self._send(data)

    async def proceed(self) -> None:
        """Tell a client that waits for ``100 Continue`` to send its body.

        **Cancellation:** as for :meth:`head`.
        """
        await self._send(self._conn.send(h11.InformationalResponse(status_code=100, headers=[])))

    async def until_client_leaves(self, work: Coroutine[Any, Any, _T]) -> _T | None:
        """Run ``work`` (the answer); ``None`` if the client left first (``work`` is then cancelled).

        While an upstream answers, the client is watched: if it goes away (a worker killed or timed
        out), the upstream request is abandoned rather than left hanging. The watch only peeks: a
        client may send its next request the moment the response ends, and bytes read by a watch
        that is being cancelled would be lost.

        **Cancellation:** ``work`` is cancelled and awaited.
        """
        task = asyncio.create_task(work)
        try:
            if await _client_left(self._sock, task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
            return await task
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _send(self, data: bytes | None) -> None:
        if data:
            try:
                async with asyncio.timeout(self._idle_s):
                    await asyncio.get_running_loop().sock_sendall(self._sock, data)
            except TimeoutError:
                raise ConnectionAbortedError(
                    f"the client read nothing of the response for {self._idle_s:g}s"
                ) from None


class _Refusal(Exception):
    """The server answers the request itself with ``status`` and closes the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Connection:
    """One accepted socket; ``close`` is idempotent and gives its admission back."""

    def __init__(self, sock: socket.socket, on_release: Callable[[], None] | None) -> None:
        self.sock = sock
        self._on_release = on_release
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self.sock.close()
            if self._on_release is not None:
                self._on_release()


class HttpServer(AsyncClosing, Generic[_E]):
    """An HTTP/1.1 server on a listening socket, as an async context manager (see the module docstring).

    Args:
        listener: A bound, listening, non-blocking stream socket; the server closes it.
        service: What each request means.
        limits: Bounds and timeouts.
        name: Who the server is, for logs ("rollout r1: the egress proxy").
        busy: The bytes sent to a connection refused at accept (a whole ``503`` response).
        admit: Awaited with the number of connections open, for each accepted one: whether
            to serve it; ``None``: fewer than ``limits.max_connections`` are open.
        on_release: Called once for each admitted connection when it is closed.
    """

    def __init__(
        self,
        listener: socket.socket,
        service: Service[_E],
        limits: ServerLimits,
        *,
        name: str,
        busy: bytes,
        admit: Callable[[int], Awaitable[bool]] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self._listener = listener
        self._service = service
        self._limits = limits
        self._name = name
        self._busy = busy
        self._admit = admit
        self._on_release = on_release
        self._acceptor: asyncio.Task[None] | None = None
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        self.connections: dict[asyncio.Task[None], _Connection] = {}
        """The connections being served, by the task serving each."""
        self.held = 0
        """Request bytes held by the exchanges in progress (a service may add its own)."""
        self.refused = 0
        """Connections refused at accept."""

    async def __aenter__(self) -> Self:
        """Start accepting.

        **Cancellation:** nothing here waits.
        """
        if self._state != "unopened":
            raise RuntimeError(f"{self._name} is {self._state}; it can be started only once")
        self._state = "open"
        self._acceptor = asyncio.create_task(self._accept_loop())
        return self

    async def aclose(self) -> None:
        """Stop accepting, abort the exchanges in progress (each is still finished), close every socket.

        **Cancellation:** shutdown finishes first (it waits only for tasks it cancelled itself), then
        ``CancelledError`` propagates.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        await shielded(self._shut_down())

    async def _shut_down(self) -> None:
        await cancel_and_wait(self._acceptor)
        self._listener.close()
        await cancel_and_wait(*self.connections)
        # A handler cancelled before its first step never ran its own clean-up.
        for connection in self.connections.values():
            connection.close()
        self.connections.clear()

    # ----------------------------------------------------------------- accepting

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        failing = False
        while True:
            try:
                sock, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                # Out of descriptors (EMFILE/ENFILE) or memory, or a connection that went away before
                # it was accepted: the pending ones wait in the backlog; try again shortly.
                if exc.errno in _OUT_OF_DESCRIPTORS and not failing:
                    logger.warning("%s cannot accept for now: %s", self._name, exc)
                failing = True
                await asyncio.sleep(_ACCEPT_RETRY_S)
                continue
            failing = False
            if not await self._admitted():
                self._refuse(sock)
                await asyncio.sleep(_REFUSE_PAUSE_S)
                continue
            connection = _Connection(sock, self._on_release)
            task = asyncio.create_task(self._on_connection(connection))
            self.connections[task] = connection

    async def _admitted(self) -> bool:
        if self._admit is not None:
            return await self._admit(len(self.connections))
        return len(self.connections) < self._limits.max_connections

    def _refuse(self, sock: socket.socket) -> None:
        if self.refused == 0:
            logger.warning(
                "%s holds %d connections, its cap; refusing more", self._name, len(self.connections)
            )
        self.refused += 1
        with contextlib.suppress(OSError):
            sock.send(self._busy)
        sock.close()

    # ----------------------------------------------------------------- one connection

    async def _on_connection(self, connection: _Connection) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._serve(connection.sock)
        except (OSError, h11.ProtocolError) as exc:
            logger.debug("%s: a connection ended: %r", self._name, exc)
        except Exception:
            # The service failed (its exchange is finished, with the reason): this connection ends,
            # the server serves on.
            logger.exception("%s: serving a connection failed", self._name)
        except asyncio.CancelledError:
            if self._state != "closed":
                raise
            # Our own shutdown cancelled this connection (its exchange is finished): end quietly.
        finally:
            self.connections.pop(task, None)
            connection.close()

    async def _serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=self._limits.max_head_bytes)
        reply = Reply(sock, conn, self._limits.idle_timeout_s)
        while True:
            head = await self._next_request(conn, sock)
            if head is None:
                return
            exchange, refusal = head
            go_on = False
            try:
                go_on = await self._exchange(conn, sock, reply, exchange, refusal)
            except asyncio.CancelledError:
                exchange.error = exchange.error or ABORTED
                raise
            except (OSError, h11.ProtocolError) as exc:
                exchange.error = (
                    exchange.error or f"the client connection failed: {type(exc).__name__}: {exc}"
                )
                raise
            except Exception as exc:
                exchange.error = exchange.error or f"the server failed: {type(exc).__name__}: {exc}"
                raise
            finally:
                # Exactly one finish per exchange, whatever ended it.
                try:
                    go_on = await shielded(self._service.finish(exchange)) and go_on
                finally:
                    self.held -= exchange.held
            if not go_on or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _next_request(
        self, conn: h11.Connection, sock: socket.socket
    ) -> tuple[_E, _Refusal | None] | None:
        """The next request as an exchange; ``None`` when the client is done (or idled out).

        A head that is malformed, too large or too slow comes with its refusal (400, 431, 408),
        so that it is answered and finished like any other exchange.
        """
        loop = asyncio.get_running_loop()
        limits = self._limits
        received = len(conn.trailing_data[0])
        begun = received > 0  # a pipelined request has begun already
        deadline = loop.time() + (limits.head_timeout_s if begun else limits.idle_timeout_s)
        started_at = time.time()
        try:
            while True:
                event = conn.next_event()
                if isinstance(event, h11.Request):
                    method = event.method.decode("ascii", "replace")
                    target = event.target.decode("ascii", "replace")
                    # h11 bounds a head only while it is incomplete: one that arrived whole in a
                    # single read is measured here.
                    over = received > limits.max_head_bytes  # cheap first: trailing_data copies
                    if over and received - len(conn.trailing_data[0]) > limits.max_head_bytes:
                        refused = _Refusal(431, f"request head over {limits.max_head_bytes} bytes")
                        return self._service.begin(method, target, [], started_at, readable=False), refused
                    headers = list(event.headers.raw_items())
                    return self._service.begin(method, target, headers, started_at, readable=True), None
                if event is not h11.NEED_DATA:  # ConnectionClosed
                    return None
                try:
                    data = await _recv(sock, deadline)
                except TimeoutError:
                    if not begun:
                        return None  # an idle connection: no request, nothing to finish
                    raise _Refusal(
                        408, f"the request head did not arrive within {limits.head_timeout_s:g}s"
                    ) from None
                if data and not begun:
                    begun, started_at = True, time.time()
                    deadline = loop.time() + limits.head_timeout_s
                received += len(data)
                conn.receive_data(data)
        except h11.RemoteProtocolError as exc:
            if not begun:
                return None
            refusal = _Refusal(exc.error_status_hint, f"malformed HTTP request: {exc}")
        except _Refusal as exc:
            refusal = exc
        method, target = _request_line(conn.trailing_data[0])
        return self._service.begin(method, target, [], started_at, readable=False), refusal

    async def _exchange(
        self, conn: h11.Connection, sock: socket.socket, reply: Reply, exchange: _E, refusal: _Refusal | None
    ) -> bool:
        """Read the body and have the service answer; ``True`` if the connection can carry another request."""
        if refusal is None:
            try:
                exchange.request_body = await self._read_body(conn, sock, reply, exchange)
            except _Refusal as exc:
                refusal = exc
            except h11.RemoteProtocolError as exc:
                refusal = _Refusal(exc.error_status_hint, f"malformed HTTP request body: {exc}")
        if refusal is None:
            return await self._service.respond(exchange, reply)
        exchange.error = refusal.message
        with contextlib.suppress(h11.LocalProtocolError):
            await reply.answer(exchange, self._service.answer(exchange, refusal.status, refusal.message))
        await self._discard_input(sock)
        return False

    async def _read_body(self, conn: h11.Connection, sock: socket.socket, reply: Reply, ex: _E) -> bytes:
        """The request body, whole and bounded; raises ``_Refusal`` past a bound or a timeout."""
        limits = self._limits
        limit = limits.max_body_bytes
        length = _header(ex.request_headers, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > limit:
            raise _Refusal(413, f"request body over {limit} bytes")
        deadline = asyncio.get_running_loop().time() + limits.body_timeout_s
        body = bytearray()
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += event.data
                ex.held += len(event.data)
                self.held += len(event.data)
                if len(body) > limit:
                    raise _Refusal(413, f"request body over {limit} bytes")
                if self.held > limits.max_held_bytes:
                    raise _Refusal(
                        503,
                        f"this rollout's requests in progress hold over {limits.max_held_bytes} bytes; retry",
                    )
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    await reply.proceed()
                try:
                    data = await _recv(sock, deadline)
                except TimeoutError:
                    raise _Refusal(
                        408, f"the request body did not arrive within {limits.body_timeout_s:g}s"
                    ) from None
                if not data:  # the client left: there is nobody to answer
                    raise ConnectionResetError(
                        "the client closed the connection in the middle of its request"
                    )
                conn.receive_data(data)
            else:  # ConnectionClosed
                raise ConnectionResetError("the client closed the connection in the middle of its request")

    async def _discard_input(self, sock: socket.socket) -> None:
        """Read and drop what the client still sends, briefly, before the connection is closed.

        Closing a socket with unread input resets it, and the client would see the
        reset instead of the answer (a 413 before the body was read). Bounded by a
        second and by ``max_body_bytes``.
        """
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
        deadline = asyncio.get_running_loop().time() + min(_DISCARD_S, self._limits.body_timeout_s)
        left = self._limits.max_body_bytes
        with contextlib.suppress(OSError, TimeoutError):
            while left > 0 and (data := await _recv(sock, deadline)):
                left -= len(data)


async def _recv(sock: socket.socket, deadline: float) -> bytes:
    async with asyncio.timeout_at(deadline):
        return await asyncio.get_running_loop().sock_recv(sock, _CHUNK)


def _header(pairs: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in pairs:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _request_line(data: bytes | bytearray) -> tuple[str, str]:
    """Method and target of a request head that could not be parsed, for the evidence ("" if none)."""
    line = bytes(data[:8192]).split(b"\r\n", 1)[0].split(b" ")
    if len(line) < 2:
        return "", ""
    return line[0][:32].decode("ascii", "replace"), line[1].decode("ascii", "replace")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _client_left(sock: socket.socket, work: asyncio.Future[Any]) -> bool:
    """Wait for ``work``; ``True`` if the client closed its connection first (nothing is read).

    Readability is only peeked at: end of stream (or an error) means the client left; bytes
    mean a next request is on its way, so the client is there, and watching stops.
    """
    loop = asyncio.get_running_loop()
    fd = sock.fileno()
    while not work.done():
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, readable)
        try:
            await asyncio.wait({work, readable}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(fd)
            readable.cancel()
        if work.done():
            return False
        try:
            peeked = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            continue  # woken for nothing: watch again
        except OSError:
            return True
        if peeked == b"":
            return True
        await asyncio.wait({work})  # the next request waits in the socket for its turn
    return False
