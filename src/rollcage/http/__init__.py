"""HTTP/1.1 for rollcage: the client transport every HTTP client of the worker sends through.

A low room (it imports nothing of rollcage): the model client, the resource tools,
the harness's forwarder and the egress proxy send through :class:`H11Transport`
(plain HTTP) or httpx's own (HTTPS), chosen by :func:`transport_for`. ``httpx``
is imported from here, without its command line.
"""

from __future__ import annotations

from rollcage.http._client import H11Transport, exchange_in_memory
from rollcage.http._httpx import httpx
from rollcage.http._transport import HOP_BY_HOP, DirectSend, hop_by_hop, transport_for

__all__ = [
    "HOP_BY_HOP",
    "DirectSend",
    "H11Transport",
    "exchange_in_memory",
    "hop_by_hop",
    "httpx",
    "transport_for",
]
