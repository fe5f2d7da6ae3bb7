"""The egress proxy: allow-list routing, headers, credentials, streaming, bounds, and the capture.

The proxy is driven directly over its Unix socket with httpx (and raw bytes where
httpx would tidy a malicious request up), against a small recording upstream;
the last tests go end to end through ``supervise()`` with a fake worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollcage.protocol import CaptureExchange, WorkerInput, WorkerResult
from rollcage.supervisor import ProxyConfig, supervise
from rollcage.supervisor.proxy import _POOL_USERS, EgressProxy, Route, routes_for, sandbox_input
from tests.helpers.supervisor_env import (
    HELPERS,
    bwrap_usable,
    config,
    fake,
    make_rollout,
    processes_with_token,
)
from tests.helpers.supervisor_upstream import Upstream
from tests.helpers.waiting import wait_for_async

KEY = "sk-test-" + "0123456789abcdef"
IDENTITY = {"X-Rollout-Id": "r1", "X-Task-Id": "t1"}


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A Unix socket path must fit in ~107 bytes; pytest's tmp_path may not.
    path = Path(tempfile.mkdtemp(prefix="rc-proxy-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Harness:
    def __init__(self, proxy: EgressProxy, client: httpx.AsyncClient, capture: Path) -> None:
        self.proxy = proxy
        self.client = client
        self.capture = capture
        self.budget_events: list[tuple[str, str]] = []

    def records(self) -> list[dict[str, Any]]:
        text = self.capture.read_text()
        # A line the proxy is still writing (a large one takes more than one write) is not one yet.
        lines = text[: text.rfind("\n") + 1].splitlines()
        for line in lines:
            CaptureExchange.model_validate_json(line)  # every line keeps the published contract
        return [json.loads(line) for line in lines]

    async def settled(self, count: int = 1) -> list[dict[str, Any]]:
        """The capture once it holds ``count`` lines (each is written just after its exchange ends)."""

        def enough() -> list[dict[str, Any]] | None:
            records = self.records()
            return records if len(records) >= count else None

        return await wait_for_async(enough, within_s=10, what=f"{count} capture lines")

    async def connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_unix_connection(str(self.proxy.socket_path))

    async def raw(self, request: bytes) -> bytes:
        """Send raw bytes (for requests httpx would normalise) and read the whole answer."""
        reader, writer = await self.connect()
        try:
            writer.write(request)
            await writer.drain()
            async with asyncio.timeout(10):
                return await reader.read(65536)
        finally:
            writer.close()

    async def idle(self) -> None:
        """Wait until the proxy holds no connection (each handler has ended and captured)."""
        await wait_for_async(lambda: not self.proxy._handlers, within_s=10, what="the proxy to go idle")


def routes(upstream: Upstream) -> list[Route]:
    return [
        Route(
            kind="model", name="model", prefix="/model/v1", upstream=f"{upstream.base_url}/v1", credential=KEY
        ),
        Route(
            kind="resource",
            name="weather",
            prefix="/resource/weather",
            upstream=f"{upstream.base_url}/weather",
        ),
        Route(kind="resource", name="stuck", prefix="/resource/stuck", upstream=f"{upstream.base_url}/hang"),
        Route(kind="resource", name="down", prefix="/resource/down", upstream="http://127.0.0.1:1"),
    ]


@pytest.fixture
async def harness(
    upstream: Upstream, short_dir: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Harness]:
    limits: dict[str, Any] = dict(getattr(request, "param", {}))
    capture = Path(limits.pop("capture_dir", short_dir)) / "model_capture.jsonl"
    events: list[tuple[str, str]] = []
    proxy = EgressProxy(
        short_dir / "proxy.sock",
        routes(upstream),
        capture_path=capture,
        rollout_id="r1",
        config=ProxyConfig(**limits),
        identity=IDENTITY,
        on_budget_exceeded=lambda name, reason: events.append((name, reason)),
    )
    async with proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://rollcage-proxy", timeout=10
        ) as client:
            harness = Harness(proxy, client, capture)
            harness.budget_events = events
            yield harness


class _Owner:
    """What a supervision is to its proxy: it holds the proxy, and the proxy holds its callback."""

    proxy: EgressProxy | None = None

    def budget_passed(self, budget: str, reason: str) -> None:
        """The proxy's ``on_budget_exceeded``."""


