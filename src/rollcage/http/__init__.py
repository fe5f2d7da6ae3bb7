"""HTTP/1.1 for rollcage: one server loop, one client transport, one rule for ``max_policy_calls``.

A low room (it imports nothing of rollcage but the cancellation dialect): the
egress proxy and the harness's forwarder serve through :class:`HttpServer`
(every bound and timeout in one place, see :mod:`rollcage.http._server`); the
model client, the resource tools, the forwarder and the proxy send through
:class:`H11Transport` (plain HTTP) or httpx's own (HTTPS), chosen by
:func:`transport_for`; :class:`PolicyCalls` counts and refuses model calls
for every agent. ``httpx`` is imported from here, without its command line.
"""

from __future__ import annotations

from rollcage.http._calls import (
    BUDGET_CODE,
    REFUSAL_STATUS,
    Api,
    PolicyCalls,
    budget_refusal,
    model_call_api,
)
from rollcage.http._client import H11Transport, exchange_in_memory
from rollcage.http._httpx import httpx
from rollcage.http._server import ABORTED, Answer, Exchange, HttpServer, Reply, ServerLimits, Service
from rollcage.http._transport import HOP_BY_HOP, DirectSend, hop_by_hop, transport_for

__all__ = [
    "ABORTED",
    "BUDGET_CODE",
    "HOP_BY_HOP",
    "REFUSAL_STATUS",
    "Answer",
    "Api",
    "DirectSend",
    "Exchange",
    "H11Transport",
    "HttpServer",
    "PolicyCalls",
    "Reply",
    "ServerLimits",
    "Service",
    "budget_refusal",
    "exchange_in_memory",
    "hop_by_hop",
    "httpx",
    "model_call_api",
    "transport_for",
]
