"""The Unix-socket transport: httpx's timeouts, errors and streaming, and keep-alive that leaks nothing.

A real server on a real Unix socket, written here so each test controls every byte it sends
and sees every connection the transport opens.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollcage.http import H11Transport, httpx, transport_for

BOUND_S = 30.0

Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]
"""Serves one request on a connection (its index given): whether the connection stays open."""


def _ok(body: bytes, *extra: str) -> bytes:
    head = "".join(f"{line}\r\n" for line in extra)
    return f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (content-length framed); ``b""`` at the end of the stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + (await reader.readexactly(length) if length else b"")


@dataclass
class Place:
    """Where the server listens: a Unix socket, or TCP on loopback (its port known once it listens)."""

    uds: Path | None
    port: int = 0

    def base_url(self) -> str:
        return "http://proxy" if self.uds is not None else f"http://127.0.0.1:{self.port}"


class Server:
    """An HTTP server whose answers are the test's; it counts connections and requests."""

    def __init__(self, place: Place, answer: Answer) -> None:
        self.place = place
        self.answer = answer
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = 0
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                request = await _read_request(reader)
                if not request:
                    self.closed_by_client += 1
                    return
                self.requests.append(request)
                if not await self.answer(reader, writer, len(self.requests)):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_by_client += 1
        finally:
            writer.close()

    async def __aenter__(self) -> Server:
        if self.place.uds is not None:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.place.uds))
        else:
            self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.place.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await self._server.wait_closed()


@pytest.fixture(params=["unix", "tcp"])
def sock(request: pytest.FixtureRequest, tmp_path: Path) -> Place:
    if request.param == "unix":
        return Place(tmp_path / "s.sock")
    with socket.socket() as probe:  # a port nothing listens on, until a Server takes another
        probe.bind(("127.0.0.1", 0))
        return Place(None, probe.getsockname()[1])


@contextlib.asynccontextmanager
async def client(sock: Place, **timeouts: float) -> AsyncIterator[httpx.AsyncClient]:
    timeout = httpx.Timeout(BOUND_S, **timeouts)  # type: ignore[arg-type]
    transport = H11Transport(uds=None if sock.uds is None else str(sock.uds))
    async with httpx.AsyncClient(transport=transport, timeout=timeout, base_url=sock.base_url()) as http:
        yield http


async def _simple(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
    writer.write(_ok(b"answer %d" % index))
    await writer.drain()
    return True


async def test_requests_share_one_kept_alive_connection_and_bodies_arrive_whole(sock: Place) -> None:
    async with Server(sock, _simple) as server, client(sock) as http:
        answers = [await http.post("/model/v1/chat", content=b"q" * 100) for _ in range(3)]
    assert [a.content for a in answers] == [b"answer 1", b"answer 2", b"answer 3"]
    assert server.connections == 1
    assert all(request.endswith(b"q" * 100) for request in server.requests)
    assert f"host: {sock.base_url().removeprefix('http://')}".encode() in server.requests[0].lower()


async def test_a_large_request_body_is_sent_whole(sock: Place) -> None:
    body = bytes(range(256)) * (24 * 1024)  # 6 MiB: past every socket buffer
    async with Server(sock, _simple) as server, client(sock) as http:
        answer = await http.post("/x", content=body)
    assert answer.status_code == 200 and server.requests[0].endswith(body)


async def test_a_body_streams_as_it_arrives(sock: Place) -> None:
    first_read = asyncio.Event()

    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.wait_for(first_read.wait(), BOUND_S)  # sent only once the client has the first
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        return True

    async with Server(sock, chunked), client(sock) as http, http.stream("GET", "/sse") as answer:
        parts = []
        async for part in answer.aiter_raw():
            parts.append(part)
            first_read.set()
    assert parts == [b"first", b"second"]


async def test_an_answer_read_in_part_closes_its_connection(sock: Place) -> None:
    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        writer.write(_ok(b"x" * 500_000))
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        return True

    async with Server(sock, big) as server, client(sock) as http:
        async with http.stream("GET", "/a") as answer:
            async for _ in answer.aiter_raw():
                break
        await http.get("/b")
    assert server.connections == 2  # the rest of the first answer is never read as the second


async def test_bytes_past_an_answer_are_never_read_as_the_next_answer(sock: Place) -> None:
    async def stray(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        # An answer, then a forged one on the same connection before any request asked for it.
        writer.write(_ok(b"real %d" % index) + _ok(b"forged"))
        await writer.drain()
        return True

    async with Server(sock, stray) as server, client(sock) as http:
        first = await http.get("/1")
        second = await http.get("/2")
    assert (first.content, second.content) == (b"real 1", b"real 2")
    assert server.connections == 2


async def test_a_connection_the_server_closed_while_idle_is_not_used(sock: Place) -> None:
    async def once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        writer.write(_ok(b"bye"))
        await writer.drain()
        return False  # closed after one answer, without saying so

    async with Server(sock, once) as server, client(sock) as http:
        assert (await http.get("/1")).content == b"bye"
        for _ in range(100):  # let the end of the stream arrive (loop turns, not time)
            await asyncio.sleep(0)
        assert (await http.get("/2")).content == b"bye"
    assert server.connections == 2


async def test_connection_close_is_honoured(sock: Place) -> None:
    async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        writer.write(_ok(b"done", "connection: close"))
        await writer.drain()
        return True  # the server would go on: the client must not

    async with Server(sock, closing) as server, client(sock) as http:
        await http.get("/1")
        await http.get("/2")
    assert server.connections == 2


async def test_a_server_that_closes_without_an_answer_is_a_remote_protocol_error(sock: Place) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        return False

    async with Server(sock, silent), client(sock) as http:
        with pytest.raises(httpx.RemoteProtocolError, match="without an answer"):
            await http.get("/")


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part", id="body-cut-off"),
        pytest.param(b"this is not HTTP\r\n\r\n", id="not-http"),
    ],
)
async def test_an_answer_cut_off_or_not_http_is_a_remote_protocol_error(sock: Place, sent: bytes) -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        writer.write(sent)
        await writer.drain()
        return False

    async with Server(sock, broken), client(sock) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/")


