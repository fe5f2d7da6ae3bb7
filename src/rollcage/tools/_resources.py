"""HTTP resource tools: one JSON POST per call, the NeMo Gym convention.

A call to tool ``name`` posts its arguments as JSON to ``{base_url}{path}``
(``path`` defaults to ``/<name>``) of the resource endpoint the tool names, with
the rollout's resource cookies and an ``X-Rollout-Id`` header. Cookies the
resource sets (``Set-Cookie``) are kept and sent with later calls to any
resource, and end up in the result as ``resource_cookies``.

What the model sees and what the worker sees are kept apart:

* an answer from the resource, whatever its status, is the model's business:
  ``4xx`` and ``500`` come back as text (``error: HTTP 404 from get_weather: ...``)
  and the call's status is ``failed`` (a 2xx answer: ``completed``);
* a resource that cannot be reached, does not answer in time, or answers with a
  gateway/unavailable status (``502``, ``503``, ``504``: how an egress proxy
  reports an upstream it cannot reach) raises
  :class:`~rollcage.errors.ResourceUnavailableError`, an infrastructure
  failure: the rollout is retried, never trained on.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Mapping, Sequence
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

from rollcage.errors import ConfigError, HeaderValueError, ResourceUnavailableError
from rollcage.headers import cookie_header, encode_id, update_cookies
from rollcage.http import httpx, transport_for
from rollcage.procs import AsyncClosing
from rollcage.protocol import ResourceEndpoint, ResourceToolSpec, ToolStatus

__all__ = ["ResourceTools", "tool_parameters"]

_UNAVAILABLE_STATUSES = frozenset({502, 503, 504})
"""Statuses that say "the resource is not there", not "your request was wrong"."""
_ERROR_BODY_CHARS = 2000
"""How much of an error response's body the model sees."""


def tool_parameters(spec: ResourceToolSpec) -> list[str]:
    """The tool's parameter names in schema order: its positional parameters as a bridged function.

    For codeact, ``make_executor(..., bridged_tools={s.name: tool_parameters(s) for s in specs})``
    lets agent code call ``get_weather("Oslo")`` as well as ``get_weather(city="Oslo")``.
    """
    properties = spec.parameters.get("properties")
    return [str(name) for name in properties] if isinstance(properties, dict) else []


class _State(enum.Enum):
    UNOPENED = "unopened"
    OPENED = "opened"
    CLOSED = "closed"