async def test_a_closed_proxy_lets_go_of_its_owners_callback(upstream: Upstream, short_dir: Path) -> None:
    owner = _Owner()
    owner.proxy = EgressProxy(
        short_dir / "proxy.sock",
        routes(upstream),
        capture_path=short_dir / "model_capture.jsonl",
        rollout_id="r1",
        config=ProxyConfig(),
        identity=IDENTITY,
        on_budget_exceeded=owner.budget_passed,
    )
    async with owner.proxy:
        pass
    gone = weakref.ref(owner)
    # The owner goes with its last reference, without the collector (off, so that it cannot help).
    gc.disable()
    try:
        del owner
        assert gone() is None
    finally:
        gc.enable()


# --------------------------------------------------------------------------- routing and headers


async def test_model_request_carries_the_injected_credential_upstream(
    harness: Harness, upstream: Upstream
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = await harness.client.post(
        "/model/v1/chat/completions", json=body, headers={"Authorization": "Bearer from-the-sandbox"}
    )
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "hello"
    (seen,) = upstream.requests
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.headers["accept-encoding"] == "identity"
    assert seen.json() == body


async def test_identity_and_credential_headers_from_the_sandbox_are_replaced(
    harness: Harness, upstream: Upstream
) -> None:
    forged = {
        "X-Task-Id": "someone-elses-task",
        "X-Rollout-Id": "someone-elses-rollout",
        "X-Rollcage-Attempt": "9",
        "X-Api-Key": "sk-stolen",
        "Api-Key": "sk-stolen",
        "Proxy-Authorization": "Basic c3RvbGVu",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "hop-by-hop by nomination",
        "X-Kept": "yes",
    }
    for path in ("/model/v1/chat/completions", "/resource/weather/x"):
        assert (await harness.client.post(path, json={}, headers=forged)).status_code == 200
    for seen in upstream.requests:
        assert (seen.headers["x-task-id"], seen.headers["x-rollout-id"]) == ("t1", "r1")
        assert seen.headers["x-kept"] == "yes"
        for name in ("x-rollcage-attempt", "x-api-key", "api-key", "proxy-authorization", "x-hop"):
            assert name not in seen.headers, name
    model, resource = upstream.requests
    assert model.headers["authorization"] == f"Bearer {KEY}"
    assert "authorization" not in resource.headers  # no credential configured for this resource
    first = (await harness.settled(2))[0]
    assert ["X-Api-Key", "[redacted]"] in first["request"]["headers"]  # the evidence keeps what was sent
    assert "sk-stolen" not in harness.capture.read_text()


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/chat/completions"), ("POST", "/responses"), ("GET", "/models")],
)
async def test_model_route_forwards_its_allow_list(
    harness: Harness, upstream: Upstream, method: str, path: str
) -> None:
    response = await harness.client.request(method, f"/model/v1{path}")
    assert response.status_code == 200 and "x-rollcage-proxy" not in response.headers
    assert [(seen.method, seen.path) for seen in upstream.requests] == [(method, f"/v1{path}")]


async def test_resource_request_keeps_its_path_query_and_cookies(
    harness: Harness, upstream: Upstream
) -> None:
    response = await harness.client.post(
        "/resource/weather/forecast?city=Oslo", json={"a": 1}, headers={"Cookie": "session=abc"}
    )
    assert response.status_code == 200
    (seen,) = upstream.requests
    assert seen.path == "/weather/forecast?city=Oslo"
    assert seen.headers["cookie"] == "session=abc"


async def test_the_proxy_keeps_no_cookies_of_its_own(harness: Harness, upstream: Upstream) -> None:
    # The sandbox's client decides which cookies go back (the model client keeps and bounds its
    # own): a jar in the proxy would send an upstream's cookie on requests that carry none.
    first = await harness.client.post("/resource/weather/set-cookie", json={})
    assert first.headers["set-cookie"] == "sticky=node-4; Path=/"
    harness.client.cookies.clear()  # the test's own client keeps none either
    await harness.client.post("/resource/weather/next", json={})
    assert [seen.headers.get("cookie") for seen in upstream.requests] == [None, None]


