"""A NeMo Gym resource server on loopback that answers with odd header bytes, one behaviour per row.

Each dataset row names its behaviour in its verifier field ``mode`` (sent to ``/seed_session``
and ``/verify``). ``/seed_session`` sets a plain ``mode=<mode>`` cookie beside whatever the mode
asks for, so the tool endpoint (``POST /probe``, which sees only the agent's arguments and the
cookies) knows the mode too. Every request's raw ``Cookie`` header is logged per endpoint, so a
test can check a cookie went back byte for byte.

Modes (what the answer carries besides the mode cookie):

* ``seed-utf8``: ``Set-Cookie: lat=café`` in UTF-8 octets;
* ``seed-latin1``: ``Set-Cookie: lat=caf\\xe9`` (ISO-8859-1 octets, not UTF-8);
* ``seed-many``: several odd cookies at once (CJK, quotes, commas, high octets, an empty value);
* ``seed-bad-name``: a cookie whose name has a space (no HTTP token: it cannot be sent back);
* ``seed-too-many``: 70 cookies (more than a jar keeps);
* ``tool-utf8``: the tool's answer sets ``t=日本`` (UTF-8);
* ``tool-bad-name``: the tool's answer sets a cookie whose name has a space;
* ``tool-huge``: the tool's answer sets a 5000-byte cookie;
* ``odd-headers``: answers carry ``X-Odd`` with high octets and a nameless ``Set-Cookie``;
* ``verify-big-detail``: ``/verify`` answers a 2 MB ``detail``;
* ``tool-slow``: the tool answers after ``SLOW_TOOL_S`` (far beyond a short ``tool_timeout_s``);
* anything else: plain answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.controller._servers import AppServer

__all__ = ["SLOW_TOOL_S", "HostileEnvironment", "serve_hostile"]

SLOW_TOOL_S = 8.0


def _mode_of(request: Request) -> str:
    for pair in request.headers.get("cookie", "").split(";"):
        name, _, value = pair.strip().partition("=")
        if name == "mode":
            return value
    return ""


def _raw_cookie(request: Request) -> bytes | None:
    for name, value in request.scope["headers"]:
        if name == b"cookie":
            return bytes(value)
    return None


_SEED_COOKIES: dict[str, list[bytes]] = {
    "seed-utf8": ["lat=café".encode()],
    "seed-latin1": [b"lat=caf\xe9"],
    "seed-many": [
        "a=日本".encode(),
        b'b="quoted value"',
        b"c=x,y",
        b"d=\xff\xfe\x80",
        b"e=",
        b"f=tab\there",
    ],
    "seed-bad-name": [b"bad name=1"],
    "seed-too-many": [b"k%d=v" % i for i in range(70)],
    "odd-headers": [b"=no-name", b"plain-no-equals"],
}
_TOOL_COOKIES: dict[str, list[bytes]] = {
    "tool-utf8": ["t=日本".encode()],
    "tool-bad-name": [b"bad name=1"],
    "tool-huge": [b"h=" + b"x" * 5000],
    "odd-headers": [b"=no-name"],
}


@dataclass
class HostileEnvironment:
    """See the module docstring; ``cookies[endpoint]`` lists each request's raw ``Cookie`` header."""

    cookies: dict[str, list[bytes | None]] = field(default_factory=dict)
    verified: list[dict[str, object]] = field(default_factory=list)

    def app(self) -> Starlette:
        """The ASGI app."""

        def answer(body: object, extra: list[bytes], mode: str) -> Response:
            response = JSONResponse(body)
            for cookie in extra:
                response.raw_headers.append((b"set-cookie", cookie))
            if mode == "odd-headers":
                response.raw_headers.append((b"x-odd", b"\xff\x80 odd"))
            return response

        async def seed(request: Request) -> Response:
            self.cookies.setdefault("seed", []).append(_raw_cookie(request))
            mode = str(json.loads(await request.body()).get("mode", ""))
            return answer({}, [b"mode=" + mode.encode(), *_SEED_COOKIES.get(mode, [])], mode)

        async def probe(request: Request) -> Response:
            self.cookies.setdefault("probe", []).append(_raw_cookie(request))
            mode = _mode_of(request)
            if mode == "tool-slow":
                await asyncio.sleep(SLOW_TOOL_S)
            return answer({"ok": True, "mode": mode}, _TOOL_COOKIES.get(mode, []), mode)

        async def verify(request: Request) -> Response:
            self.cookies.setdefault("verify", []).append(_raw_cookie(request))
            body = json.loads(await request.body())
            self.verified.append(
                {"mode": body.get("mode"), "task_id": body.get("task_id"), "text": body.get("output_text")}
            )
            detail: dict[str, object] = {"mode": body.get("mode")}
            if body.get("mode") == "verify-big-detail":
                detail["essay"] = "x" * (2 * 1024 * 1024)
            return JSONResponse({"reward": 1.0, "detail": detail})

        async def close(request: Request) -> Response:
            self.cookies.setdefault("close", []).append(_raw_cookie(request))
            return JSONResponse({})

        return Starlette(
            routes=[
                Route("/seed_session", seed, methods=["POST"]),
                Route("/probe", probe, methods=["POST"]),
                Route("/verify", verify, methods=["POST"]),
                Route("/close_session", close, methods=["POST"]),
            ]
        )


@contextmanager
def serve_hostile() -> Iterator[tuple[HostileEnvironment, str]]:
    """Serve a :class:`HostileEnvironment` on loopback; stopped on leaving, however the test ends."""
    env = HostileEnvironment()
    server = AppServer(env.app(), name="hostile-env")
    url = server.start()
    try:
        yield env, url
    finally:
        server.stop()
