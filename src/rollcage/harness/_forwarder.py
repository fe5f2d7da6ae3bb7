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
counts model calls and refuses those past ``max_policy_calls`` (with the proxy's
rule, :class:`rollcage.http.PolicyCalls`; the proxy refuses them too), and records
every model exchange for the worker before the harness sees the end of its answer,
so a tool call the harness reports afterwards always finds the model call that
asked for it. Connections, head and body sizes and idle times are bounded by the
server loop the proxy uses too (:class:`rollcage.http.HttpServer`); everything else
(the allow-list, the capture, the credential) stays with the proxy.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, Self

from rollcage.harness._calls import WireExchange
from rollcage.headers import cookie_header, parse_cookie_header, update_cookies
from rollcage.http import (
    BUDGET_CODE,
    HOP_BY_HOP,
    REFUSAL_STATUS,
    Answer,
    Exchange,
    HttpServer,
    PolicyCalls,
    Reply,
    ServerLimits,
    budget_refusal,
    hop_by_hop,
    httpx,
    model_call_api,
    transport_for,
)
from rollcage.procs import AsyncClosing, shielded
from rollcage.protocol import ResourceToolSpec, WorkerInput

__all__ = ["BUDGET_CODE", "Forwarder", "budget_refusal"]

logger = logging.getLogger("rollcage.harness")

# Bounds of the harness's requests: a harness's own model calls may take their time (idle: two minutes).
_LIMITS = ServerLimits(
    max_head_bytes=64 * 1024,
    max_body_bytes=32 * 1024 * 1024,
    # What all exchanges in progress may hold at once: request bodies, and answers kept for the record.
    max_held_bytes=128 * 1024 * 1024,
    idle_timeout_s=120.0,
    head_timeout_s=30.0,
    body_timeout_s=30.0,
)
_BUSY_TEXT = b"rollcage forwarder: too many connections; retry later\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
)
_DROP = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect", b"cookie"}
_CREDENTIALS = frozenset({b"authorization", b"x-api-key", b"api-key"})