@pytest.mark.parametrize(
    "request_line",
    [
        b"GET /admin",
        b"GET /model/v2/chat/completions",
        b"GET /model/v1x/chat/completions",
        b"GET /resource/other/x",
        b"GET /model/v1/../../admin",
        b"GET /model/v1/%2e%2e/admin",
        b"GET /resource/weather/a%2Fb",
        b"GET http://169.254.169.254/latest/meta-data",
        b"DELETE /model/v1/files/file-123",
        b"POST /model/v1/fine_tuning/jobs",
        b"GET /model/v1/chat/completions",
        b"POST /model/v1/models",
        b"POST /model/v1/chat/completions/x",
    ],
)
async def test_anything_off_the_allow_list_gets_403_with_a_message(
    harness: Harness, upstream: Upstream, request_line: bytes
) -> None:
    answer = await harness.raw(request_line + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 403"), answer[:100]
    assert b"rollcage egress proxy" in answer and b"allowed: /model/v1/..." in answer
    assert upstream.requests == []
    (record,) = await harness.settled()
    assert record["route"] == "denied" and record["status"] == 403 and record["upstream_url"] is None
    assert record["credential_added"] is False


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("POST", "/get_weather", True),
        ("POST", "/tools/forecast?unit=c", True),
        ("POST", "/verify", False),
        ("POST", "/seed_session", False),
        ("POST", "/close_session", False),
        ("GET", "/get_weather", False),
        ("POST", "/get_weather/x", False),
        ("POST", "/", False),
    ],
)
async def test_a_resource_route_forwards_only_posts_to_its_tools(
    short_dir: Path, upstream: Upstream, method: str, path: str, allowed: bool
) -> None:
    original = WorkerInput.model_validate(
        {
            "rollout_id": "r1",
            "task_id": "t1",
            "input": "hi",
            "model": {"base_url": f"{upstream.base_url}/v1", "model": "m"},
            "resources": {"env": {"base_url": f"{upstream.base_url}/env"}},
            "tools": [
                {"type": "resource", "name": "get_weather", "resource": "env"},
                {"type": "resource", "name": "forecast", "resource": "env", "path": "tools/forecast"},
            ],
        }
    )
    capture = short_dir / "capture.jsonl"
    proxy = EgressProxy(
        short_dir / "p.sock",
        routes_for(original, model_credential=None, resource_credentials={}),
        capture_path=capture,
        rollout_id="r1",
        config=ProxyConfig(),
        identity=IDENTITY,
    )
    async with proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
        async with httpx.AsyncClient(transport=transport, base_url="http://rollcage-proxy") as client:
            response = await client.request(method, f"/resource/env{path}", json={})
    if allowed:
        assert response.status_code == 200
        assert [seen.path for seen in upstream.requests] == [f"/env{path}"]
    else:
        assert response.status_code == 403 and b"forwards only POST to its tools" in response.content
        assert upstream.requests == []
        record = json.loads(capture.read_text().splitlines()[-1])
        assert record["route"] == "denied"


@pytest.mark.parametrize("harness", [{"idle_timeout_s": 2.0}], indirect=True)
async def test_a_request_sent_as_the_previous_response_ends_is_never_lost(harness: Harness) -> None:
    """Watching the client while the upstream answers must never consume the client's next request.

    A client that sends its next request on a kept-alive connection the moment a response ends
    races the watch on the client's socket: bytes it read and then dropped left the proxy waiting
    for a request it had already swallowed, until the idle timeout closed the connection.
    """
    import http.client
    import socket as socket_module

    class UnixHTTPConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket_module.socket(socket_module.AF_UNIX, socket_module.SOCK_STREAM)
            self.sock.connect(str(harness.proxy.socket_path))

    def client(count: int) -> list[str]:
        failures: list[str] = []
        connection = UnixHTTPConnection("rollcage-proxy", timeout=30)
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
        headers = {"Content-Type": "application/json"}
        try:
            for n in range(count):
                started = time.monotonic()
                try:
                    connection.request("POST", "/model/v1/chat/completions", body=body, headers=headers)
                    response = connection.getresponse()
                    response.read()
                    if response.status != 200:
                        failures.append(f"request {n}: status {response.status}")
                except (OSError, http.client.HTTPException) as exc:
                    failures.append(
                        f"request {n}: {type(exc).__name__} after {time.monotonic() - started:.1f}s"
                    )
                    connection.close()
        finally:
            connection.close()
        return failures

    failures = await asyncio.to_thread(client, 400)
    assert failures == [], failures[:5]


async def test_unreachable_upstream_is_a_502_with_the_reason(harness: Harness) -> None:
    response = await harness.client.post("/resource/down/x", json={})
    assert response.status_code == 502 and "unreachable" in response.text
    (record,) = await harness.settled()
    assert record["status"] == 502 and "ConnectError" in record["error"]


# --------------------------------------------------------------------------- shared upstream pool


