"""The harness's plain-HTTP endpoint: ``127.0.0.1:PORT`` inside the sandbox, forwarded to the egress proxy.

Off-the-shelf agents (litellm, the OpenAI SDK, curl) speak HTTP over TCP; the
sandbox's only way out is the egress proxy's Unix socket. This forwarder, rollcage's
own code run by the worker before the harness starts, bridges the two inside the
sandbox's network namespace (nothing but loopback there)::

    harness ── http://127.0.0.1:PORT/v1/<rest>         ──►  proxy /model/v1/<rest>         (the model)
            ── http://127.0.0.1:PORT/tools/<tool>       ──►  proxy /resource/<env>/<path>   (the task's tools)
            ── anything else                            ──►  404 here: it never leaves the sandbox

It is trusted and small: it checks the rollout's token (the harness's
``OPENAI_API_KEY``, a random value that is not the model's credential: the proxy
adds that outside), adds the rollout's cookies and keeps what the servers set,
counts model calls and refuses those past ``max_policy_calls`` (the proxy refuses
them too), and records every model exchange for the worker before the harness
sees the end of its answer, so a tool call the harness reports afterwards always
finds the model call that asked for it. Connections, head and body sizes and
idle times are bounded; everything else (the allow-list, the capture, the
credential) stays with the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Self

import h11

from rollcage.harness._calls import WireExchange, model_call_api
from rollcage.headers import cookie_header, parse_cookie_header, update_cookies
from rollcage.http import HOP_BY_HOP, hop_by_hop, httpx, transport_for
from rollcage.procs import AsyncClosing, shielded
from rollcage.protocol import ResourceToolSpec, WorkerInput

__all__ = ["BUDGET_CODE", "Forwarder", "budget_refusal"]

logger = logging.getLogger("rollcage.harness")

BUDGET_CODE = "max_policy_calls"
"""The error code of a model call refused past the rollout's ``max_policy_calls``."""

_MAX_HEAD = 64 * 1024
_MAX_REQUEST_BYTES = 32 * 1024 * 1024
# What all exchanges in progress may hold at once: request bodies, and answers kept for the record.
_MAX_HELD_BYTES = 128 * 1024 * 1024
_IDLE_TIMEOUT_S = 120.0
_HEAD_TIMEOUT_S = 30.0
_CHUNK = 65536
_DROP = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect", b"cookie"}
_CREDENTIALS = frozenset({b"authorization", b"x-api-key", b"api-key"})

OnModelExchange = Callable[[WireExchange], Awaitable[None]]
"""Called with every finished model exchange, before the harness gets the end of the answer."""


def budget_refusal(limit: int) -> bytes:
    """The JSON body of a model call refused past ``max_policy_calls`` (OpenAI's error shape)."""
    import orjson

    return orjson.dumps(
        {
            "error": {
                "message": f"rollcage: this rollout's {limit} model calls (max_policy_calls) are spent",
                "type": "rollcage_budget_exceeded",
                "code": BUDGET_CODE,
            }
        }
    )


@dataclass
class _Route:
    kind: Literal["model", "tool"]
    url: str
    uds: str | None
    timeout_s: float
    api: Literal["chat", "responses"] | None = None


@dataclass
class _Jars:
    model: dict[str, str] = field(default_factory=dict)
    resource: dict[str, str] = field(default_factory=dict)


