"""The egress proxy: the sandbox's only way out, on a Unix socket, with an allow-list and a capture.

Routing
=======

The proxy serves plain HTTP/1.1 on a Unix socket that is bound into the
sandbox. Upstreams come from the controller's ``input.json`` (host view) and are
reached by path prefix::

    /model/v1/<rest>             ->  <model.base_url>/<rest>               (+ Authorization: Bearer <key>)
    /resource/<name>/<rest>      ->  <resources[name].base_url>/<rest>     (+ its bearer token, if configured)
    anything else                ->  403, with a message saying what is allowed

The worker's ``input.json`` is rewritten to match (:func:`sandbox_input`):
``model.base_url`` becomes ``http://rollcage-proxy/model/v1`` and each
resource's ``base_url`` ``http://rollcage-proxy/resource/<name>``, all with
``uds`` set to the proxy's socket. An upstream that was itself reached through a
Unix socket (``uds`` in the original input) still is, from the proxy.

Credentials are added here, read from the supervisor's environment; whatever
``Authorization`` the sandbox sent is replaced. Request bodies are read whole
(bounded); responses are streamed back chunk by chunk, so server-sent events
arrive as they are produced, and are bounded too. The proxy asks upstreams for
uncompressed bodies so that the capture is readable.

Capture
=======

Every exchange, allowed or not, appends exactly one JSON line to
``model_capture.jsonl`` once it has ended (``seq``, ``rollout_id``, ``route``
``model|resource|denied``, ``name``, method, path, upstream URL, request headers
and body, response status, headers and body, ``first_byte_at``/``ended_at``
timings, ``error``). Bodies are stored as ``{"size", "json"|"text"|"base64"}``.
Credentials never appear in it: ``Authorization`` values are redacted.

Why h11 and not uvicorn: one proxy runs per rollout, many in one event loop;
``uvicorn.Server`` installs process-wide signal handlers while it serves and
brings lifespan machinery we do not need, whereas a small h11 loop gives exact
control over byte bounds, streaming and shutdown. h11 is already installed as
httpx's HTTP/1.1 engine.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import logging
import os
import ssl
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import h11
import httpx
import orjson

from rollcage.errors import SupervisorError
from rollcage.protocol import WorkerInput
from rollcage.supervisor.config import ProxyConfig

__all__ = [
    "MODEL_PREFIX",
    "PROXY_HOST",
    "EgressProxy",
    "Route",
    "resource_prefix",
    "routes_for",
    "sandbox_input",
]

logger = logging.getLogger("rollcage.supervisor.proxy")

PROXY_HOST = "rollcage-proxy"
"""Host name in the worker's rewritten URLs (any name works: the socket decides where requests go)."""

MODEL_PREFIX = "/model/v1"
"""Path prefix of the model route."""

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_REQUEST_DROP = _HOP_BY_HOP | {"host", "content-length", "accept-encoding", "expect"}
_REDACT = frozenset({"authorization", "proxy-authorization"})
_CHUNK = 65536


def resource_prefix(name: str) -> str:
    """Path prefix of the route to resource ``name``."""
    return "/resource/" + urllib.parse.quote(name, safe="")


@dataclass(frozen=True)
class Route:
    """One allowed upstream.

    Attributes:
        kind: ``model`` or ``resource``.
        name: ``"model"`` or the resource's name.
        prefix: Path prefix in the proxy (``/model/v1``, ``/resource/<name>``).
        upstream: The upstream's base URL as the host reaches it.
        uds: Unix socket to reach the upstream through; ``None``: TCP.
        credential: Bearer token added upstream; ``None``: none (never logged or captured).
    """

    kind: Literal["model", "resource"]
    name: str
    prefix: str
    upstream: str
    uds: str | None = None
    credential: str | None = field(default=None, repr=False)


def routes_for(
    original: WorkerInput, *, model_credential: str | None, resource_credentials: Mapping[str, str]
) -> list[Route]:
    """The allow-list for one rollout, from the controller's (host view) input."""
    routes = [
        Route(
            kind="model",
            name="model",
            prefix=MODEL_PREFIX,
            upstream=original.model.base_url,
            uds=original.model.uds,
            credential=model_credential,
        )
    ]
    for name, endpoint in original.resources.items():
        routes.append(
            Route(
                kind="resource",
                name=name,
                prefix=resource_prefix(name),
                upstream=endpoint.base_url,
                uds=endpoint.uds,
                credential=resource_credentials.get(name),
            )
        )
    return routes


