"""The egress proxy: the sandbox's only way out, on a Unix socket, with an allow-list and a capture.

Routing
=======

The proxy serves plain HTTP/1.1 on a Unix socket that is bound into the
sandbox. Upstreams come from the controller's ``input.json`` (host view) and are
reached by path prefix::

    /model/v1/<rest>             ->  <model.base_url>/<rest>               (+ Authorization: Bearer <key>)
    /resource/<name>/<rest>      ->  <resources[name].base_url>/<rest>     (+ its bearer token, if configured)
    anything else                ->  403, with a message saying what is allowed

The model route is itself an allow-list of methods and paths
(``ProxyConfig.model_routes``; by default ``POST /chat/completions``, ``POST
/responses`` and ``GET /models``): anything else under ``/model/v1`` is answered
403 too, so the injected credential never reaches ``DELETE /files/...`` or
``POST /fine_tuning/jobs``. A resource route forwards only ``POST`` to the paths of
the tools that ``input.json`` names for it: an environment's controller-only
endpoints (``/verify``, ``/seed_session``, ``/close_session``) are out of reach, so
agent code can neither grade itself nor reset or replace its session.

The worker's ``input.json`` is rewritten to match (:func:`sandbox_input`):
``model.base_url`` becomes ``http://rollcage-proxy/model/v1`` and each
resource's ``base_url`` ``http://rollcage-proxy/resource/<name>``, all with
``uds`` set to the proxy's socket. An upstream that was itself reached through a
Unix socket (``uds`` in the original input) still is, from the proxy.

Headers
=======

What the sandbox sends is not trusted: hop-by-hop headers (and any the
``Connection`` header nominates), credential headers (``Authorization``,
``Proxy-Authorization``, ``X-Api-Key``, ``Api-Key``) and identity headers
(``X-Rollout-Id``, ``X-Task-Id``, any ``X-Rollcage-*``) are dropped. The proxy
then sets the identity headers from the controller's ``input.json``
(:func:`identity_headers`) and the route's credential, read from the
supervisor's environment. The proxy asks upstreams for uncompressed bodies so
that the capture is readable.

Bounds
======

Everything a sandbox can make the proxy hold is bounded per rollout:
connections open at once (``max_connections``, and a fair share of what the
process's open-file limit affords, see :mod:`rollcage.supervisor.fds`; more are
refused at accept with a short 503 and counted), the time a connection may sit
idle, the time to send a request's head and its body (408 past them), the head's
size (64 KiB; 431 past it), request and response sizes (413, 502), the request
bytes buffered at once over all connections (twice ``max_request_bytes``; 503 past
it) and the capture's bytes. The response size and the capture are the proxy's
own to bound; the others are the server loop's (:class:`rollcage.http.ServerLimits`,
made from :class:`ProxyConfig`).
Request bodies are read whole; responses are streamed back chunk by chunk, so
server-sent events arrive as they are produced.

Upstream connections are pooled per upstream and shared by the proxies of the
event loop (kept alive, reused by whichever rollout asks next; see
``_UpstreamPools``), in pools of at most ``_POOL_USERS`` rollouts each; only a
completely read response gives its connection back.
The capture, the credential and the identity headers stay per rollout.

The HTTP/1.1 side (accepting, the head and body bounds and timeouts, keep-alive,
the watch on a client that leaves, closing every socket on every path) is the server
loop of :mod:`rollcage.http`, which the harness's forwarder runs too; this module
says what each request means (:meth:`EgressProxy.begin`, :meth:`EgressProxy.respond`)
and captures it (:meth:`EgressProxy.finish`). A model call past
``model_call_limit`` is refused by the rule every agent uses
(:class:`rollcage.http.PolicyCalls`).

Capture
=======

Every exchange, allowed or not, appends exactly one JSON line to
``model_capture.jsonl`` once it has ended, in a ``finally`` path that also
runs when the client resets the connection mid-response or the rollout ends
(``seq``, ``rollout_id``, ``route`` ``model|resource|denied``, ``name``, method,
path, upstream URL, request headers and body, response status, headers and
body, ``first_byte_at``/``ended_at`` timings, ``error``). Bodies are stored as
``{"size", "json"|"text"|"base64"}``; one over ``capture_body_bytes`` as its
size, ``sha256`` and first 64 KiB (``"truncated": true``). Credentials never
appear in it: their values are redacted. Each line is written and synced whole
or cut back off (:class:`rollcage.durable.AppendCursor`): a failed write (disk
full) is counted, never left torn. Past ``max_capture_bytes`` lines lose their
bodies, the proxy stops taking requests, and the supervisor ends the rollout as
the policy's fault.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import os
import socket
import ssl
import time
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

import orjson

from rollcage.durable import AppendCursor
from rollcage.errors import SupervisorError
from rollcage.headers import encode_id, header_value
from rollcage.http import (
    HOP_BY_HOP,
    REFUSAL_STATUS,
    Answer,
    DirectSend,
    Exchange,
    H11Transport,
    HttpServer,
    PolicyCalls,
    Reply,
    ServerLimits,
    hop_by_hop,
    httpx,
)
from rollcage.procs import AsyncClosing, shielded
from rollcage.protocol import ResourceToolSpec, WorkerInput
from rollcage.supervisor.config import ProxyConfig
from rollcage.supervisor.fds import connection_budget, retry_on_emfile

__all__ = [
    "MODEL_PREFIX",
    "PROXY_HOST",
    "EgressProxy",
    "Route",
    "identity_headers",
    "resource_prefix",
    "routes_for",
    "sandbox_input",
]

logger = logging.getLogger("rollcage.supervisor.proxy")


PROXY_HOST = "rollcage-proxy"
"""Host name in the worker's rewritten URLs (any name works: the socket decides where requests go)."""