class Forwarder(AsyncClosing):
    """The loopback endpoint of one rollout's harness, as an async context manager.

    Example::

        async with Forwarder(spec, token=token, on_model_exchange=record) as forwarder:
            env["OPENAI_BASE_URL"] = forwarder.base_url  # http://127.0.0.1:PORT/v1

    Args:
        spec: The worker's input (its endpoints point at the egress proxy).
        token: What the harness must send as its API key (``Authorization: Bearer``).
        on_model_exchange: Receives every finished model exchange (see :data:`OnModelExchange`).
        on_refused: Called when a model call is refused past ``max_policy_calls``.
        max_connections: Connections open at once; more are answered 503 and closed.
    """

    def __init__(
        self,
        spec: WorkerInput,
        *,
        token: str,
        on_model_exchange: OnModelExchange,
        on_refused: Callable[[], None] | None = None,
        max_connections: int = 64,
    ) -> None:
        self._spec = spec
        self._token = token.encode()
        self._on_model_exchange = on_model_exchange
        self._on_refused = on_refused
        self._slots = max_connections
        self._jars = _Jars(model=dict(spec.model_cookies), resource=dict(spec.resource_cookies))
        self._tools = {t.name: t for t in spec.tools if isinstance(t, ResourceToolSpec)}
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._clients: dict[tuple[str | None, str], httpx.AsyncClient] = {}
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        self.port = 0
        """The TCP port on 127.0.0.1 (0 until started)."""
        self._held = 0
        self.model_calls = 0
        """Model calls forwarded so far."""
        self.refused = 0
        """Model calls refused past ``max_policy_calls``."""

    @property
    def base_url(self) -> str:
        """The model's base URL for the harness (``OPENAI_BASE_URL``)."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def tools_url(self) -> str:
        """Where the harness posts tool calls: ``{tools_url}/<tool name>`` (``ROLLCAGE_TOOLS_URL``)."""
        return f"http://127.0.0.1:{self.port}/tools"

    @property
    def model_cookies(self) -> dict[str, str]:
        """The model cookies now: the rollout's, updated from every ``Set-Cookie``."""
        return dict(self._jars.model)

    @property
    def resource_cookies(self) -> dict[str, str]:
        """The resource cookies now."""
        return dict(self._jars.resource)

    async def __aenter__(self) -> Self:
        """Listen on ``127.0.0.1`` (a free port).

        **Cancellation:** whatever was started is closed again.

        Raises:
            OSError: No port could be bound.
        """
        if self._state != "unopened":
            raise RuntimeError(f"the forwarder is {self._state}; it can be started only once")
        self._state = "open"
        try:
            self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, reuse_address=False)
            self.port = self._server.sockets[0].getsockname()[1]
        except BaseException:
            await self.aclose()
            raise
        return self

    async def aclose(self) -> None:
        """Stop listening, abort exchanges in progress, close the upstream clients.

        **Cancellation:** shutdown finishes first (it waits only for tasks it cancelled itself).
        """
        if self._state == "closed":
            return
        self._state = "closed"
        if self._server is not None:
            self._server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await shielded(self._shut(handlers))

    async def _shut(self, handlers: list[asyncio.Task[None]]) -> None:
        await asyncio.gather(*handlers, return_exceptions=True)
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    # ------------------------------------------------------------------ connections

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._handlers) >= self._slots or self._state != "open":
            with contextlib.suppress(OSError):
                writer.write(_simple(503, b"rollcage forwarder: too many connections; retry later\n"))
            writer.close()
            return
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        except (OSError, h11.ProtocolError, TimeoutError) as exc:
            logger.debug("forwarder connection ended: %r", exc)
        except asyncio.CancelledError:
            # aclose cancelled the exchange (its record says interrupted). The task is asyncio's, which
            # on Python 3.11 logs a handler that ends cancelled as an error: it ends normally instead.
            logger.debug("forwarder connection closed by the shutdown")
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(OSError, asyncio.CancelledError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD)
        while True:
            request = await self._next_request(conn, reader)
            if request is None:
                return
            keep = await self._exchange(conn, reader, writer, request)
            if not keep or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()

    async def _next_request(self, conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Request | None:
        timeout = _IDLE_TIMEOUT_S
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Request):
                return event
            if event is not h11.NEED_DATA:
                return None
            try:
                data = await asyncio.wait_for(reader.read(_CHUNK), timeout)
            except TimeoutError:
                return None
            conn.receive_data(data)
            timeout = _HEAD_TIMEOUT_S

    async def _read_body(self, conn: h11.Connection, reader: asyncio.StreamReader) -> bytes | None:
        """The whole request body, or ``None`` past its bound (its own, or all exchanges' together)."""
        body = bytearray()
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Data):
                body += event.data
                if len(body) > _MAX_REQUEST_BYTES or self._held + len(body) > _MAX_HELD_BYTES:
                    return None
            elif isinstance(event, h11.EndOfMessage):
                return bytes(body)
            elif event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(_CHUNK), _HEAD_TIMEOUT_S)
                conn.receive_data(data)
            else:
                raise ConnectionResetError("the harness closed the connection in the middle of its request")

    async def _exchange(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        req: h11.Request,
    ) -> bool:
        method = req.method.decode("ascii", "replace")
        target = req.target.decode("ascii", "replace")
        headers = list(req.headers.raw_items())
        body = await self._read_body(conn, reader)
        if body is None:
            message = f"request body over {_MAX_REQUEST_BYTES} bytes, or too much in flight at once"
            await self._answer(conn, writer, 413, _json_error(message))
            return False
        self._held += len(body)
        try:
            return await self._serve_request(conn, writer, method, target, headers, body)
        finally:
            self._held -= len(body)

    async def _serve_request(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> bool:
        if not self._authorised(headers):
            await self._answer(
                conn,
                writer,
                401,
                _json_error("rollcage forwarder: send the rollout's OPENAI_API_KEY as a bearer token"),
            )
            return True
        route = self._route(method, target)
        if route is None:
            await self._answer(
                conn,
                writer,
                404,
                _json_error(
                    f"rollcage forwarder: {method} {target.partition('?')[0]} is not served here; the "
                    "sandbox has no network: the model is at /v1/ and the task's tools at /tools/<name>"
                ),
            )
            return True
        if route.api is not None and self.model_calls >= self._spec.agent.max_policy_calls:
            self.refused += 1
            if self._on_refused is not None:
                self._on_refused()
            await self._answer(conn, writer, 403, budget_refusal(self._spec.agent.max_policy_calls))
            return True
        if route.api is not None:
            self.model_calls += 1
        return await self._forward(conn, writer, route, method, headers, body)

    def _authorised(self, headers: list[tuple[bytes, bytes]]) -> bool:
        for name, value in headers:
            lower = name.lower()
            if lower == b"authorization":
                scheme, _, credential = value.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(credential.strip(), self._token):
                    return True
            elif lower in (b"x-api-key", b"api-key") and hmac.compare_digest(value.strip(), self._token):
                return True
        return False

    def _route(self, method: str, target: str) -> _Route | None:
        path, sep, query = target.partition("?")
        if not path.startswith("/"):
            return None
        for segment in path.split("/"):
            decoded = urllib.parse.unquote(segment)
            if decoded in (".", "..") or "/" in decoded or "\\" in decoded:
                return None
        suffix = sep + query
        model = self._spec.model
        if path.startswith("/v1/"):
            rest = path[len("/v1") :]
            url = model.base_url.rstrip("/") + rest + suffix
            return _Route("model", url, model.uds, model.timeout_s, model_call_api(method, rest))
        if path.startswith("/tools/") and method == "POST":
            tool = self._tools.get(urllib.parse.unquote(path[len("/tools/") :]))
            if tool is None:
                return None
            endpoint = self._spec.resources[tool.resource]
            tool_path = "/" + (tool.path if tool.path is not None else tool.name).lstrip("/")
            return _Route(
                "tool", endpoint.base_url.rstrip("/") + tool_path + suffix, endpoint.uds, endpoint.timeout_s
            )
        return None

    def _client(self, route: _Route) -> httpx.AsyncClient:
        # One client per socket and scheme: a plain-http client never verifies, so https gets its own.
        key = (route.uds, urllib.parse.urlsplit(route.url).scheme)
        client = self._clients.get(key)
        if client is None:
            client = httpx.AsyncClient(
                transport=transport_for(route.url, uds=route.uds),
                follow_redirects=False,
                trust_env=False,
                headers={"accept-encoding": "identity"},
            )
            self._clients[key] = client
        return client

    def _upstream_headers(
        self, route: _Route, headers: list[tuple[bytes, bytes]]
    ) -> list[tuple[bytes, bytes]]:
        drop = _DROP | _CREDENTIALS | hop_by_hop(headers)
        kept = [
            (name, value)
            for name, value in headers
            if (lower := name.lower()) not in drop and not lower.startswith(b"x-rollcage-")
        ]
        jar = self._jars.model if route.kind == "model" else self._jars.resource
        cookies = {**_cookies_of(headers), **jar}
        if cookies:
            # Both sides were checked on the way in (rollcage.headers): every cookie here can be sent.
            kept.append((b"cookie", cookie_header(cookies)))
        kept.append((b"accept-encoding", b"identity"))
        return kept

    async def _forward(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        route: _Route,
        method: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> bool:
        started = time.time()
        status: int | None = None
        content_type: str | None = None
        kept: bytearray | None = bytearray() if route.api is not None else None
        limit = self._spec.model.max_response_bytes
        first_byte: float | None = None
        error: str | None = None
        held: bytes | None = None
        reusable = True
        response_from_proxy = False
        interrupted = False
        client = self._client(route)
        try:
            request = client.build_request(
                method,
                route.url,
                headers=self._upstream_headers(route, headers),
                content=body,
                timeout=httpx.Timeout(route.timeout_s, connect=min(route.timeout_s, 30.0)),
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                error = f"the egress proxy cannot be reached: {type(exc).__name__}: {exc}"
                await self._answer(conn, writer, 502, _json_error(f"rollcage forwarder: {error}"))
                return True
            try:
                first_byte = time.time()
                status = response.status_code
                response_from_proxy = response.headers.get("x-rollcage-proxy") == "1"
                content_type = response.headers.get("content-type")
                self._keep_cookies(route, response.headers.raw)
                drop = hop_by_hop(list(response.headers.raw))
                head = h11.Response(
                    status_code=status,
                    headers=[(k, v) for k, v in response.headers.raw if k.lower() not in drop],
                    reason=response.reason_phrase.encode("latin-1", "replace"),
                )
                await _send(writer, conn.send(head))
                async for chunk in response.aiter_raw():
                    if kept is not None:
                        if len(kept) + len(chunk) > limit or self._held + len(chunk) > _MAX_HELD_BYTES:
                            self._held -= len(kept)
                            kept = None
                        else:
                            kept += chunk
                            self._held += len(chunk)
                    # The last chunk is held back until the model call is recorded (see the module docstring).
                    if held is not None:
                        await _send(writer, conn.send(h11.Data(data=held)))
                    held = chunk
            except httpx.HTTPError as exc:
                error = f"the answer was cut off: {type(exc).__name__}: {exc}"
                reusable = False
            except (OSError, TimeoutError) as exc:
                error = f"the harness stopped reading the answer: {type(exc).__name__}: {exc}"
                raise
            finally:
                await response.aclose()
        except asyncio.CancelledError:
            # The rollout is stopping (the forwarder closes): the call was in flight, not failed.
            interrupted = True
            raise
        finally:
            if kept is not None:
                self._held -= len(kept)
            # The proxy's own answers (a refusal, a bound) never reached the model: not a model call,
            # as the capture journal has it. Its 502 (the model unreachable) is one, failed.
            own = status not in (None, 502) and response_from_proxy
            if route.api is not None and not own:
                exchange = WireExchange(
                    api=route.api,
                    request=body,
                    status=status,
                    content_type=content_type,
                    response=None if kept is None else bytes(kept),
                    started_at=started,
                    first_byte_at=first_byte,
                    ended_at=time.time(),
                    error=error,
                    interrupted=interrupted and error is None,
                )
                await shielded(self._on_model_exchange(exchange))
        if held is not None:
            await _send(writer, conn.send(h11.Data(data=held)))
        if not reusable:
            return False
        await _send(writer, conn.send(h11.EndOfMessage()))
        return True

    def _keep_cookies(self, route: _Route, headers: list[tuple[bytes, bytes]]) -> None:
        jar = self._jars.model if route.kind == "model" else self._jars.resource
        for problem in update_cookies(jar, headers, strict=False):
            # The harness saw the answer whole; only what could never be sent back is not kept.
            logger.warning("forwarder: %s %s", route.kind, problem)

    async def _answer(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, status: int, body: bytes
    ) -> None:
        headers = [
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("x-rollcage-forwarder", "1"),
        ]
        data = conn.send(h11.Response(status_code=status, headers=headers)) or b""
        data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
        await _send(writer, data)


async def _send(writer: asyncio.StreamWriter, data: bytes | None) -> None:
    if data:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), _IDLE_TIMEOUT_S)


def _json_error(message: str) -> bytes:
    import orjson

    return orjson.dumps({"error": {"message": message, "type": "rollcage_forwarder", "code": None}})


def _simple(status: int, text: bytes) -> bytes:
    return (
        b"HTTP/1.1 %d Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n%s" % (status, len(text), text)
    )


def _cookies_of(headers: list[tuple[bytes, bytes]]) -> Mapping[str, str]:
    cookies: dict[str, str] = {}
    for name, value in headers:
        if name.lower() == b"cookie":
            cookies.update(parse_cookie_header(value))
    return cookies
