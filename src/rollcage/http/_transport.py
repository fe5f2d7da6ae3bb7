"""The transport to an endpoint, and what a proxy drops of a message's headers: for every HTTP client
that runs in the worker (the model client, the resource tools in ``rollcage.tools``), the harness's
forwarder and the egress proxy.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rollcage.http._client import H11Transport
from rollcage.http._httpx import httpx

__all__ = ["HOP_BY_HOP", "DirectSend", "hop_by_hop", "transport_for"]


def transport_for(base_url: str, *, uds: str | None, retries: int = 0) -> httpx.AsyncBaseTransport:
    """A transport for ``base_url``, over ``uds`` when set.

    Plain HTTP (what the worker, its resource tools and a harness's forwarder see behind the egress
    proxy, on a Unix socket) goes through :class:`H11Transport`, half the CPU a request of httpx's
    own. HTTPS is httpx's transport (building a verifying one loads the CA bundle: about 50 ms per
    process).
    """
    plain = httpx.URL(base_url).scheme == "http"
    if plain and retries == 0:
        return H11Transport(uds=uds)
    return httpx.AsyncHTTPTransport(uds=uds, retries=retries, verify=not plain)


class DirectSend:
    """An ``httpx.AsyncClient``'s requests, handed to its transport without the client's request path.

    For every request the client merges its URL, its cookies (through urllib's cookie jar)
    and its headers again, then stores the answer's cookies the same way: about as much CPU
    again as :class:`H11Transport`'s whole exchange, for callers that keep no cookies in
    httpx (the model client keeps them itself; the egress proxy forwards the sandbox's, and
    must add none of its own). What the client adds that
    matters is added here: its default headers (under the request's own), its timeouts,
    and the request on the response. Redirects are not followed; nothing comes from the
    environment.

    Args:
        client: The client whose defaults apply (it owns the transport's life).
        transport: The client's transport.
    """

    def __init__(self, client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport) -> None:
        self._client = client
        self._headers = client.headers
        self._timeouts = client.timeout.as_dict()
        self._send = transport.handle_async_request

    async def aclose(self) -> None:
        """Close the client, and so its transport.

        **Cancellation:** as the client's ``aclose``.
        """
        await self._client.aclose()

    async def __call__(
        self,
        method: str,
        url: httpx.URL | str,
        *,
        headers: httpx.Headers | Sequence[tuple[bytes, bytes]] | Mapping[str, str],
        content: bytes,
    ) -> httpx.Response:
        """Send one request; the response's body is still to be read (and the response closed).

        **Cancellation:** as the transport's (:class:`H11Transport` closes the connection in use).

        Raises:
            httpx.HTTPError: As the transport raises it, or the URL is invalid.
        """
        merged = httpx.Headers(self._headers)
        merged.update(headers)
        extensions = {"timeout": self._timeouts}
        request = httpx.Request(method, url, headers=merged, content=content, extensions=extensions)
        response = await self._send(request)
        response.request = request
        return response


HOP_BY_HOP: frozenset[bytes] = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
"""Header names (lower case) about one connection only: a proxy never forwards them (RFC 9110 7.6.1)."""


def hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The hop-by-hop header names of ``headers``: the standard ones and those its ``Connection`` names."""
    names = set(HOP_BY_HOP)
    for key, value in headers:
        if key.lower() == b"connection":
            names.update(token.strip().lower() for token in value.split(b","))
    return names