MODEL_PREFIX = "/model/v1"
"""Path prefix of the model route."""

_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"accept-encoding", b"expect"}
_CREDENTIALS = frozenset({b"authorization", b"proxy-authorization", b"x-api-key", b"api-key"})
_IDENTITY = frozenset({b"x-rollout-id", b"x-task-id"})
_IDENTITY_PREFIX = b"x-rollcage-"
_REDACT = frozenset(name.decode() for name in _CREDENTIALS)
_PREFIX_BYTES = 64 * 1024
_BACKLOG = 64
# Rollouts per shared pool. httpcore's pool (HTTPS) looks at every connection it holds each time a request
# comes or a response ends (a readability poll per idle one, and for each a count of the idle ones),
# so one pool for 256 rollouts cost more than forwarding their requests; pools of 16 keep that
# small and still let a rollout find a connection another left warm.
_POOL_USERS = 16
# Idle upstream connections kept per pool: two per rollout that uses it.
_POOL_KEEPALIVE = 2 * _POOL_USERS
# An idle pooled connection is dropped well before a server would close it (uvicorn: 5 s), so a
# request is rarely sent on a connection the server is closing at that moment (it would fail: 502).
_POOL_IDLE_S = 2.0
_REFUSAL_TEXT = b"rollcage egress proxy: too many connections open from this rollout; retry later\n"
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
    b"x-rollcage-proxy: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_REFUSAL_TEXT), _REFUSAL_TEXT)
)


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
        tool_paths: For a resource route, the only paths it forwards, and only as ``POST``: its
            tools' endpoints. The environment's controller-only endpoints (``/verify``,
            ``/seed_session``, ``/close_session``) are never among them, so agent code cannot
            grade itself or reset its session. ``None``: every method and path (a route built
            by hand; ``routes_for`` always sets it).
    """

    kind: Literal["model", "resource"]
    name: str
    prefix: str
    upstream: str
    uds: str | None = None
    credential: str | None = field(default=None, repr=False)
    tool_paths: frozenset[str] | None = None


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
        paths = frozenset(
            _tool_path(tool.path if tool.path is not None else tool.name)
            for tool in original.tools
            if isinstance(tool, ResourceToolSpec) and tool.resource == name
        )
        routes.append(
            Route(
                kind="resource",
                name=name,
                prefix=resource_prefix(name),
                upstream=endpoint.base_url,
                uds=endpoint.uds,
                credential=resource_credentials.get(name),
                tool_paths=paths,
            )
        )
    return routes


def _tool_path(path: str) -> str:
    """A tool's endpoint as the proxy sees it: the worker joins it to the route with one '/'."""
    return "/" + path.partition("?")[0].lstrip("/")