def sandbox_input(original: WorkerInput, socket_path: str) -> WorkerInput:
    """The worker's view of ``original``: every endpoint points at the proxy socket ``socket_path``."""
    model = original.model.model_copy(
        update={"base_url": f"http://{PROXY_HOST}{MODEL_PREFIX}", "uds": socket_path}
    )
    resources = {
        name: endpoint.model_copy(
            update={"base_url": f"http://{PROXY_HOST}{resource_prefix(name)}", "uds": socket_path}
        )
        for name, endpoint in original.resources.items()
    }
    return original.model_copy(update={"model": model, "resources": resources})


class _TooLarge(Exception):
    pass


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds: do it once per process, not per rollout
    # (a context is safe to share between connections and clients).
    return httpx.create_ssl_context()


def _body(data: bytes, content_type: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"size": len(data)}
    if not data:
        return out
    if content_type is not None and "json" in content_type:
        try:
            out["json"] = orjson.loads(data)
            return out
        except orjson.JSONDecodeError:
            pass
    try:
        out["text"] = data.decode("utf-8")
    except UnicodeDecodeError:
        out["base64"] = base64.b64encode(data).decode("ascii")
    return out


def _headers(pairs: Sequence[tuple[bytes, bytes]]) -> list[list[str]]:
    out: list[list[str]] = []
    for raw_name, raw_value in pairs:
        name = raw_name.decode("latin-1")
        value = "[redacted]" if name.lower() in _REDACT else raw_value.decode("latin-1")
        out.append([name, value])
    return out


