"""Plain HTTP/1.1 with h11 on an asyncio protocol: httpx's transport without httpcore and anyio.

Every model call of a worker, and every resource-tool call, goes to the
supervisor's egress proxy on a Unix socket, and the proxy forwards each to the
model server (over TCP; most often plain HTTP to a local inference server).
httpx's own transport runs each request through httpcore's pool and anyio's
streams (per request: a pool scan that asks every idle connection
``is_readable``, an anyio attribute table built with ``getpeername``, a task
group per read). This transport halves the client's CPU a request against a
local server (measured: docs/benchmarks/index.md). It keeps what a plain-HTTP
call needs and nothing more (HTTPS stays httpx's):

* h11 (httpx's own HTTP/1.1 parser): the same parsing, framing and checks (a
  malformed answer is a ``RemoteProtocolError``);
* connections kept alive and reused last in, first out, only after a whole
  answer was read, both sides may go on and nothing was received past it; an
  answer cut off, cancelled or failed closes its connection, and an idle one
  that received anything (bytes, an end of stream) or sat past ``idle_s`` is
  dropped, never used: no byte of one exchange is read as part of another;
* httpx's timeouts (``connect``, ``read``, ``write``) and exceptions
  (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``...), so its callers
  classify failures as they did.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import h11

from rollcage.http._httpx import httpx

__all__ = ["H11Transport", "exchange_in_memory"]

_READ_BYTES = 64 * 1024
_MAX_IDLE = 8
"""Idle connections kept per address by default (a worker has one call in flight; a harness a few)."""
_TCP_QUICKACK = getattr(socket, "TCP_QUICKACK", 12)
"""Linux's ``TCP_QUICKACK`` (Python names it on Linux only; 12 is its value there)."""


def exchange_in_memory() -> None:
    """One whole HTTP/1.1 exchange through an ``h11`` client connection, without a socket.

    h11 builds what it first needs (the ``typing`` unions it casts each event to, among them) the
    first time it runs, and keeps it: a warm template runs this once so that no worker it forks
    builds them again (~0.3 ms of each worker's CPU).
    """
    client = h11.Connection(h11.CLIENT)
    head = h11.Request(method="POST", target="/", headers=[("Host", "warm-up"), ("Content-Length", "2")])
    for event in (head, h11.Data(data=b"{}"), h11.EndOfMessage()):
        client.send(event)
    client.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    while not isinstance(client.next_event(), h11.EndOfMessage):
        pass
    client.start_next_cycle()


def _timeout(timeouts: dict[str, Any], name: str) -> float | None:
    value = timeouts.get(name)
    return float(value) if value is not None else None


class _Socket(asyncio.Protocol):
    """A stream socket's bytes as they arrive, with flow control both ways.

    A protocol of its own, not ``asyncio.StreamReader``: what arrived while the connection sat idle
    (stray bytes, an end of stream) must be seen before the connection is used again.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._quickack: socket.socket | None = None
        self.buffer = bytearray()
        self.eof = False
        self._readable: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            self._quickack = sock
        self._ack_now()

    def _ack_now(self) -> None:
        # A server that writes an answer's head and body apart with Nagle's algorithm on (uvicorn
        # on a socket whose protocol says 0, as some model servers make theirs) holds the body
        # until the head is acknowledged, and Linux delays that ACK by up to 40 ms. Asked after
        # every read, the kernel acknowledges at once: no 40 ms stall per call through the proxy.
        if self._quickack is not None:
            with contextlib.suppress(OSError):
                self._quickack.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)

    def data_received(self, data: bytes) -> None:
        self._ack_now()
        self.buffer += data
        if len(self.buffer) >= _READ_BYTES and self.transport is not None:
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.eof = True
        self._wake_reader()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake_reader(self) -> None:
        waiter, self._readable = self._readable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read(self) -> bytes:
        """What has arrived (at least a byte), or ``b""`` at the end of the stream."""
        while not self.buffer and not self.eof:
            self._readable = asyncio.get_running_loop().create_future()
            await self._readable
        data = bytes(self.buffer)
        self.buffer.clear()
        if self.transport is not None and not self.eof:
            self.transport.resume_reading()
        return data

    async def drain(self) -> None:
        """Wait until the kernel has room for more of what was written."""
        if self._writable is not None:
            # wait(), not await: a cancelled drain must leave the shared future to the next one.
            await asyncio.wait((self._writable,))
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the connection is closed")


class _Connection:
    """One socket and its h11 state machine."""

    def __init__(self, transport: asyncio.Transport, sock: _Socket, address: tuple[str, int] | str) -> None:
        self.transport = transport
        self.sock = sock
        self.address = address
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = time.monotonic()

    def usable(self, idle_s: float) -> bool:
        """Open, silent since its last answer (no stray byte, no end of stream) and not idle too long."""
        return (
            not self.transport.is_closing()
            and not self.sock.eof
            and not self.sock.buffer
            and time.monotonic() - self.idle_since < idle_s
        )

    async def send(self, request: httpx.Request, timeout_s: float | None) -> None:
        head = h11.Request(
            method=request.method, target=request.url.raw_path, headers=list(request.headers.raw)
        )
        try:
            async with asyncio.timeout(timeout_s):
                self.transport.write(self.h11.send(head) or b"")
                async for chunk in request.stream:  # type: ignore[union-attr]
                    if chunk:
                        self.transport.write(self.h11.send(h11.Data(data=chunk)) or b"")
                        await self.sock.drain()
                self.transport.write(self.h11.send(h11.EndOfMessage()) or b"")
                await self.sock.drain()
        except TimeoutError as exc:
            raise httpx.WriteTimeout(f"writing the request took over {timeout_s} s", request=request) from exc
        except h11.LocalProtocolError as exc:
            raise httpx.LocalProtocolError(str(exc), request=request) from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc) or type(exc).__name__, request=request) from exc

    async def next_event(self, request: httpx.Request, timeout_s: float | None) -> Any:
        """The next h11 event of the answer, reading as needed."""
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise httpx.RemoteProtocolError(str(exc), request=request) from exc
            if event is not h11.NEED_DATA:
                return event
            try:
                async with asyncio.timeout(timeout_s):
                    data = await self.sock.read()
            except TimeoutError as exc:
                raise httpx.ReadTimeout(f"no answer within {timeout_s} s", request=request) from exc
            if not data and self.h11.their_state is h11.SEND_RESPONSE:
                raise httpx.RemoteProtocolError(
                    "the server closed the connection without an answer", request=request
                )
            self.h11.receive_data(data)

    def reusable(self) -> bool:
        """Both sides done with a whole exchange, willing to go on, and nothing received beyond it."""
        return (
            self.h11.our_state is h11.DONE
            and self.h11.their_state is h11.DONE
            and not self.h11.trailing_data[0]
        )

    def close(self) -> None:
        self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response's body as it arrives; its connection goes back to the pool only after all of it."""

    def __init__(
        self,
        transport: H11Transport,
        connection: _Connection,
        request: httpx.Request,
        timeout_s: float | None,
    ) -> None:
        self._transport = transport
        self._connection: _Connection | None = connection
        self._request = request
        self._timeout_s = timeout_s
        self._complete = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        connection = self._connection
        if connection is None:
            raise httpx.StreamClosed()
        try:
            while True:
                event = await connection.next_event(self._request, self._timeout_s)
                if isinstance(event, h11.Data):
                    yield bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    self._complete = True
                    return
                elif isinstance(event, h11.ConnectionClosed):
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection in the middle of the answer", request=self._request
                    )
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        self._release()

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._transport._give_back(connection, reuse=self._complete and connection.reusable())