def identity_headers(original: WorkerInput) -> dict[str, str]:
    """The identity headers the proxy sets on every forwarded request of this rollout."""
    return {"X-Rollout-Id": original.rollout_id, "X-Task-Id": original.task_id}


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


class _Pool:
    """One upstream's connection pool, shared by up to ``_POOL_USERS`` proxies of this event loop."""

    def __init__(self, key: tuple[str, str | None], transport: httpx.AsyncBaseTransport) -> None:
        self.key = key
        self.transport = transport
        self.users = 0


class _UpstreamPools:
    """The upstream connection pools of one event loop, per (base URL, Unix socket).

    Every rollout's proxy used to open its own connections, so 256 rollouts made 256
    TLS/TCP handshakes to the same model server at once (``ConnectTimeout`` on a busy
    machine); now a rollout's request reuses a kept-alive connection that another
    rollout of its pool left idle. A proxy joins the first pool of its upstream with
    room (``_POOL_USERS``), so rollouts fill one pool before the next is opened.
    Only whole, completed responses return a connection to the pool (both transports,
    :class:`~rollcage.http.H11Transport` for plain HTTP and httpx's for HTTPS,
    close one whose response was cut off), so no bytes of one rollout's exchange
    reach another's. A pool has no connection cap of its own: each rollout's connections
    are already capped at accept, so no rollout can starve the others of upstream
    connections. A pool is closed when its last proxy leaves.
    """

    def __init__(self) -> None:
        self._pools: dict[tuple[str, str | None], list[_Pool]] = {}
        self._lock = asyncio.Lock()

    async def acquire(self, route: Route) -> _Borrowed:
        """A transport of a pool of ``route``'s upstream with room, opened if none has; give it back with
        :meth:`release`."""
        key = (route.upstream, route.uds)
        async with self._lock:
            pools = self._pools.setdefault(key, [])
            pool = next((p for p in pools if p.users < _POOL_USERS), None)
            if pool is None:
                transport: httpx.AsyncBaseTransport
                if httpx.URL(route.upstream).scheme == "http":
                    # Plain HTTP (a local inference server, most often): half the CPU a request.
                    transport = H11Transport(uds=route.uds, max_idle=_POOL_KEEPALIVE, idle_s=_POOL_IDLE_S)
                else:
                    context = await asyncio.to_thread(_ssl_context)
                    limits = httpx.Limits(
                        max_connections=None,
                        max_keepalive_connections=_POOL_KEEPALIVE,
                        keepalive_expiry=_POOL_IDLE_S,
                    )
                    transport = httpx.AsyncHTTPTransport(
                        uds=route.uds, retries=0, verify=context, limits=limits
                    )
                pool = _Pool(key, transport)
                pools.append(pool)
            pool.users += 1
        return _Borrowed(pool)

    async def release(self, borrowed: _Borrowed) -> None:
        """Give back a transport from :meth:`acquire`; its pool is closed when its last user leaves."""
        pool = borrowed.pool
        pool.users -= 1
        if pool.users == 0:
            pools = self._pools.get(pool.key, [])
            if pool in pools:
                pools.remove(pool)
            if not pools:
                self._pools.pop(pool.key, None)
            await shielded(pool.transport.aclose())


