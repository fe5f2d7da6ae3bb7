"""The one HTTP/1.1 server loop (rollcage.http.HttpServer): its bounds and timeouts, on real loopback sockets.

The egress proxy and the harness's forwarder both serve through this loop; these tests hold
it to its contract with a plain echo service, one failure mode each: what a client can make
the server hold (a slow or large head, a large body), how long (an idle kept-alive
connection), and that every exchange is finished exactly once however it ends (a client
that vanishes mid-body, requests pipelined behind one another, the server's shutdown).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import h11
import pytest

from rollcage.http import ABORTED, Answer, Exchange, HttpServer, Reply, ServerLimits
from tests.helpers.waiting import wait_for_async

TIGHT = ServerLimits(
    max_head_bytes=4096,
    max_body_bytes=4096,
    max_held_bytes=8192,
    idle_timeout_s=0.5,
    head_timeout_s=0.5,
    body_timeout_s=0.5,
    max_connections=4,
)
"""Short timeouts, so a test that waits for one is quick; they are bounds, never awaited as a clock."""
BOUND_S = 20.0
"""How long a test waits for anything the server does (generous: the machine may be busy)."""


class Echo:
    """A service that answers each request with its body; it keeps every exchange it is asked to finish."""

    def __init__(self) -> None:
        self.finished: list[Exchange] = []
        self.hold = asyncio.Event()
        """Requests to ``/hold`` wait for this before they are answered."""

    def begin(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        started_at: float,
        *,
        readable: bool,
    ) -> Exchange:
        return Exchange(method=method, target=target, request_headers=headers, started_at=started_at)

    def answer(self, exchange: Exchange, status: int, message: str) -> Answer:
        return Answer(status, [(b"content-type", b"text/plain")], message.encode())

    async def respond(self, exchange: Exchange, reply: Reply) -> bool:
        if exchange.target == "/hold":
            await self.hold.wait()
        if exchange.target == "/fail":
            raise RuntimeError("the service broke")
        body = b"echo:" + exchange.request_body
        await reply.answer(exchange, Answer(200, [(b"content-type", b"text/plain")], body))
        return True

    async def finish(self, exchange: Exchange) -> bool:
        self.finished.append(exchange)
        return True


class Rig:
    def __init__(self, server: HttpServer[Exchange], service: Echo, port: int) -> None:
        self.server = server
        self.service = service
        self.port = port

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def finished(self, count: int) -> list[Exchange]:
        """The finished exchanges once there are ``count`` of them and the server holds no connection."""

        def done() -> list[Exchange] | None:
            ready = len(self.service.finished) >= count and not self.server.connections
            return self.service.finished if ready else None

        return await wait_for_async(done, within_s=BOUND_S, what=f"{count} finished exchanges")


@asynccontextmanager
async def serving(limits: ServerLimits = TIGHT) -> AsyncIterator[Rig]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    service = Echo()
    async with HttpServer(
        listener, service, limits, name="test server", busy=b"HTTP/1.1 503 Busy\r\n\r\n"
    ) as server:
        yield Rig(server, service, listener.getsockname()[1])


async def read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    async with asyncio.timeout(BOUND_S):
        return await reader.read()


def post(target: str, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (target.encode(), len(body), body)


async def test_a_head_trickled_byte_by_byte_is_cut_off_at_the_head_timeout() -> None:
    # Slow loris: each byte arrives well within the timeout, the head never ends. The timeout runs
    # from the head's first byte, not from the last one, so the connection cannot be held open.
    async with serving() as rig:
        reader, writer = await rig.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        answer = asyncio.ensure_future(read_to_end(reader))
        async with asyncio.timeout(BOUND_S):
            while not answer.done():
                writer.write(b"a")
                await writer.drain()
                await asyncio.wait({answer}, timeout=0.05)  # the client's pace, not a synchronisation
        writer.close()
        assert answer.result().startswith(b"HTTP/1.1 408 "), answer.result()[:80]
        (exchange,) = await rig.finished(1)
        assert exchange.status == 408 and "head did not arrive within 0.5s" in (exchange.error or "")


async def test_a_head_over_its_bound_is_refused_with_431_and_the_connection_closed() -> None:
    async with serving() as rig:
        reader, writer = await rig.connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8000 + b"\r\n\r\n")
        answer = await read_to_end(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:80]
        (exchange,) = await rig.finished(1)
        assert exchange.status == 431 and exchange.method == "GET" and exchange.target == "/"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_over_its_bound_is_refused_with_413(framing: str) -> None:
    # Told up front (Content-Length: refused before a byte of the body is read), or found out
    # while reading (chunked).
    async with serving() as rig:
        reader, writer = await rig.connect()
        if framing == "content-length":
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n")
        else:
            chunk = b"x" * 3000
            writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2)
        answer = await read_to_end(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413 ") and b"request body over 4096 bytes" in answer, answer[:120]
        (exchange,) = await rig.finished(1)
        assert exchange.status == 413 and exchange.request_body == b""
        assert rig.server.held == 0


async def test_a_kept_alive_connection_left_idle_is_closed_with_nothing_to_finish() -> None:
    async with serving() as rig:
        reader, writer = await rig.connect()
        writer.write(post("/", b"one"))
        await writer.drain()
        # The answer, then silence from the client: the server closes the connection on its own.
        answer = await read_to_end(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(b"echo:one"), answer
        (exchange,) = await rig.finished(1)
        assert exchange.status == 200 and exchange.error is None


@pytest.mark.parametrize("leaving", ["close", "reset"])
async def test_a_client_that_vanishes_mid_body_is_finished_with_the_reason_and_its_bytes_released(
    leaving: str,
) -> None:
    async with serving() as rig:
        _reader, writer = await rig.connect()
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n\r\n" + b"x" * 1000)
        await writer.drain()
        await wait_for_async(lambda: rig.server.held == 1000, within_s=BOUND_S, what="the body's first bytes")
        if leaving == "close":
            writer.close()
        else:
            writer.transport.abort()
        (exchange,) = await rig.finished(1)
        assert exchange.status is None  # nobody to answer: no refusal is made up for the record
        assert (exchange.error or "").startswith("the client connection failed: ConnectionResetError")
        assert rig.server.held == 0


async def test_pipelined_requests_are_each_answered_in_order_and_each_finished_once() -> None:
    bodies = [b"first", b"second" * 100, b"third"]
    async with serving(replace(TIGHT, idle_timeout_s=5.0)) as rig:
        reader, writer = await rig.connect()
        writer.write(
            b"".join(post(f"/{n}", body) for n, body in enumerate(bodies))
        )  # one write, three requests
        await writer.drain()
        client = h11.Connection(h11.CLIENT)
        answers: list[bytes] = []
        async with asyncio.timeout(BOUND_S):
            for n in range(len(bodies)):
                client.send(
                    h11.Request(
                        method="POST", target=f"/{n}", headers=[("Host", "x"), ("Content-Length", "0")]
                    )
                )
                client.send(h11.EndOfMessage())
                body = b""
                while True:
                    event = client.next_event()
                    if event is h11.NEED_DATA:
                        client.receive_data(await reader.read(65536))
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                answers.append(body)
                client.start_next_cycle()
        writer.close()
        assert answers == [b"echo:" + body for body in bodies]
        finished = await rig.finished(3)
        assert [(e.target, e.status, e.request_body) for e in finished] == [
            (f"/{n}", 200, body) for n, body in enumerate(bodies)
        ]


async def test_closing_the_server_aborts_an_exchange_in_progress_and_still_finishes_it() -> None:
    async with serving() as rig:
        reader, writer = await rig.connect()
        writer.write(post("/hold", b"x"))
        await writer.drain()
        await wait_for_async(lambda: rig.server.held == 1, within_s=BOUND_S, what="the request to be read")
        await rig.server.aclose()
        assert await read_to_end(reader) == b""  # closed, not left open
        writer.close()
        (exchange,) = rig.service.finished
        assert exchange.error == ABORTED and not rig.server.connections and rig.server.held == 0


async def test_connections_over_the_cap_get_the_busy_answer_at_accept() -> None:
    async with serving(replace(TIGHT, max_connections=1, idle_timeout_s=30.0)) as rig:
        _held_reader, held = await rig.connect()
        held.write(post("/", b"a"))  # served: the one slot is taken while the connection stays open
        await wait_for_async(lambda: rig.service.finished, within_s=BOUND_S, what="the first exchange")
        reader, writer = await rig.connect()
        answer = await read_to_end(reader)
        writer.close()
        held.close()
        assert answer == b"HTTP/1.1 503 Busy\r\n\r\n" and rig.server.refused == 1


async def test_a_service_that_fails_ends_its_connection_with_the_reason_and_the_server_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with serving() as rig:
        reader, writer = await rig.connect()
        writer.write(post("/fail", b"x"))
        assert await read_to_end(reader) == b""  # closed, not left open
        writer.close()
        (failed,) = await rig.finished(1)
        assert failed.error == "the server failed: RuntimeError: the service broke"
        assert "serving a connection failed" in caplog.text
        reader, writer = await rig.connect()
        writer.write(post("/", b"again"))
        answer = await read_to_end(reader)
        writer.close()
        assert answer.endswith(b"echo:again")