def _header(pairs: Sequence[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in pairs:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class _CaptureFile:
    """``model_capture.jsonl``: one line per exchange, appended and synced off the event loop."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None
        self._lock = asyncio.Lock()
        self.failures = 0

    async def open(self) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        self._fd = await asyncio.to_thread(os.open, self._path, flags, 0o600)

    def _write(self, line: bytes) -> None:
        assert self._fd is not None
        view = memoryview(line)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fdatasync(self._fd)

    async def append(self, record: dict[str, Any]) -> None:
        line = orjson.dumps(record) + b"\n"
        async with self._lock:
            if self._fd is None:
                return
            try:
                await asyncio.to_thread(self._write, line)
            except OSError as exc:
                self.failures += 1
                logger.error("cannot append to %s: %s", self._path, exc)

    async def close(self) -> None:
        async with self._lock:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                await asyncio.to_thread(os.close, fd)


@dataclass
class _Exchange:
    """What one request/response pair was, filled in as it happens."""

    method: str
    target: str
    request_headers: list[tuple[bytes, bytes]]
    request_body: bytes
    started_at: float
    route: Route | None = None
    upstream_url: str | None = None
    status: int | None = None
    response_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    response_body: bytearray = field(default_factory=bytearray)
    first_byte_at: float | None = None
    error: str | None = None
    credential_added: bool = False

    def record(self, seq: int, rollout_id: str) -> dict[str, Any]:
        ended = time.time()
        route_kind = "denied" if self.route is None else self.route.kind
        return {
            "seq": seq,
            "rollout_id": rollout_id,
            "route": route_kind,
            "name": None if self.route is None else self.route.name,
            "method": self.method,
            "path": self.target,
            "upstream_url": self.upstream_url,
            "credential_added": self.credential_added,
            "request": {
                "headers": _headers(self.request_headers),
                "body": _body(self.request_body, _header(self.request_headers, b"content-type")),
            },
            "response": None
            if self.status is None
            else {
                "status": self.status,
                "headers": _headers(self.response_headers),
                "body": _body(bytes(self.response_body), _header(self.response_headers, b"content-type")),
            },
            "status": self.status,
            "started_at": self.started_at,
            "first_byte_at": self.first_byte_at,
            "ended_at": ended,
            "duration_s": ended - self.started_at,
            "error": self.error,
        }


class EgressProxy:
    """The egress proxy of one rollout, as an async context manager.

    Example::

        async with EgressProxy(sock, routes, capture_path=..., rollout_id=..., config=ProxyConfig()) as proxy:
            ...  # the worker runs
        print(proxy.exchanges["model"])

    Args:
        socket_path: Where to create the Unix socket (its directory must exist; the path must be short
            enough for ``sun_path``, about 100 bytes).
        routes: The allow-list (see :func:`routes_for`).
        capture_path: ``model_capture.jsonl``.
        rollout_id: Written into every capture record.
        config: Bounds and timeouts.
        socket_owner: ``(uid, gid)`` to hand the socket to (the sandbox's host uid), or ``None``.
    """

    def __init__(
        self,
        socket_path: Path,
        routes: Sequence[Route],
        *,
        capture_path: Path,
        rollout_id: str,
        config: ProxyConfig,
        socket_owner: tuple[int, int] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.routes = list(routes)
        self._config = config
        self._rollout_id = rollout_id
        self._owner = socket_owner
        self._capture = _CaptureFile(capture_path)
        self._server: asyncio.Server | None = None
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._handlers: set[asyncio.Task[None]] = set()
        self._seq = 0
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        self.exchanges: dict[str, int] = {"model": 0, "resource": 0, "denied": 0}
        """Exchanges so far, by route kind."""

    async def __aenter__(self) -> Self:
        """Start serving.

        **Cancellation:** whatever was started is closed again.

        Raises:
            SupervisorError: The socket or the capture file cannot be created.
        """
        if self._state != "unopened":
            raise RuntimeError(f"the egress proxy is {self._state}; it can be started only once")
        self._state = "open"
        try:
            await self._capture.open()
            context = await asyncio.to_thread(_ssl_context)
            for route in self.routes:
                timeout = httpx.Timeout(
                    connect=self._config.connect_timeout_s,
                    read=self._config.upstream_timeout_s,
                    write=self._config.upstream_timeout_s,
                    pool=self._config.connect_timeout_s,
                )
                self._clients[route.prefix] = httpx.AsyncClient(
                    transport=httpx.AsyncHTTPTransport(uds=route.uds, retries=0, verify=context),
                    timeout=timeout,
                    follow_redirects=False,
                    # Nothing from the supervisor's environment (.netrc credentials, SSL
                    # variables) may attach itself to the sandbox's traffic.
                    trust_env=False,
                )
            self._server = await asyncio.start_unix_server(self._on_connection, path=str(self.socket_path))
            os.chmod(self.socket_path, 0o600)
            if self._owner is not None:
                os.chown(self.socket_path, *self._owner)
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, OSError):
                raise SupervisorError(f"cannot start the egress proxy on {self.socket_path}: {exc}") from exc
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop serving (see :meth:`aclose`)."""
        await self.aclose()

    async def aclose(self) -> None:
        """Stop accepting, abort exchanges still running (each still gets its capture line), close all.

        **Cancellation:** shutdown finishes first (it only waits for tasks it has cancelled itself).
        """
        if self._state == "closed":
            return
        self._state = "closed"
        if self._server is not None:
            self._server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.shield(asyncio.gather(*handlers, return_exceptions=True))
        for client in self._clients.values():
            await asyncio.shield(client.aclose())
        await asyncio.shield(self._capture.close())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    def _closed(self) -> bool:
        # A method, not an inline comparison: the state changes under an await.
        return self._state == "closed"

    # ----------------------------------------------------------------- connections

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._state != "open":
            writer.close()
            return
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, h11.ProtocolError) as exc:
            logger.debug("proxy connection ended: %r", exc)
        except asyncio.CancelledError:
            if not self._closed():
                raise
            # Our own shutdown cancelled this connection (its capture line is written): end quietly,
            # since asyncio's stream server would log a cancelled callback task as an error.
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.shield(writer.wait_closed())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        while True:
            try:
                received = await self._receive(conn, reader, writer)
            except _TooLarge:
                await self._send_simple(
                    conn, writer, 413, f"request body over {self._config.max_request_bytes} bytes"
                )
                return
            except h11.RemoteProtocolError as exc:
                with contextlib.suppress(h11.LocalProtocolError):
                    await self._send_simple(conn, writer, 400, f"malformed HTTP request: {exc}")
                return
            if received is None:
                return
            request, body = received
            exchange = _Exchange(
                method=request.method.decode("ascii", "replace"),
                target=request.target.decode("ascii", "replace"),
                request_headers=list(request.headers.raw_items()),
                request_body=body,
                started_at=time.time(),
            )
            reusable = cancelled = False
            try:
                reusable = await self._run(conn, reader, writer, exchange)
            except asyncio.CancelledError:
                cancelled = True
            # Exactly one capture line per exchange, also for one cut short by shutdown.
            self._seq += 1
            self.exchanges["denied" if exchange.route is None else exchange.route.kind] += 1
            await self._capture.append(exchange.record(self._seq, self._rollout_id))
            if cancelled:
                raise asyncio.CancelledError
            if not reusable or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _receive(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[h11.Request, bytes] | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                if conn.they_are_waiting_for_100_continue:
                    writer.write(conn.send(h11.InformationalResponse(status_code=100, headers=[])) or b"")
                conn.receive_data(await reader.read(_CHUNK))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > self._config.max_request_bytes:
                    raise _TooLarge
            elif isinstance(event, h11.EndOfMessage):
                assert request is not None
                return request, bytes(body)
            else:  # ConnectionClosed, PAUSED
                return None

    async def _send_simple(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, text: str
    ) -> None:
        body = (text + "\n").encode()
        headers = [
            ("content-type", "text/plain; charset=utf-8"),
            ("content-length", str(len(body))),
            ("x-rollcage-proxy", "1"),
        ]
        writer.write(conn.send(h11.Response(status_code=status, headers=headers)) or b"")
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()

    def _match(self, target: str) -> tuple[Route, str] | str:
        """The route and the rest of the target, or why the target is refused."""
        if not target.startswith("/"):
            return "only origin-form request targets ('/path') are accepted"
        path, _, _query = target.partition("?")
        for segment in path.split("/"):
            decoded = urllib.parse.unquote(segment)
            if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
                return "dot segments and encoded slashes are not allowed in the path"
        for route in self.routes:
            prefix = route.prefix
            if target == prefix or target.startswith(prefix + "/") or target.startswith(prefix + "?"):
                return route, target[len(prefix) :]
        return "no allowed upstream for this path"

    def _refusal(self, exchange: _Exchange, why: str) -> str:
        allowed = ", ".join(f"{r.prefix}/..." for r in self.routes)
        return (
            f"rollcage egress proxy: {exchange.method} {exchange.target} refused: {why}. "
            f"The sandbox has no network; allowed: {allowed}"
        )

    async def _run(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ex: _Exchange
    ) -> bool:
        """Serve one exchange; ``True`` if the connection can carry another request."""
        matched = self._match(ex.target)
        if isinstance(matched, str):
            ex.status = 403
            ex.error = matched
            await self._send_simple(conn, writer, 403, self._refusal(ex, matched))
            return True
        ex.route, rest = matched
        ex.upstream_url = ex.route.upstream.rstrip("/") + rest
        # While the upstream answers, watch the client: if it goes away (worker killed or
        # timed out), the upstream request is abandoned rather than left hanging.
        forward = asyncio.create_task(self._forward(conn, writer, ex))
        watch = asyncio.create_task(reader.read(_CHUNK))
        try:
            await asyncio.wait({forward, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not forward.done() and (watch.exception() is not None or watch.result() == b""):
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
                ex.error = ex.error or "the client closed the connection before the response ended"
                return False
            return await forward
        except asyncio.CancelledError:
            ex.error = ex.error or "aborted: the rollout ended while the exchange was in progress"
            raise
        finally:
            for task in (forward, watch):
                if not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if watch.done() and not watch.cancelled() and watch.exception() is None:
                # Bytes that arrived meanwhile: the next pipelined request, or b"" for end of stream.
                with contextlib.suppress(h11.ProtocolError, RuntimeError):
                    conn.receive_data(watch.result())

    async def _forward(self, conn: h11.Connection, writer: asyncio.StreamWriter, ex: _Exchange) -> bool:
        route = ex.route
        assert route is not None and ex.upstream_url is not None
        headers = [
            (name, value)
            for name, value in ex.request_headers
            if name.lower().decode("latin-1") not in _REQUEST_DROP
        ]
        headers.append((b"accept-encoding", b"identity"))
        if route.credential is not None:
            headers = [(n, v) for n, v in headers if n.lower() != b"authorization"]
            headers.append((b"authorization", f"Bearer {route.credential}".encode("latin-1")))
            ex.credential_added = True
        client = self._clients[route.prefix]
        try:
            request = client.build_request(
                ex.method, ex.upstream_url, headers=headers, content=ex.request_body
            )
            response = await client.send(request, stream=True)
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            ex.status = 502
            ex.error = f"upstream {route.name} unreachable: {type(exc).__name__}: {exc}"
            await self._send_simple(conn, writer, 502, f"rollcage egress proxy: {ex.error}")
            return True
        try:
            ex.first_byte_at = time.time()
            limit = self._config.max_response_bytes
            length = response.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                ex.status = 502
                ex.error = f"upstream response of {length} bytes is over the {limit}-byte bound"
                await self._send_simple(conn, writer, 502, f"rollcage egress proxy: {ex.error}")
                return True
            ex.status = response.status_code
            ex.response_headers = [
                (name, value)
                for name, value in response.headers.raw
                if name.lower().decode("latin-1") not in _HOP_BY_HOP
            ]
            writer.write(
                conn.send(
                    h11.Response(
                        status_code=response.status_code,
                        headers=ex.response_headers,
                        reason=response.reason_phrase.encode("latin-1", "replace"),
                    )
                )
                or b""
            )
            async for chunk in response.aiter_raw():
                if len(ex.response_body) + len(chunk) > limit:
                    ex.error = f"upstream response over the {limit}-byte bound; cut off"
                    return False
                ex.response_body += chunk
                writer.write(conn.send(h11.Data(data=chunk)) or b"")
                await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()) or b"")
            await writer.drain()
            return True
        except httpx.HTTPError as exc:
            ex.error = f"upstream {route.name} failed mid-response: {type(exc).__name__}: {exc}"
            return False
        finally:
            await response.aclose()