class _Borrowed(httpx.AsyncBaseTransport):
    """A shared pool's transport as one proxy's client sees it: closing the client leaves it open."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.pool.transport.handle_async_request(request)

    async def aclose(self) -> None:
        return None


_pools_by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _UpstreamPools] = (
    weakref.WeakKeyDictionary()
)


def _upstream_pools() -> _UpstreamPools:
    loop = asyncio.get_running_loop()
    pools = _pools_by_loop.get(loop)
    if pools is None:
        pools = _pools_by_loop[loop] = _UpstreamPools()
    return pools


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    # Loading the CA bundle takes tens of milliseconds: do it once per process, not per rollout
    # (a context is safe to share between connections and clients).
    return httpx.create_ssl_context()


class _BodySink:
    """A body as the capture keeps it: its size, its hash, and its first ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._head = bytearray()
        self._sha = hashlib.sha256()
        self.size = 0

    def feed(self, data: bytes | bytearray) -> None:
        self.size += len(data)
        self._sha.update(data)
        room = self._limit - len(self._head)
        if room > 0:
            self._head += data[:room]

    def record(self, content_type: str | None, *, with_content: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"size": self.size}
        if not self.size:
            return out
        if self.size > self._limit or not with_content:
            out["truncated"] = True
            out["sha256"] = self._sha.hexdigest()
            if with_content:
                out.update(_content(bytes(self._head[:_PREFIX_BYTES]), None, cut=True))
            return out
        out.update(_content(bytes(self._head), content_type, cut=False))
        return out


def _content(data: bytes, content_type: str | None, *, cut: bool) -> dict[str, Any]:
    if content_type is not None and "json" in content_type:
        try:
            return {"json": orjson.loads(data)}
        except orjson.JSONDecodeError:
            pass
    if cut:
        # A prefix may end inside a UTF-8 sequence (at most 3 bytes of it).
        for trim in range(4):
            with contextlib.suppress(UnicodeDecodeError):
                return {"text": data[: len(data) - trim].decode("utf-8")}
    else:
        with contextlib.suppress(UnicodeDecodeError):
            return {"text": data.decode("utf-8")}
    return {"base64": base64.b64encode(data).decode("ascii")}


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


@dataclass
class _Exchange(Exchange):
    """What one request/response pair was, filled in as it happens."""

    route: Route | None = None
    """The allowed upstream it asked for; ``None``: denied (or its head could not be read)."""
    rest: str = ""
    """The target below the route's prefix."""
    denied: str | None = None
    """Why the request is refused (off the allow-list); ``None``: it is not."""
    upstream_url: str | None = None
    response_body: _BodySink | None = None
    first_byte_at: float | None = None
    credential_added: bool = False

    @property
    def kind(self) -> Literal["model", "resource", "denied"]:
        return "denied" if self.route is None else self.route.kind

    def record(self, seq: int, rollout_id: str, *, body_limit: int, with_bodies: bool) -> dict[str, Any]:
        """The capture line (blocking for large bodies: built in the capture's thread)."""
        ended = time.time()
        request_body = _BodySink(body_limit)
        request_body.feed(self.request_body)
        response: dict[str, Any] | None = None
        if self.status is not None:
            sink = self.response_body or _BodySink(0)
            content_type = _header(self.response_headers, b"content-type")
            response = {
                "status": self.status,
                "headers": _headers(self.response_headers),
                "body": sink.record(content_type, with_content=with_bodies),
            }
        content_type = _header(self.request_headers, b"content-type")
        return {
            "seq": seq,
            "rollout_id": rollout_id,
            "route": self.kind,
            "name": None if self.route is None else self.route.name,
            "method": self.method,
            "path": self.target,
            "upstream_url": self.upstream_url,
            "credential_added": self.credential_added,
            "request": {
                "headers": _headers(self.request_headers),
                "body": request_body.record(content_type, with_content=with_bodies),
            },
            "response": response,
            "status": self.status,
            "started_at": self.started_at,
            "first_byte_at": self.first_byte_at,
            "ended_at": ended,
            "duration_s": ended - self.started_at,
            "error": self.error,
        }


