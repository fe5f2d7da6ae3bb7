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

from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.environments._common import BadRequest, Sessions, json_error, read_json_object, verify_allowed

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
    app = _CalcWeather(verify_token)
    return Starlette(
        routes=[
            Route("/", app.index, methods=["GET"]),
            Route("/get_weather", app.get_weather, methods=["POST"]),
            Route("/set_units", app.set_units, methods=["POST"]),
            Route("/seed_session", app.seed_session, methods=["POST"]),
            Route("/verify", app.verify, methods=["POST"]),
            Route("/close_session", app.close_session, methods=["POST"]),
        ]
    )


class _CalcWeather:
    """The endpoints, over one app's sessions."""

    def __init__(self, verify_token: str | None) -> None:
        self.verify_token = verify_token
        self.sessions: Sessions[_Session] = Sessions(_Session, limit=_MAX_SESSIONS)

    async def index(self, request: Request) -> Response:
        return JSONResponse({"environment": "calc-weather", "tools": ["get_weather", "set_units"]})

    async def get_weather(self, request: Request) -> Response:
        try:
            args = await read_json_object(request)
        except BadRequest as exc:
            return json_error(400, str(exc))
        city = args.get("city")
        if not isinstance(city, str) or not city.strip():
            return json_error(400, "get_weather needs {'city': <name>}")
        key, session, new = self.sessions.find_or_open(request.cookies.get(COOKIE))
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
        return _answer(body, key, new)

    async def set_units(self, request: Request) -> Response:
        try:
            args = await read_json_object(request)
        except BadRequest as exc:
            return json_error(400, str(exc))
        units = args.get("units")
        if units not in ("C", "F"):
            return json_error(400, "set_units needs {'units': 'C' | 'F'}")
        key, session, new = self.sessions.find_or_open(request.cookies.get(COOKIE))
        session.units = str(units)
        return _answer({"units": session.units}, key, new)

    async def seed_session(self, request: Request) -> Response:
        if not verify_allowed(request, self.verify_token):
            return json_error(403, "seed_session is for the controller only")
        key, _ = self.sessions.open()
        return _answer({}, key, True)

    async def close_session(self, request: Request) -> Response:
        if not verify_allowed(request, self.verify_token):
            return json_error(403, "close_session is for the controller only")
        self.sessions.close(request.cookies.get(COOKIE))
        return JSONResponse({})

    async def verify(self, request: Request) -> Response:
        if not verify_allowed(request, self.verify_token):
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
        session = self.sessions.get(request.cookies.get(COOKIE))
        detail = {
            "match": match,
            "answer": given[:200],
            "lookups": list(session.lookups) if session is not None else [],
        }
        return JSONResponse({"reward": 1.0 if match else 0.0, "detail": detail})


def _answer(body: dict[str, object], key: str, new: bool) -> Response:
    response = JSONResponse(body)
    if new:
        response.set_cookie(COOKIE, key, httponly=True, samesite="strict")
    return response