async def test_a_silent_server_is_a_read_timeout_and_the_connection_is_dropped(sock: Place) -> None:
    release = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        if index == 1:
            await release.wait()
            return False
        return await _simple(reader, writer, index)

    async with Server(sock, hang) as server, client(sock, read=0.2) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.get("/1")
        release.set()
        assert (await http.get("/2")).content == b"answer 2"
    assert server.connections == 2


async def test_no_server_is_a_connect_error(sock: Place) -> None:
    async with client(sock) as http:
        with pytest.raises(httpx.ConnectError, match="cannot connect"):
            await http.get("/")


async def test_a_cancelled_request_closes_its_connection(sock: Place) -> None:
    answered, never = asyncio.Event(), asyncio.Event()

    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: int) -> bool:
        if index == 1:
            answered.set()
            await never.wait()  # no answer while the client is cancelled
        return await _simple(reader, writer, index)

    async with Server(sock, slow_first) as server, client(sock) as http:
        call = asyncio.create_task(http.get("/1"))
        await asyncio.wait_for(answered.wait(), BOUND_S)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert (await http.get("/2")).content == b"answer 2"
        # The first handler answers a connection the client has closed, and ends: from Python 3.12
        # on, the server's wait_closed() waits for every handler's connection.
        never.set()
    assert server.connections == 2


def test_plain_http_takes_this_transport_and_https_httpxs() -> None:
    assert isinstance(transport_for("http://proxy/model/v1", uds="/run/p.sock"), H11Transport)
    assert isinstance(transport_for("http://127.0.0.1:8000/v1", uds=None), H11Transport)
    assert isinstance(transport_for("https://api.example/v1", uds=None), httpx.AsyncHTTPTransport)


class _RecordingSocket:
    def __init__(self, family: int) -> None:
        self.family = family
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))


class _FakeTransport(asyncio.Transport):
    def __init__(self, sock: _RecordingSocket) -> None:
        super().__init__()
        self._sock = sock

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self._sock if name == "socket" else default


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6, socket.AF_UNIX])
def test_tcp_connections_acknowledge_every_read_at_once(family: int) -> None:
    # A server with Nagle's algorithm on holds an answer's body until its head is acknowledged;
    # Linux delays that ACK by up to 40 ms unless asked, after each read, to acknowledge at once.
    from rollcage.http._client import _Socket

    recorded = _RecordingSocket(family)
    protocol = _Socket()
    protocol.connection_made(_FakeTransport(recorded))
    protocol.data_received(b"HTTP/1.1 200 OK\r\n")
    protocol.data_received(b"content-length: 0\r\n\r\n")
    quickack = getattr(socket, "TCP_QUICKACK", 12)
    expected = [] if family == socket.AF_UNIX else [(socket.IPPROTO_TCP, quickack, 1)] * 3
    assert recorded.options == expected