class _CaptureFile:
    """``model_capture.jsonl``: one line per exchange, built, appended and synced off the event loop.

    Each line is written whole or cut back off (``AppendCursor``); a line that
    cannot be written is counted in ``failures``. Once a line would take the file
    past ``budget`` bytes, that line and every later one is written without
    bodies and ``over_budget`` is set.
    """

    def __init__(self, path: Path, *, rollout_id: str, body_limit: int, budget: int | None) -> None:
        self._path = path
        self._rollout_id = rollout_id
        self._body_limit = body_limit
        self._budget = budget
        self._cursor: AppendCursor | None = None
        self._lock = asyncio.Lock()
        self.failures = 0
        self.lines: dict[str, int] = {"model": 0, "resource": 0, "denied": 0}
        self.over_budget = False
        self._size = 0

    @property
    def size(self) -> int:
        return self._size if self._cursor is None else self._cursor.good_size

    def open(self) -> None:
        """Open (or create) the capture file for appending (blocking)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = retry_on_emfile(os.open, self._path, flags, 0o600)
        self._cursor = AppendCursor(fd, os.fstat(fd).st_size)

    def _write(self, exchange: _Exchange) -> dict[str, Any]:
        cursor = self._cursor
        assert cursor is not None
        seq = sum(self.lines.values()) + 1
        record = exchange.record(
            seq, self._rollout_id, body_limit=self._body_limit, with_bodies=not self.over_budget
        )
        line = orjson.dumps(record) + b"\n"
        if self._budget is not None and not self.over_budget and cursor.good_size + len(line) > self._budget:
            self.over_budget = True
            record = exchange.record(seq, self._rollout_id, body_limit=self._body_limit, with_bodies=False)
            note = f"capture budget of {self._budget} bytes exceeded: bodies left out"
            record["error"] = note if record["error"] is None else f"{record['error']}; {note}"
            line = orjson.dumps(record) + b"\n"
        try:
            cursor.append(line)
        except OSError as exc:
            self.failures += 1
            logger.error("cannot append to %s: %s", self._path, exc)
            return record
        self.lines[exchange.kind] += 1
        return record

    async def append(self, exchange: _Exchange) -> dict[str, Any] | None:
        """Append the exchange's line; the record (even when the line could not be written), or ``None``."""
        async with self._lock:
            if self._cursor is not None:
                return await asyncio.to_thread(self._write, exchange)
        return None

    async def settled(self) -> None:
        """Return once no line is being written, so ``over_budget`` reflects every finished exchange.

        **Cancellation:** only the wait is abandoned.
        """
        async with self._lock:
            pass

    async def close(self) -> None:
        async with self._lock:
            if self._cursor is not None:
                fd, self._size, self._cursor = self._cursor.fd, self._cursor.good_size, None
                await asyncio.to_thread(os.close, fd)


