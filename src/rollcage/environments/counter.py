"""``nemo-counter``: a stateful counter written the NeMo Gym way (its ``example_session_state_mgmt``).

A resource server as NeMo Gym's ``SimpleResourcesServer`` shapes one, with no
NeMo Gym import:

* every request belongs to a session named by the ``nemo_counter_session`` cookie,
  which every answer sets again (as NeMo Gym's session middleware does);
* ``POST /seed_session`` takes the task's run request (``responses_create_params``
  plus verifier fields) and starts the session's counter at ``initial_count``;
* tools ``POST /increment_counter {"count": n}`` and ``POST /get_counter_value {}``;
* ``POST /verify`` takes NeMo Gym's verify request (``responses_create_params``,
  ``response``, ``expected_count``) and answers its ``BaseVerifyResponse``: the
  request echoed plus ``reward`` (1.0 when the session's counter equals
  ``expected_count``), ``mask_sample`` (true when the agent never read the
  counter: the answer was not grounded in what it observed), ``failure_kind``
  and the final ``count``;
* ``POST /close_session`` forgets the session.

A body missing a required field is answered 422 with FastAPI's error shape.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcage.environments._common import BadRequest, Sessions, json_error, read_json_object, verify_allowed

__all__ = ["COOKIE", "create_app"]

COOKIE = "nemo_counter_session"
"""Name of the session cookie."""

_MAX_SESSIONS = 10_000


@dataclass
class _Session:
    count: int = 0
    seeded: bool = False
    reads: int = 0


def _missing(field: str) -> JSONResponse:
    # FastAPI's validation error shape, as a NeMo Gym server answers it.
    detail = [{"type": "missing", "loc": ["body", field], "msg": "Field required"}]
    return JSONResponse({"detail": detail}, status_code=422)


def _int_field(body: dict[str, Any], field: str) -> int | None:
    value = body.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def create_app(*, verify_token: str | None = None) -> Starlette:
    """The counter app; ``verify_token`` guards seed, verify and close (``None``: open, as NeMo Gym's are)."""
    sessions: Sessions[_Session] = Sessions(_Session, limit=_MAX_SESSIONS)
    Handler = Callable[[Request, dict[str, Any], _Session], Awaitable[Response]]

    def endpoint(
        handler: Handler, *, controller_only: bool = False
    ) -> Callable[[Request], Awaitable[Response]]:
        async def serve(request: Request) -> Response:
            if controller_only and not verify_allowed(request, verify_token):
                return json_error(403, "this endpoint is for the controller only")
            try:
                body = await read_json_object(request)
            except BadRequest as exc:
                return json_error(400, str(exc))
            key, session, _ = sessions.find_or_open(request.cookies.get(COOKIE))
            response = await handler(request, body, session)
            response.set_cookie(COOKIE, key, httponly=True, samesite="lax")
            return response

        return serve

    async def seed_session(request: Request, body: dict[str, Any], session: _Session) -> Response:
        if not isinstance(body.get("responses_create_params"), dict):
            return _missing("responses_create_params")
        session.count = _int_field(body, "initial_count") or 0
        session.seeded = True
        return JSONResponse({})

    async def increment_counter(request: Request, body: dict[str, Any], session: _Session) -> Response:
        count = _int_field(body, "count")
        if count is None:
            return _missing("count")
        session.count += count
        return JSONResponse({"success": True})

    async def get_counter_value(request: Request, body: dict[str, Any], session: _Session) -> Response:
        session.reads += 1
        return JSONResponse({"count": session.count})

    async def verify(request: Request, body: dict[str, Any], session: _Session) -> Response:
        for field in ("responses_create_params", "response"):
            if not isinstance(body.get(field), dict):
                return _missing(field)
        expected = _int_field(body, "expected_count")
        if expected is None:
            return _missing("expected_count")
        reward = 1.0 if session.seeded and session.count == expected else 0.0
        masked = session.reads == 0
        kind = "never_read" if masked else (None if reward == 1.0 else "wrong_count")
        answer = {
            **body,
            "reward": reward,
            "mask_sample": masked,
            "failure_kind": kind,
            "count": session.count,
        }
        return JSONResponse(answer)

    async def close_session(request: Request, body: dict[str, Any], session: _Session) -> Response:
        sessions.close(request.cookies.get(COOKIE))
        return JSONResponse({})

    return Starlette(
        routes=[
            Route("/seed_session", endpoint(seed_session, controller_only=True), methods=["POST"]),
            Route("/increment_counter", endpoint(increment_counter), methods=["POST"]),
            Route("/get_counter_value", endpoint(get_counter_value), methods=["POST"]),
            Route("/verify", endpoint(verify, controller_only=True), methods=["POST"]),
            Route("/close_session", endpoint(close_session, controller_only=True), methods=["POST"]),
        ]
    )