class ResourceTools(AsyncClosing):
    """The rollout's HTTP resource tools, with one ``httpx`` client per endpoint.

    Example::

        async with ResourceTools(inp.resources, specs, rollout_id=inp.rollout_id,
                                 cookies=inp.resource_cookies) as tools:
            status, text = await tools.call("get_weather", {"city": "Oslo"})
        result_cookies = tools.cookies

    Calls may run concurrently. Requests are never retried here: a POST to a
    stateful resource is not idempotent, and a failed call fails the rollout as
    an infrastructure failure, which the controller retries.
    """

    def __init__(
        self,
        resources: Mapping[str, ResourceEndpoint],
        specs: Sequence[ResourceToolSpec],
        *,
        rollout_id: str,
        cookies: Mapping[str, str],
        max_response_bytes: int = 1 << 20,
        timeout_s: float | None = None,
    ) -> None:
        """Check the specs against the endpoints; nothing is opened yet.

        Args:
            resources: Endpoints by name (``WorkerInput.resources``).
            specs: The resource tools offered to the agent.
            rollout_id: Sent as ``X-Rollout-Id`` with every call.
            cookies: Initial cookies (``WorkerInput.resource_cookies``).
            max_response_bytes: A longer response body is cut (with a visible
                marker) while it is read, so a huge answer costs no memory.
            timeout_s: The agent's bound on one tool call (``AgentSettings.tool_timeout_s``):
                a call ends at the earlier of it and its endpoint's ``timeout_s``; ``None``:
                the endpoint's alone.

        Raises:
            ConfigError: a tool names a resource that is not defined, or two
                tools share a name.
        """
        self._resources = dict(resources)
        self._specs: dict[str, ResourceToolSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ConfigError(f"resource tool {spec.name!r} is defined twice")
            if spec.resource not in self._resources:
                raise ConfigError(
                    f"resource tool {spec.name!r} names resource {spec.resource!r}, which is not in "
                    f"resources (defined: {sorted(self._resources) or 'none'})"
                )
            self._specs[spec.name] = spec
        self._rollout_id = rollout_id
        self._cookies = dict(cookies)
        self._max_response_bytes = max_response_bytes
        self._timeout_s = timeout_s
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._state = _State.UNOPENED

    @property
    def cookies(self) -> dict[str, str]:
        """The resource cookies now (a copy): the initial ones, updated from every ``Set-Cookie``."""
        return dict(self._cookies)

    @property
    def names(self) -> list[str]:
        """The tool names, in spec order."""
        return list(self._specs)

    async def __aenter__(self) -> ResourceTools:
        """Open one client per endpoint used by a tool.

        Raises:
            RuntimeError: the tools were opened before.

        **Cancellation:** nothing awaits here: the clients are built at once.
        """
        if self._state is not _State.UNOPENED:
            raise RuntimeError(f"ResourceTools cannot be opened: it is {self._state.value}")
        # Our own dict is the cookie jar (it is what the result publishes); the
        # clients' jars accept nothing so they never send a second, stale copy.
        no_cookies = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        for name in {spec.resource for spec in self._specs.values()}:
            endpoint = self._resources[name]
            transport = transport_for(endpoint.base_url, uds=endpoint.uds)
            self._clients[name] = httpx.AsyncClient(
                base_url=endpoint.base_url,
                transport=transport,
                timeout=httpx.Timeout(endpoint.timeout_s),
                headers={"X-Rollout-Id": encode_id(self._rollout_id).decode("ascii")},
                cookies=no_cookies,
                follow_redirects=False,
                trust_env=False,
            )
        self._state = _State.OPENED
        return self

    async def aclose(self) -> None:
        """Close every client; idempotent.

        **Cancellation:** closing is best effort; connections are dropped either way.
        """
        self._state = _State.CLOSED
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.aclose()

    async def call(self, name: str, arguments: dict[str, Any]) -> tuple[ToolStatus, str]:
        """Call a tool and return its status and the text the model sees.

        Args:
            name: The tool's name.
            arguments: The arguments, sent as the JSON body.

        Returns:
            ``completed`` and the response body as text (cut at
            ``max_response_bytes``); for an error status, ``failed`` and
            ``error: HTTP <status> from <name>: <body>``; for an unknown tool,
            ``failed`` and ``error: unknown tool ...``.

        Raises:
            ResourceUnavailableError: the endpoint could not be reached, did not
                answer in full within its ``timeout_s`` (or the agent's
                ``tool_timeout_s``, when shorter), answered 502/503/504, or set a
                cookie that could never be sent back (the environment's fault).
            RuntimeError: the tools are not open.

        **Cancellation:** the request is abandoned and its connection closed;
        ``CancelledError`` propagates.
        """
        if self._state is not _State.OPENED:
            raise RuntimeError(f"ResourceTools is {self._state.value}; use it inside 'async with'")
        spec = self._specs.get(name)
        if spec is None:
            return (
                "failed",
                f"error: unknown tool {name!r}; available tools: {', '.join(self._specs) or 'none'}",
            )
        endpoint = self._resources[spec.resource]
        client = self._clients[spec.resource]
        path = spec.path if spec.path is not None else f"/{name}"
        timeout_s = min(endpoint.timeout_s, self._timeout_s or endpoint.timeout_s)
        bound = "its timeout_s" if timeout_s == endpoint.timeout_s else "the agent's tool_timeout_s"
        try:
            headers = [(b"cookie", cookie_header(self._cookies))] if self._cookies else None
        except HeaderValueError as exc:
            raise ResourceUnavailableError(
                f"resource {spec.resource!r} cannot be called for {name}: {exc}"
            ) from exc
        try:
            # httpx's timeout bounds each phase; this bounds the whole call (a
            # resource trickling its answer byte by byte must not hold the rollout).
            async with asyncio.timeout(timeout_s):
                request = client.build_request("POST", path, json=arguments, headers=headers)
                response = await client.send(request, stream=True)
                try:
                    body, cut = await self._read_body(response)
                finally:
                    await response.aclose()
        except (httpx.TimeoutException, TimeoutError) as exc:
            raise ResourceUnavailableError(
                f"resource {spec.resource!r} gave no answer to {name} within {timeout_s:g} s "
                f"({bound}; {type(exc).__name__})"
            ) from exc
        except httpx.TransportError as exc:
            raise ResourceUnavailableError(
                f"resource {spec.resource!r} could not be reached for {name}: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            update_cookies(self._cookies, response.headers.raw, strict=True)
        except HeaderValueError as exc:
            # A session the next call cannot carry: the environment's fault, not the policy's.
            raise ResourceUnavailableError(
                f"resource {spec.resource!r} answered {name} with a Set-Cookie that cannot be sent back: "
                f"{exc}"
            ) from exc
        text = body.decode(response.encoding or "utf-8", "replace")
        if cut:
            text += f"…[truncated {cut} bytes]…"
        if response.status_code in _UNAVAILABLE_STATUSES:
            raise ResourceUnavailableError(
                f"resource {spec.resource!r} is unavailable for {name}: HTTP {response.status_code}: "
                f"{text[:_ERROR_BODY_CHARS]}"
            )
        if response.status_code >= 400:
            return "failed", f"error: HTTP {response.status_code} from {name}: {text[:_ERROR_BODY_CHARS]}"
        return "completed", text

    async def _read_body(self, response: httpx.Response) -> tuple[bytes, int]:
        """The body, cut at ``max_response_bytes``; returns it and how many bytes were cut."""
        chunks: list[bytes] = []
        size = 0
        cut = 0
        async for chunk in response.aiter_bytes():
            room = self._max_response_bytes - size
            if room > 0:
                chunks.append(chunk[:room])
                size += min(len(chunk), room)
            cut += max(len(chunk) - max(room, 0), 0)
        return b"".join(chunks), cut