class EgressProxy(AsyncClosing):
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
        identity: Headers set on every forwarded request (see :func:`identity_headers`); ``None``:
            ``X-Rollout-Id`` only.
        on_budget_exceeded: Called once, on the event loop, with the budget's name
            (``"capture_bytes"``) and the reason in words, when the capture passes
            ``config.max_capture_bytes``.
        on_capture: Awaited with every capture record (whether or not its line could be written),
            once the line is appended: the supervisor journals a harness's model calls from it.
        model_call_limit: Model calls (``POST`` to ``/chat/completions`` or ``/responses``) forwarded
            at most; later ones are answered 403 with an OpenAI-shaped error (code
            ``max_policy_calls``) and never reach the model. ``None``: no limit (the builtin loop
            bounds its own calls).
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
        identity: Mapping[str, str] | None = None,
        on_budget_exceeded: Callable[[str, str], None] | None = None,
        on_capture: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        model_call_limit: int | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.routes = list(routes)
        self._config = config
        self._rollout_id = rollout_id
        self._owner = socket_owner
        identity = {"X-Rollout-Id": rollout_id} if identity is None else identity
        # Ids are any printable text: percent-encoded UTF-8, as the worker's clients send them.
        self._identity = [(k.lower().encode("latin-1"), encode_id(v)) for k, v in identity.items()]
        self._on_budget_exceeded = on_budget_exceeded
        self._on_capture = on_capture
        self._calls = PolicyCalls(model_call_limit)
        self._model_routes = [_parse_model_route(route) for route in config.model_routes]
        self._capture = _CaptureFile(
            capture_path,
            rollout_id=rollout_id,
            body_limit=config.capture_body_bytes,
            budget=config.max_capture_bytes,
        )
        self._listener: socket.socket | None = None
        self._server: HttpServer[_Exchange] | None = None
        self._senders: dict[str, DirectSend] = {}
        self._borrowed: list[_Borrowed] = []
        self._joined = False
        self._state: Literal["unopened", "open", "closed"] = "unopened"
        self._budget_reported = False
        self.exchanges: dict[str, int] = {"model": 0, "resource": 0, "denied": 0}
        """Exchanges so far, by route kind (whether or not their capture line could be written)."""
        self.first_request = asyncio.Event()
        """Set when the sandbox's first request arrives: the worker has started up."""

    @property
    def refused(self) -> int:
        """Connections refused at accept (over the rollout's connection cap)."""
        return 0 if self._server is None else self._server.refused

    @property
    def _handlers(self) -> dict[asyncio.Task[None], Any]:
        """The connections being served."""
        return {} if self._server is None else self._server.connections

    @property
    def _buffered(self) -> int:
        """Request bytes held by the exchanges in progress."""
        return 0 if self._server is None else self._server.held

    @property
    def captured(self) -> dict[str, int]:
        """Capture lines written so far, by route kind."""
        return dict(self._capture.lines)

    @property
    def capture_bytes(self) -> int:
        """Bytes of intact lines in the capture."""
        return self._capture.size

    @property
    def capture_failures(self) -> int:
        """Exchanges whose capture line could not be written."""
        return self._capture.failures

    @property
    def over_budget(self) -> bool:
        """The capture passed ``max_capture_bytes``."""
        return self._capture.over_budget

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
            # The capture file and the socket in one thread hop (each hop costs more than these calls).
            self._listener = await asyncio.to_thread(self._open_files)
            pools = _upstream_pools()
            for route in self.routes:
                timeout = httpx.Timeout(
                    connect=self._config.connect_timeout_s,
                    read=self._config.upstream_timeout_s,
                    write=self._config.upstream_timeout_s,
                    pool=self._config.connect_timeout_s,
                )
                transport = await pools.acquire(route)
                self._borrowed.append(transport)
                client = httpx.AsyncClient(
                    transport=transport,
                    timeout=timeout,
                    follow_redirects=False,
                    # Nothing from the supervisor's environment (.netrc credentials, SSL
                    # variables) may attach itself to the sandbox's traffic.
                    trust_env=False,
                )
                # The sandbox's cookies are its own: no jar of the proxy's adds or keeps any.
                self._senders[route.prefix] = DirectSend(client, transport)
            connection_budget().join()
            self._joined = True
            listener, self._listener = self._listener, None
            self._server = HttpServer(
                listener,
                self,
                _limits(self._config),
                name=f"rollout {self._rollout_id}: the egress proxy",
                busy=_REFUSAL,
                admit=self._admit,
                on_release=connection_budget().release,
            )
            await self._server.__aenter__()
        except BaseException as exc:
            await self.aclose()
            if isinstance(exc, OSError):
                raise SupervisorError(f"cannot start the egress proxy on {self.socket_path}: {exc}") from exc
            raise
        return self

    def _open_files(self) -> socket.socket:
        """Open the capture file, then the listening socket (blocking)."""
        self._capture.open()
        return retry_on_emfile(self._listen)

    def _listen(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.socket_path))
            os.chmod(self.socket_path, 0o600)
            if self._owner is not None:
                os.chown(self.socket_path, *self._owner)
            sock.listen(_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def aclose(self) -> None:
        """Stop accepting, abort exchanges still running (each still gets its capture line), close all.

        **Cancellation:** shutdown finishes first (it only waits for tasks it has cancelled itself),
        then ``CancelledError`` propagates.
        """
        if self._state == "closed":
            return
        self._state = "closed"
        try:
            await shielded(self._shut_down())
        finally:
            # The callback is the owner's (a bound method), and the owner holds this proxy: dropped
            # once closed, the pair goes with its last reference, not at a full collection.
            self._on_budget_exceeded = None

    async def _shut_down(self) -> None:
        if self._server is not None:
            await self._server.aclose()
        elif self._listener is not None:
            self._listener.close()
        if self._joined:
            connection_budget().leave()
        for send in self._senders.values():
            await send.aclose()
        if self._borrowed:
            pools = _upstream_pools()
            for borrowed in self._borrowed:
                await pools.release(borrowed)
            self._borrowed.clear()
        await self._capture.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def _admit(self, open_connections: int) -> bool:
        """Whether to serve one more connection of the sandbox's (it holds ``open_connections``)."""
        # An exchange that has just answered its client may still be writing its capture line: the
        # client's next request must find the budget spent if that line spends it, not slip in.
        # (The line's task took the capture's lock before this accept could be seen.)
        await self._capture.settled()
        if self.over_budget:
            return False
        return connection_budget().try_acquire(open_connections, self._config.max_connections)

    # ----------------------------------------------------------------- exchanges (rollcage.http.Service)

    def begin(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        started_at: float,
        *,
        readable: bool,
    ) -> _Exchange:
        """A new exchange: its route, or why it is denied (part of :class:`rollcage.http.Service`)."""
        self.first_request.set()
        exchange = _Exchange(method=method, target=target, request_headers=headers, started_at=started_at)
        if readable:
            matched = self._match(method, target)
            if isinstance(matched, str):
                exchange.denied = matched
            else:
                exchange.route, exchange.rest = matched
        return exchange

    def answer(self, exchange: _Exchange, status: int, message: str) -> Answer:
        """The proxy's own answer ``status`` saying ``message`` (part of :class:`rollcage.http.Service`)."""
        return _text_answer(status, f"rollcage egress proxy: {message}")

    async def finish(self, exchange: _Exchange) -> bool:
        """Capture ``exchange``; whether the connection may go on (part of :class:`rollcage.http.Service`).

        **Cancellation:** the server shields it: the line is always written.
        """
        await self._record(exchange)
        return not self.over_budget

    async def _record(self, exchange: _Exchange) -> None:
        self.exchanges[exchange.kind] += 1
        record = await self._capture.append(exchange)
        if record is not None and self._on_capture is not None:
            try:
                await self._on_capture(record)
            except Exception:
                logger.exception("rollout %s: the capture hook failed", self._rollout_id)
        if self._capture.over_budget and not self._budget_reported:
            self._budget_reported = True
            logger.warning("rollout %s: the capture is over its budget", self._rollout_id)
            if self._on_budget_exceeded is not None:
                self._on_budget_exceeded(
                    "capture_bytes",
                    f"the rollout's capture_bytes budget ({self._config.max_capture_bytes} bytes of "
                    "model_capture.jsonl) was exceeded",
                )

    def _match(self, method: str, target: str) -> tuple[Route, str] | str:
        """The route and the rest of the target, or why the request is refused."""
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
                rest = target[len(prefix) :]
                if route.kind == "model" and not self._model_allows(method, rest.partition("?")[0]):
                    allowed = ", ".join(self._config.model_routes)
                    return f"the model route forwards only {allowed}"
                paths = route.tool_paths
                if paths is not None and (method != "POST" or rest.partition("?")[0] not in paths):
                    tools = ", ".join(sorted(paths)) or "none"
                    return (
                        f"the resource route {route.name!r} forwards only POST to its tools' paths ({tools})"
                    )
                return route, rest
        return "no allowed upstream for this path"

    def _model_allows(self, method: str, path: str) -> bool:
        for allowed_method, allowed_path, below in self._model_routes:
            if method != allowed_method:
                continue
            if path == allowed_path or (below and path.startswith(allowed_path.rstrip("/") + "/")):
                return True
        return False

    def _refusal(self, exchange: _Exchange, why: str) -> str:
        allowed = ", ".join(f"{r.prefix}/..." for r in self.routes)
        return (
            f"rollcage egress proxy: {exchange.method} {exchange.target} refused: {why}. "
            f"The sandbox has no network; allowed: {allowed}"
        )

    async def respond(self, exchange: _Exchange, reply: Reply) -> bool:
        """Forward an allowed request, refuse any other; whether the connection can carry another request.

        Part of :class:`rollcage.http.Service`.

        **Cancellation:** the upstream request is abandoned; the exchange is still captured.
        """
        ex, route = exchange, exchange.route
        if route is None:
            why = ex.denied or "no allowed upstream for this path"
            ex.error = why
            await reply.answer(ex, _text_answer(403, self._refusal(ex, why)))
            return True
        if route.kind == "model" and not self._calls.take_request(ex.method, ex.rest):
            ex.error = f"refused: {self._calls.reason}"
            headers = [(b"content-type", b"application/json"), (b"x-rollcage-proxy", b"1")]
            await reply.answer(ex, Answer(REFUSAL_STATUS, headers, self._calls.refusal_body() + b"\n"))
            return True
        ex.upstream_url = route.upstream.rstrip("/") + ex.rest
        # While the upstream answers, the client is watched: if it goes away, the upstream request
        # is abandoned rather than left hanging.
        keep = await reply.until_client_leaves(self._forward(ex, reply))
        if keep is None:
            ex.error = ex.error or "the client closed the connection before the response ended"
            return False
        return keep

    def _upstream_headers(self, ex: _Exchange, route: Route) -> list[tuple[bytes, bytes]]:
        drop = _REQUEST_DROP | _CREDENTIALS | _IDENTITY | hop_by_hop(ex.request_headers)
        headers = [
            (name, value)
            for name, value in ex.request_headers
            if (lower := name.lower()) not in drop and not lower.startswith(_IDENTITY_PREFIX)
        ]
        headers.append((b"accept-encoding", b"identity"))
        headers += self._identity
        if route.credential is not None:
            # Checked when the supervisor read it (Supervisor.check): it can be sent.
            headers.append(
                (b"authorization", header_value(f"Bearer {route.credential}", what="the credential"))
            )
            ex.credential_added = True
        return headers

    async def _forward(self, ex: _Exchange, reply: Reply) -> bool:
        route = ex.route
        assert route is not None and ex.upstream_url is not None
        send = self._senders[route.prefix]
        try:
            response = await send(
                ex.method, ex.upstream_url, headers=self._upstream_headers(ex, route), content=ex.request_body
            )
        except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
            ex.error = f"upstream {route.name} unreachable: {type(exc).__name__}: {exc}"
            await reply.answer(ex, self.answer(ex, 502, ex.error))
            return True
        try:
            ex.first_byte_at = time.time()
            limit = self._config.max_response_bytes
            length = response.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                ex.error = f"upstream response of {length} bytes is over the {limit}-byte bound"
                await reply.answer(ex, self.answer(ex, 502, ex.error))
                return True
            ex.status = response.status_code
            drop = hop_by_hop(response.headers.raw)
            ex.response_headers = [
                (name, value) for name, value in response.headers.raw if name.lower() not in drop
            ]
            ex.response_body = sink = _BodySink(self._config.capture_body_bytes)
            reason = response.reason_phrase.encode("latin-1", "replace")
            await reply.head(response.status_code, ex.response_headers, reason)
            async for chunk in response.aiter_raw():
                if sink.size + len(chunk) > limit:
                    ex.error = f"upstream response over the {limit}-byte bound; cut off"
                    return False
                sink.feed(chunk)
                await reply.data(chunk)
            await reply.end()
            return True
        except httpx.HTTPError as exc:
            ex.error = f"upstream {route.name} failed mid-response: {type(exc).__name__}: {exc}"
            return False
        except OSError as exc:
            ex.error = (
                f"the client connection failed while the response was sent: {type(exc).__name__}: {exc}"
            )
            raise
        finally:
            await response.aclose()


def _limits(config: ProxyConfig) -> ServerLimits:
    """The proxy's bounds, as the server loop takes them."""
    return ServerLimits(
        max_body_bytes=config.max_request_bytes,
        # What a rollout's requests in progress may hold at once: two whole bodies.
        max_held_bytes=2 * config.max_request_bytes,
        idle_timeout_s=config.idle_timeout_s,
        head_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        max_connections=config.max_connections,
    )


def _text_answer(status: int, text: str) -> Answer:
    """One of the proxy's own answers: ``text`` as plain text, marked as the proxy's."""
    headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"x-rollcage-proxy", b"1")]
    return Answer(status, headers, (text + "\n").encode())


def _parse_model_route(route: str) -> tuple[str, str, bool]:
    """``'POST /chat/completions'`` -> (method, path, whether paths below it are allowed too)."""
    method, _, path = route.partition(" ")
    below = path.endswith("/*")
    return method, path[:-2] if below else path, below
