"""``calc-weather``: a stateful weather resource, with calculation left to the Python tool.

Tools: ``POST /get_weather {"city": ...}`` and ``POST /set_units {"units": "C"|"F"}``.
State is per session, named by a ``cw_session`` cookie: the controller's
``POST /seed_session`` opens one (a tool call without a session opens one too), the
units chosen and the cities looked up belong to it, ``POST /verify`` reads it from
the ``Cookie`` header, and ``POST /close_session`` drops it. ``/verify`` compares
the final answer (e.g. ``cold;sum=42``) with the row's ``expected``, ignoring case
and whitespace, and reports the session's lookups as detail. The three session
and grading endpoints answer only the controller (its bearer token).
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.environments._common import BadRequest, json_error, read_json_object, verify_allowed

__all__ = ["COOKIE", "WEATHER", "condition_of", "create_app", "normalise_answer"]

COOKIE = "cw_session"
"""Name of the session cookie."""

WEATHER: dict[str, int] = {
    "oslo": 3,
    "reykjavik": -2,
    "london": 14,
    "paris": 17,
    "cairo": 31,
    "lagos": 29,
    "tokyo": 21,
    "lima": 19,
}
"""Temperatures in °C by lower-case city name (fixed, so rollouts are reproducible)."""

_MAX_SESSIONS = 10_000


def condition_of(celsius: int) -> str:
    """``cold`` below 10 °C, ``hot`` from 25 °C, ``mild`` between."""
    if celsius < 10:
        return "cold"
    if celsius >= 25:
        return "hot"
    return "mild"


def normalise_answer(text: str) -> str:
    """Lower case, no whitespace: ``' Cold; sum = 42 '`` → ``'cold;sum=42'``."""
    return "".join(text.split()).lower()


@dataclass
class _Session:
    units: str = "C"
    lookups: list[str] = field(default_factory=list)


def create_app(*, verify_token: str | None = None) -> Starlette:
    """The calc-weather app; ``verify_token`` guards ``/verify`` (see ``rollcage.environments``)."""
    # Bounded so a long run (or a hostile agent creating sessions) cannot grow it without limit.
    sessions: OrderedDict[str, _Session] = OrderedDict()

    def session_of(request: Request) -> tuple[str, _Session, bool]:
        key = request.cookies.get(COOKIE)
        if key is not None and key in sessions:
            sessions.move_to_end(key)
            return key, sessions[key], False
        key = secrets.token_hex(16)
        sessions[key] = _Session()
        while len(sessions) > _MAX_SESSIONS:
            sessions.popitem(last=False)
        return key, sessions[key], True

    def answer(body: dict[str, object], key: str, new: bool) -> Response:
        response = JSONResponse(body)
        if new:
            response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
        return response

    async def get_weather(request: Request) -> Response:
        try:
            args = await read_json_object(request)
        except BadRequest as exc:
            return json_error(400, str(exc))
        city = args.get("city")
        if not isinstance(city, str) or not city.strip():
            return json_error(400, "get_weather needs {'city': <name>}")
        key, session, new = session_of(request)
        celsius = WEATHER.get(city.strip().lower())
        if celsius is None:
            return json_error(404, f"no weather for {city!r}; known: {', '.join(sorted(WEATHER))}")
        session.lookups.append(city.strip().lower())
        temperature = celsius if session.units == "C" else round(celsius * 9 / 5 + 32)
        body: dict[str, object] = {
            "city": city.strip(),
            "temperature": temperature,
            "units": session.units,
            "condition": condition_of(celsius),
        }
        return answer(body, key, new)

    async def set_units(request: Request) -> Response:
        try:
            args = await read_json_object(request)
        except BadRequest as exc:
            return json_error(400, str(exc))
        units = args.get("units")
        if units not in ("C", "F"):
            return json_error(400, "set_units needs {'units': 'C' | 'F'}")
        key, session, new = session_of(request)
        session.units = str(units)
        return answer({"units": session.units}, key, new)

    async def seed_session(request: Request) -> Response:
        if not verify_allowed(request, verify_token):
            return json_error(403, "seed_session is for the controller only")
        key = secrets.token_hex(16)
        sessions[key] = _Session()
        while len(sessions) > _MAX_SESSIONS:
            sessions.popitem(last=False)
        return answer({}, key, True)

    async def close_session(request: Request) -> Response:
        if not verify_allowed(request, verify_token):
            return json_error(403, "close_session is for the controller only")
        key = request.cookies.get(COOKIE)
        if key is not None:
            sessions.pop(key, None)
        return JSONResponse({})

    async def verify(request: Request) -> Response:
        if not verify_allowed(request, verify_token):
            return json_error(403, "verify is for the controller only")
        try:
            body = await read_json_object(request)
        except BadRequest as exc:
            return json_error(400, str(exc))
        expected = body.get("expected")
        if not isinstance(expected, str):
            return json_error(400, "calc-weather rows need a string 'expected', e.g. 'cold;sum=42'")
        output_text = body.get("output_text")
        given = output_text if isinstance(output_text, str) else ""
        match = normalise_answer(given) == normalise_answer(expected)
        key = request.cookies.get(COOKIE)
        session = sessions.get(key) if key is not None else None
        detail = {
            "match": match,
            "answer": given[:200],
            "lookups": list(session.lookups) if session is not None else [],
        }
        return JSONResponse({"reward": 1.0 if match else 0.0, "detail": detail})

    async def index(request: Request) -> Response:
        return JSONResponse({"environment": "calc-weather", "tools": ["get_weather", "set_units"]})

    return Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/get_weather", get_weather, methods=["POST"]),
            Route("/set_units", set_units, methods=["POST"]),
            Route("/seed_session", seed_session, methods=["POST"]),
            Route("/verify", verify, methods=["POST"]),
            Route("/close_session", close_session, methods=["POST"]),
        ]
    )