OnModelExchange = Callable[[WireExchange], Awaitable[None]]
"""Called with every finished model exchange, before the harness gets the end of the answer."""


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
        self._limits = (
            _LIMITS
            if max_connections == _LIMITS.max_connections
            else replace(_LIMITS, max_connections=max_connections)
        )
        self._calls = PolicyCalls(spec.agent.max_policy_calls)
        self._jars = _Jars(model=dict(spec.model_cookies), resource=dict(spec.resource_cookies))
        self._tools = {t.name: t for t in spec.tools if isinstance(t, ResourceToolSpec)}
        self._server: HttpServer[Exchange] | None = None
        self._clients: dict[tuple[str | None, str], httpx.AsyncClient] = {}
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        self.port = 0
        """The TCP port on 127.0.0.1 (0 until started)."""

    @property
    def model_calls(self) -> int:
        """Model calls forwarded so far."""
        return self._calls.spent

    @property
    def refused(self) -> int:
        """Model calls refused past ``max_policy_calls``."""
        return self._calls.refused

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
            listener = _listen()
            self.port = listener.getsockname()[1]
            self._server = HttpServer(listener, self, self._limits, name="the harness forwarder", busy=_BUSY)
            await self._server.__aenter__()
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
        await shielded(self._shut())

    async def _shut(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    # ------------------------------------------------------------------ exchanges (rollcage.http.Service)

    def begin(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        started_at: float,
        *,
        readable: bool,
    ) -> Exchange:
        """A new exchange (part of :class:`rollcage.http.Service`)."""
        return Exchange(method=method, target=target, request_headers=headers, started_at=started_at)

    def answer(self, exchange: Exchange, status: int, message: str) -> Answer:
        """Its own answer ``status`` saying ``message`` (part of :class:`rollcage.http.Service`)."""
        return _json_answer(status, _json_error(f"rollcage forwarder: {message}"))

    async def finish(self, exchange: Exchange) -> bool:
        """Nothing to do: model exchanges are recorded as they end (part of :class:`rollcage.http.Service`).

        **Cancellation:** nothing here waits.
        """
        return True

    async def respond(self, exchange: Exchange, reply: Reply) -> bool:
        """Forward the harness's request, or refuse it; whether the connection can carry another request.

        Part of :class:`rollcage.http.Service`.

        **Cancellation:** the forwarder is closing: a model call in flight is recorded as interrupted.
        """
        method, target, headers = exchange.method, exchange.target, exchange.request_headers
        if not self._authorised(headers):
            message = "rollcage forwarder: send the rollout's OPENAI_API_KEY as a bearer token"
            await reply.answer(exchange, _json_answer(401, _json_error(message)))
            return True
        route = self._route(method, target)
        if route is None:
            message = (
                f"rollcage forwarder: {method} {target.partition('?')[0]} is not served here; the "
                "sandbox has no network: the model is at /v1/ and the task's tools at /tools/<name>"
            )
            await reply.answer(exchange, _json_answer(404, _json_error(message)))
            return True
        if route.api is not None and not self._calls.take():
            if self._on_refused is not None:
                self._on_refused()
            await reply.answer(exchange, _json_answer(REFUSAL_STATUS, self._calls.refusal_body()))
            return True
        return await self._forward(exchange, reply, route)

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

    async def _forward(self, exchange: Exchange, reply: Reply, route: _Route) -> bool:
        server = self._server
        assert server is not None
        body = exchange.request_body
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
                exchange.method,
                route.url,
                headers=self._upstream_headers(route, exchange.request_headers),
                content=body,
                timeout=httpx.Timeout(route.timeout_s, connect=min(route.timeout_s, 30.0)),
            )
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                error = f"the egress proxy cannot be reached: {type(exc).__name__}: {exc}"
                await reply.answer(exchange, _json_answer(502, _json_error(f"rollcage forwarder: {error}")))
                return True
            try:
                first_byte = time.time()
                status = response.status_code
                response_from_proxy = response.headers.get("x-rollcage-proxy") == "1"
                content_type = response.headers.get("content-type")
                self._keep_cookies(route, response.headers.raw)
                drop = hop_by_hop(list(response.headers.raw))
                await reply.head(
                    status,
                    [(k, v) for k, v in response.headers.raw if k.lower() not in drop],
                    response.reason_phrase.encode("latin-1", "replace"),
                )
                async for chunk in response.aiter_raw():
                    if kept is not None:
                        if (
                            len(kept) + len(chunk) > limit
                            or server.held + len(chunk) > self._limits.max_held_bytes
                        ):
                            server.held -= len(kept)
                            kept = None
                        else:
                            kept += chunk
                            server.held += len(chunk)
                    # The last chunk is held back until the model call is recorded (see the module docstring).
                    if held is not None:
                        await reply.data(held)
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
                server.held -= len(kept)
            # The proxy's own answers (a refusal, a bound) never reached the model: not a model call,
            # as the capture journal has it. Its 502 (the model unreachable) is one, failed.
            own = status not in (None, 502) and response_from_proxy
            if route.api is not None and not own:
                wire = WireExchange(
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
                await shielded(self._on_model_exchange(wire))
        if held is not None:
            await reply.data(held)
        if not reusable:
            return False
        await reply.end()
        return True

    def _keep_cookies(self, route: _Route, headers: list[tuple[bytes, bytes]]) -> None:
        jar = self._jars.model if route.kind == "model" else self._jars.resource
        for problem in update_cookies(jar, headers, strict=False):
            # The harness saw the answer whole; only what could never be sent back is not kept.
            logger.warning("forwarder: %s %s", route.kind, problem)


def _json_error(message: str) -> bytes:
    import orjson

    return orjson.dumps({"error": {"message": message, "type": "rollcage_forwarder", "code": None}})


def _json_answer(status: int, body: bytes) -> Answer:
    """One of the forwarder's own answers: a JSON body, marked as the forwarder's."""
    return Answer(status, [(b"content-type", b"application/json"), (b"x-rollcage-forwarder", b"1")], body)


def _listen() -> socket.socket:
    """A listening socket on a free port of ``127.0.0.1``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _cookies_of(headers: list[tuple[bytes, bytes]]) -> Mapping[str, str]:
    cookies: dict[str, str] = {}
    for name, value in headers:
        if name.lower() == b"cookie":
            cookies.update(parse_cookie_header(value))
    return cookies