@contextlib.asynccontextmanager
async def rollout_proxy(
    upstream: Upstream, where: Path, rollout_id: str, **limits: Any
) -> AsyncIterator[Harness]:
    """One rollout's proxy (its own socket and capture) and a client of it."""
    await asyncio.to_thread(where.mkdir)
    proxy = EgressProxy(
        where / "proxy.sock",
        routes(upstream),
        capture_path=where / "model_capture.jsonl",
        rollout_id=rollout_id,
        config=ProxyConfig(**limits),
        identity={"X-Rollout-Id": rollout_id, "X-Task-Id": "t"},
    )
    async with proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
        async with httpx.AsyncClient(
            transport=transport, base_url="http://rollcage-proxy", timeout=10
        ) as client:
            yield Harness(proxy, client, where / "model_capture.jsonl")


async def test_rollouts_share_kept_alive_upstream_connections_and_each_captures_only_its_own(
    upstream: Upstream, short_dir: Path
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with (
        rollout_proxy(upstream, short_dir / "a", "ra") as a,
        rollout_proxy(upstream, short_dir / "b", "rb") as b,
    ):
        for harness in (a, b, a):
            response = await harness.client.post("/model/v1/chat/completions", json=body)
            assert response.status_code == 200
        # One connection, kept alive and used by both rollouts in turn.
        assert upstream.connections == 1
        assert [seen.headers["x-rollout-id"] for seen in upstream.requests] == ["ra", "rb", "ra"]
        records_a, records_b = await a.settled(2), await b.settled(1)
    assert [r["rollout_id"] for r in records_a] == ["ra", "ra"]
    assert [r["rollout_id"] for r in records_b] == ["rb"]
    assert [r["response"]["body"]["json"]["id"] for r in records_a + records_b] == [
        "chatcmpl-1",
        "chatcmpl-3",
        "chatcmpl-2",
    ]


async def test_a_pool_is_shared_by_at_most_its_number_of_rollouts_then_another_opens(
    upstream: Upstream, short_dir: Path
) -> None:
    # httpcore's pool looks at every connection it holds on each request: one pool for all of a
    # big run's rollouts cost more than forwarding their requests.
    async with contextlib.AsyncExitStack() as stack:
        proxies = [
            await stack.enter_async_context(rollout_proxy(upstream, short_dir / f"r{n}", f"r{n}"))
            for n in range(_POOL_USERS + 1)
        ]
        for harness in proxies:
            assert (await harness.client.post("/resource/weather/echo", json={})).status_code == 200
        # The first pool's rollouts took turns on one connection; the next rollout is in a pool of its own.
        assert upstream.connections == 2
        first_pool = {proxy._borrowed[0].pool for proxy in (h.proxy for h in proxies[:_POOL_USERS])}
        assert len(first_pool) == 1 and proxies[-1].proxy._borrowed[0].pool not in first_pool


async def test_a_response_cut_off_for_one_rollout_never_reaches_another(
    upstream: Upstream, short_dir: Path
) -> None:
    async with (
        rollout_proxy(upstream, short_dir / "a", "ra", max_response_bytes=64 * 1024) as a,
        rollout_proxy(upstream, short_dir / "b", "rb") as b,
    ):
        warm = await b.client.post("/resource/weather/echo", json={"n": 0})
        assert warm.status_code == 200 and upstream.connections == 1
        cut = await a.client.post("/resource/weather/big", json={})
        assert cut.status_code == 502 and "bound" in cut.text
        after = await b.client.post("/resource/weather/echo", json={"n": 1})
        # The connection that carried the unread megabyte was closed, never handed to rollout b.
        assert after.status_code == 200 and after.json() == {"echo": {"n": 1}, "path": "/weather/echo"}
        assert upstream.connections == 2


async def test_the_shared_pool_closes_when_its_last_rollout_leaves(
    upstream: Upstream, short_dir: Path
) -> None:
    async with rollout_proxy(upstream, short_dir / "a", "ra") as a:
        async with rollout_proxy(upstream, short_dir / "b", "rb") as b:
            assert (await b.client.post("/resource/weather/echo", json={})).status_code == 200
        assert (await a.client.post("/resource/weather/echo", json={})).status_code == 200
        assert upstream.connections == 1  # b's leaving did not close what a still uses
    await wait_for_async(
        lambda: not upstream._tasks, within_s=10, what="the upstream to see its connection closed"
    )


# --------------------------------------------------------------------------- streaming and bounds


async def test_server_sent_events_stream_through_as_they_are_produced(
    harness: Harness, upstream: Upstream
) -> None:
    upstream.sse_gap_s = 0.3
    arrivals: list[float] = []
    async with harness.client.stream("POST", "/resource/weather/stream", json={"stream": True}) as response:
        assert response.headers["content-type"] == "text/event-stream"
        async for _ in response.aiter_raw():
            arrivals.append(time.monotonic())
    # Four events, 0.3 s apart at the source: had the proxy buffered, they would arrive at once.
    assert len(arrivals) >= 2 and arrivals[-1] - arrivals[0] >= 0.5
    (record,) = await harness.settled()
    assert record["response"]["body"]["text"].count("data:") == 4
    assert record["first_byte_at"] < record["ended_at"]


@pytest.mark.parametrize("harness", [{"max_request_bytes": 1024}], indirect=True)
async def test_request_body_over_the_bound_is_refused_and_captured(
    harness: Harness, upstream: Upstream
) -> None:
    async def chunked() -> AsyncIterator[bytes]:
        yield b"x" * 4096

    # Told up front (content-length), or found out while reading (chunked).
    for content in (b"x" * 4096, chunked()):
        response = await harness.client.post("/model/v1/chat/completions", content=content)
        assert response.status_code == 413
    assert upstream.requests == []
    records = await harness.settled(2)
    assert [(r["route"], r["status"], r["upstream_url"]) for r in records] == [("model", 413, None)] * 2
    assert all("over 1024 bytes" in r["error"] for r in records)


@pytest.mark.parametrize("harness", [{"max_request_bytes": 1024}], indirect=True)
async def test_request_bytes_held_at_once_are_bounded_per_rollout(harness: Harness) -> None:
    # Each body is under the per-request bound; together they pass twice that.
    head = b"POST /model/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
    held = []
    for _ in range(2):
        reader, writer = await harness.connect()
        writer.write(head + b"x" * 900)
        held.append((reader, writer))
    await wait_for_async(lambda: harness.proxy._buffered == 1800, within_s=10, what="two bodies in progress")
    answer = await harness.raw(head + b"x" * 900)
    assert answer.startswith(b"HTTP/1.1 503") and b"hold over 2048 bytes" in answer
    for _, writer in held:
        writer.close()
    await harness.idle()
    assert harness.proxy._buffered == 0  # released with each exchange, however it ended
    assert len(harness.records()) == 3


@pytest.mark.parametrize("harness", [{"max_response_bytes": 64 * 1024}], indirect=True)
async def test_response_body_over_the_bound_is_not_passed_back(harness: Harness, upstream: Upstream) -> None:
    response = await harness.client.post("/resource/weather/big", json={})
    assert response.status_code == 502 and "bound" in response.text
    (record,) = await harness.settled()
    assert "over the 65536-byte bound" in record["error"]


async def test_a_client_that_goes_away_abandons_the_upstream_request(
    harness: Harness, upstream: Upstream
) -> None:
    with pytest.raises(httpx.ReadTimeout):
        await harness.client.post("/resource/stuck/x", json={}, timeout=0.5)
    assert await asyncio.to_thread(upstream.disconnected.wait, 10), "the upstream request was left hanging"
    (record,) = await harness.settled()
    assert record["status"] is None and "closed the connection" in record["error"]


@pytest.mark.parametrize("harness", [{"max_connections": 2}], indirect=True)
async def test_connections_over_the_cap_are_refused_at_accept_not_queued(harness: Harness) -> None:
    # One exchange first: the proxy's pooled upstream connection (and the in-process upstream's end
    # of it) stays open, and is not a leak.
    close = {"Connection": "close"}
    assert (await harness.client.post("/resource/weather/x", json={}, headers=close)).status_code == 200
    await harness.idle()
    before = open_fds()
    held = [await harness.connect() for _ in range(2)]
    await wait_for_async(lambda: len(harness.proxy._handlers) == 2, within_s=10, what="2 connections")
    reader, writer = await harness.connect()
    async with asyncio.timeout(10):
        answer = await reader.read()  # answered and closed at once, not left waiting
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
    assert harness.proxy.refused == 1
    held[0][1].close()
    await wait_for_async(lambda: len(harness.proxy._handlers) == 1, within_s=10, what="a free slot")
    assert (await harness.client.post("/resource/weather/x", json={}, headers=close)).status_code == 200
    held[1][1].close()
    await harness.idle()
    assert open_fds() <= before  # every accepted and refused socket was closed


CLIENT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(30)
sys.stdin.readline()  # connects when told: once the proxy's process is out of descriptors
s.connect(sys.argv[1])
s.sendall(b"GET /model/v1/models HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
print(s.recv(100).split(b"\\r\\n")[0].decode())
"""


async def test_out_of_descriptors_the_proxy_backs_off_and_then_serves(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    # The client is another process: its descriptors are its own.
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CLIENT,
        str(harness.proxy.socket_path),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert client.stdin is not None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_fds() + 8, hard))
        with contextlib.suppress(OSError):
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        # Only now: a connection accepted before the descriptors ran out would meet the proxy's own
        # admission (too few descriptors left: refused), not a failing accept (seen on a loaded machine).
        client.stdin.write(b"connect\n")
        await client.stdin.drain()
        await wait_for_async(
            lambda: "cannot accept" in caplog.text, within_s=30, what="the proxy to run out of descriptors"
        )
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        for fd in fillers:
            os.close(fd)
    async with asyncio.timeout(30):
        out, _ = await client.communicate()
    # The connection waited in the backlog, then was served.
    assert out.decode().startswith("HTTP/1.1 200"), out
    assert "Invalid file descriptor" not in caplog.text and harness.proxy.refused == 0


SLOW = {"idle_timeout_s": 0.5, "header_timeout_s": 0.5, "body_timeout_s": 0.5}


@pytest.mark.parametrize("harness", [SLOW], indirect=True)
@pytest.mark.parametrize(
    ("case", "sent", "status"),
    [
        ("silent", b"", None),
        ("half a head", b"POST /model/v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"408"),
        (
            "half a body",
            b"POST /model/v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{",
            b"408",
        ),
    ],
)
async def test_a_client_that_stalls_is_cut_off(
    harness: Harness, upstream: Upstream, case: str, sent: bytes, status: bytes | None
) -> None:
    reader, writer = await harness.connect()
    writer.write(sent)
    async with asyncio.timeout(10):
        answer = await reader.read()  # the proxy closes the connection; it is not held open
    writer.close()
    await harness.idle()
    records = harness.records()
    assert upstream.requests == []
    if status is None:
        assert answer == b"" and records == []  # no request: nothing to capture
    else:
        assert answer.startswith(b"HTTP/1.1 " + status), answer[:80]
        (record,) = records
        assert record["status"] == 408 and "did not arrive within 0.5s" in record["error"]


@pytest.mark.parametrize("harness", [SLOW], indirect=True)
async def test_a_client_that_stops_reading_is_cut_off(harness: Harness, upstream: Upstream) -> None:
    upstream.big_bytes = 8 << 20  # far more than the socket buffers hold
    _reader, writer = await harness.connect()
    writer.write(b"POST /resource/weather/big HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    await harness.settled()  # the line is written without the client reading anything
    writer.close()
    (record,) = harness.records()
    assert record["status"] == 200 and "read nothing of the response for 0.5s" in record["error"]


# --------------------------------------------------------------------------- capture


async def test_capture_has_exactly_one_line_per_exchange_and_never_the_key(
    harness: Harness, upstream: Upstream
) -> None:
    for _ in range(3):
        assert (await harness.client.post("/model/v1/chat/completions", json={"n": 1})).status_code == 200
    assert (await harness.client.post("/resource/weather/x", json={"n": 2})).status_code == 200
    assert (await harness.client.get("/elsewhere")).status_code == 403
    records = await harness.settled(5)
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["route"] for r in records] == ["model", "model", "model", "resource", "denied"]
    counts = {"model": 3, "resource": 1, "denied": 1}
    # The counters follow the line's write by a moment (they are updated once it is synced).
    await wait_for_async(lambda: harness.proxy.captured == counts, within_s=10, what="the counters")
    assert harness.proxy.exchanges == counts
    assert harness.proxy.capture_bytes == harness.capture.stat().st_size
    first = records[0]
    assert first["rollout_id"] == "r1" and first["credential_added"] is True
    assert first["request"]["body"]["json"] == {"n": 1}
    assert first["response"]["body"]["json"]["object"] == "chat.completion"
    assert first["started_at"] <= first["first_byte_at"] <= first["ended_at"]
    assert KEY not in harness.capture.read_text()


@pytest.mark.parametrize(
    ("case", "request_bytes", "read_first"),
    [
        (
            "mid-stream",
            b"POST /resource/weather/stream HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
            True,
        ),
        ("refused", b"GET /model/v1/files HTTP/1.1\r\nHost: x\r\n\r\n", False),
        ("answered", b"POST /resource/weather/x HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", False),
        (
            "oversized",
            b"POST /model/v1/responses HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n",
            False,
        ),
        ("malformed", b"GET /model/v1/models HTTP/1.1\r\n\r\n", False),
    ],
)
async def test_every_exchange_is_captured_even_when_the_client_resets(
    harness: Harness, upstream: Upstream, case: str, request_bytes: bytes, read_first: bool
) -> None:
    upstream.sse_gap_s = 0.2
    for _ in range(5):  # a race by nature: the reset lands at a different moment each time
        reader, writer = await harness.connect()
        writer.write(request_bytes)
        await writer.drain()
        if read_first:
            await reader.readexactly(1)
        writer.transport.abort()
    await harness.idle()
    records = harness.records()
    assert len(records) == 5 and [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    if read_first:
        assert all(r["error"] for r in records)


@pytest.mark.parametrize("harness", [{"capture_body_bytes": 1024}], indirect=True)
async def test_a_large_body_is_captured_as_size_hash_and_prefix(harness: Harness) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "é" * 20_000}]}).encode()
    response = await harness.client.post(
        "/model/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200
    (record,) = await harness.settled()
    captured = record["request"]["body"]
    assert captured["size"] == len(body) and captured["truncated"] is True
    assert captured["sha256"] == hashlib.sha256(body).hexdigest()
    assert body.decode().startswith(captured["text"]) and 1000 < len(captured["text"].encode()) <= 1024
    assert "json" not in captured
    assert record["response"]["body"]["json"]["object"] == "chat.completion"  # small: kept whole
    assert harness.capture.stat().st_size < 8 * 1024


BUDGET = {"max_capture_bytes": 64 * 1024, "capture_body_bytes": 1 << 20}


@pytest.mark.parametrize("harness", [BUDGET], indirect=True)
async def test_passing_the_capture_budget_drops_bodies_and_ends_the_rollout(harness: Harness) -> None:
    body = {"messages": [{"role": "user", "content": "x" * 25_000}]}
    for _ in range(3):
        assert (await harness.client.post("/model/v1/chat/completions", json=body)).status_code == 200
    records = await harness.settled(3)
    assert [r["request"]["body"].get("json") == body for r in records] == [True, True, False]
    last = records[-1]
    assert last["request"]["body"]["truncated"] is True and "text" not in last["request"]["body"]
    assert "capture budget of 65536 bytes exceeded" in last["error"]
    assert harness.capture.stat().st_size <= 64 * 1024
    # The budget is reported to the supervisor once the line is on disk, just after the file shows it.
    await wait_for_async(lambda: harness.budget_events, what="the budget to be reported")
    (event,) = harness.budget_events
    assert event[0] == "capture_bytes" and "65536" in event[1]
    answer = await harness.raw(b"GET /model/v1/models HTTP/1.1\r\n\r\n")  # no more requests taken
    assert answer.startswith(b"HTTP/1.1 503") or answer == b""
    assert len(harness.records()) == 3


async def test_a_capture_line_that_cannot_be_written_is_cut_back_and_counted(
    upstream: Upstream, short_dir: Path, tiny_tmpfs: Path
) -> None:
    capture = tiny_tmpfs / "model_capture.jsonl"
    proxy = EgressProxy(
        short_dir / "proxy.sock",
        routes(upstream),
        capture_path=capture,
        rollout_id="r1",
        config=ProxyConfig(),
    )
    async with proxy:
        transport = httpx.AsyncHTTPTransport(uds=str(proxy.socket_path))
        async with httpx.AsyncClient(transport=transport, base_url="http://x", timeout=10) as client:
            for n in range(40):  # about 1 KiB a line: the 16 KiB disk fills up
                body = {"n": n, "pad": "y" * 700}
                assert (await client.post("/model/v1/chat/completions", json=body)).status_code == 200
                if proxy.capture_failures >= 2:
                    break
    lines = capture.read_bytes().split(b"\n")
    assert lines[-1] == b""  # whole lines only: the failed writes were cut back off
    records = [CaptureExchange.model_validate_json(line) for line in lines[:-1]]
    assert [r.seq for r in records] == list(range(1, len(records) + 1))
    assert proxy.capture_failures >= 2 and proxy.captured["model"] == len(records)
    assert proxy.exchanges["model"] == len(records) + proxy.capture_failures
    assert proxy.capture_bytes == capture.stat().st_size


def test_the_workers_input_points_every_endpoint_at_the_proxy() -> None:
    original = WorkerInput.model_validate(
        {
            "rollout_id": "r",
            "task_id": "t",
            "input": "hi",
            "model": {"base_url": "https://api.example.com/v1", "model": "m"},
            "resources": {"weather": {"base_url": "http://127.0.0.1:8001"}},
        }
    )
    view = sandbox_input(original, "/run/rollcage/proxy.sock")
    assert (
        view.model.base_url == "http://rollcage-proxy/model/v1"
        and view.model.uds == "/run/rollcage/proxy.sock"
    )
    assert view.resources["weather"].base_url == "http://rollcage-proxy/resource/weather"
    assert view.resources["weather"].uds == "/run/rollcage/proxy.sock"
    assert original.model.base_url == "https://api.example.com/v1"  # the controller's copy is untouched
    WorkerInput.model_validate_json(view.model_dump_json())


def test_model_routes_must_be_method_and_path() -> None:
    with pytest.raises(ValueError, match="must be 'METHOD /path'"):
        ProxyConfig(model_routes=["chat/completions"])
    with pytest.raises(ValueError, match="finite"):
        ProxyConfig(header_timeout_s=float("inf"))


# --------------------------------------------------------------------------- end to end


SANDBOX = "bwrap" if bwrap_usable() is None else "none"


@pytest.fixture
def _no_strays() -> Iterator[None]:
    yield
    assert processes_with_token() == []


@pytest.mark.usefixtures("_no_strays")
@pytest.mark.timeout(60)
async def test_worker_calls_model_and_resource_through_the_proxy_with_the_credential(
    tmp_path: Path, upstream: Upstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROLLCAGE_TEST_MODEL_KEY", KEY)
    model = make_rollout(tmp_path, "m1", model_url=f"{upstream.base_url}/v1")
    receipt = await supervise(model, config(SANDBOX, *fake("model"), api_key_env="ROLLCAGE_TEST_MODEL_KEY"))
    assert receipt.outcome == "completed", receipt.outcome_reason
    (seen,) = upstream.requests
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    result = WorkerResult.model_validate_json((model / "result.json").read_bytes())
    captured = [json.loads(line) for line in (model / "model_capture.jsonl").read_text().splitlines()]
    # One exchange per model request the trajectory records.
    assert receipt.model_calls_captured == len(result.trajectory.model_calls) == len(captured) == 1
    assert captured[0]["response"]["body"]["json"] == result.trajectory.model_calls[0].response
    assert KEY not in (model / "model_capture.jsonl").read_text()

    monkeypatch.setenv("ROLLCAGE_TEST_RESOURCE_KEY", "rk-" + KEY)
    resource = make_rollout(
        tmp_path,
        "r1",
        resources={"weather": f"{upstream.base_url}/weather"},
        tools=[{"type": "resource", "name": "forecast", "resource": "weather"}],
    )
    cfg = config(
        SANDBOX,
        *fake("resource", "weather", "/forecast"),
        resource_api_key_envs={"weather": "ROLLCAGE_TEST_RESOURCE_KEY"},
    )
    receipt = await supervise(resource, cfg)
    assert receipt.outcome == "completed", receipt.outcome_reason
    reply = json.loads((resource / "workspace" / "resource.json").read_text())
    assert reply == {"status": 200, "reply": {"echo": {"city": "Oslo"}, "path": "/weather/forecast"}}
    assert upstream.requests[-1].headers["authorization"] == f"Bearer rk-{KEY}"
    assert receipt.model_calls_captured == 0


@pytest.mark.usefixtures("_no_strays")
@pytest.mark.timeout(60)
async def test_fatal_error_after_a_model_response_is_the_agents(tmp_path: Path, upstream: Upstream) -> None:
    root = make_rollout(tmp_path, model_url=f"{upstream.base_url}/v1")
    receipt = await supervise(root, config(SANDBOX, *fake("model-then-fatal")))
    assert receipt.outcome == "agent_error", receipt.outcome_reason
    assert receipt.result_error is not None and receipt.result_error.type == "ToolError"


@pytest.mark.usefixtures("_no_strays")
@pytest.mark.timeout(60)
async def test_a_rollout_over_its_capture_budget_ends_as_the_policys_fault(
    tmp_path: Path, upstream: Upstream
) -> None:
    root = make_rollout(tmp_path, model_url=f"{upstream.base_url}/v1")
    noisy = [sys.executable, str(HELPERS / "noisy_worker.py"), "20", "20000"]
    proxy = ProxyConfig(max_capture_bytes=64 * 1024)
    receipt = await supervise(root, config(SANDBOX, *noisy, proxy=proxy, deadline_s=30))
    assert receipt.outcome == "agent_error" and receipt.budget_exceeded == "capture_bytes"
    assert "capture_bytes budget" in receipt.outcome_reason and not receipt.deadline_fired
    assert receipt.signals_sent[0].signal == "SIGTERM" and receipt.signals_sent[0].reason == "budget"
    size = (root / "model_capture.jsonl").stat().st_size
    assert receipt.capture_bytes == size and size < 72 * 1024  # the budget, and one line without bodies
    assert receipt.capture_failures == 0 and receipt.model_calls_captured is not None
    assert receipt.model_calls_captured < 20  # the proxy stopped taking requests once it was spent