class H11Transport(httpx.AsyncBaseTransport):
    """httpx's transport for plain HTTP/1.1, over TCP or to one Unix socket (see the module docstring).

    Args:
        uds: The Unix socket every request goes to; ``None``: TCP to each request's host and port.
        max_idle: Idle connections kept (per address).
        idle_s: How long an idle connection is kept for the next request.
    """

    def __init__(self, *, uds: str | None = None, max_idle: int = _MAX_IDLE, idle_s: float = 20.0) -> None:
        self._uds = uds
        self._max_idle = max_idle
        self._idle_s = idle_s
        self._idle: dict[tuple[str, int] | str, list[_Connection]] = {}
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Send ``request`` on an idle connection or a new one; the answer's body streams (see ``_Body``).

        **Cancellation:** the connection in use is closed, never reused.
        """
        if self._closed:
            raise RuntimeError("the transport is closed")
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{request.url.scheme!r} is not plain HTTP", request=request)
        timeouts: dict[str, Any] = request.extensions.get("timeout", {})
        connection = await self._connection(request, _timeout(timeouts, "connect"))
        try:
            await connection.send(request, _timeout(timeouts, "write"))
            read_s = _timeout(timeouts, "read")
            while True:
                event = await connection.next_event(request, read_s)
                if isinstance(event, h11.Response):
                    break
                if isinstance(event, h11.ConnectionClosed):
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection without an answer", request=request
                    )
                # An informational (1xx) answer: the real one follows.
        except BaseException:
            connection.close()
            raise
        return httpx.Response(
            event.status_code,
            headers=event.headers.raw_items(),
            stream=_Body(self, connection, request, read_s),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": event.reason},
        )

    def _address(self, request: httpx.Request) -> tuple[str, int] | str:
        return self._uds if self._uds is not None else (request.url.host, request.url.port or 80)

    async def _connection(self, request: httpx.Request, timeout_s: float | None) -> _Connection:
        address = self._address(request)
        idle = self._idle.get(address, [])
        while idle:
            connection = idle.pop()
            if connection.usable(self._idle_s):
                return connection
            connection.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                if isinstance(address, str):
                    transport, sock = await loop.create_unix_connection(_Socket, address)
                else:
                    transport, sock = await loop.create_connection(_Socket, *address)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(
                f"no connection to {address} within {timeout_s} s", request=request
            ) from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {address}: {exc}", request=request) from exc
        assert isinstance(transport, asyncio.Transport)
        return _Connection(transport, sock, address)

    def _give_back(self, connection: _Connection, *, reuse: bool) -> None:
        idle = self._idle.setdefault(connection.address, [])
        if not reuse or self._closed or len(idle) >= self._max_idle:
            connection.close()
            return
        connection.h11.start_next_cycle()
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def aclose(self) -> None:
        """Close the idle connections; one still streaming an answer closes when that answer does.

        **Cancellation:** nothing here waits: the connections are closed at once.
        """
        self._closed = True
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
