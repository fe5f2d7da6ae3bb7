"""What every bundled environment shares: JSON bodies, errors, the ``/verify`` guard, session state."""

from __future__ import annotations

import hmac
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

__all__ = ["BadRequest", "Sessions", "json_error", "read_json_object", "verify_allowed"]

_MAX_BODY = 4 * 1024 * 1024
_S = TypeVar("_S")


class BadRequest(Exception):
    """The request body is unusable; answered with 400 and the message."""


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object body.

    Raises:
        BadRequest: The body is too large, not JSON, or not an object.

    **Cancellation:** the body is no longer read (the request is being abandoned anyway).
    """
    body = await request.body()
    if len(body) > _MAX_BODY:
        raise BadRequest(f"body of {len(body)} bytes is over the {_MAX_BODY} byte limit")
    try:
        value = json.loads(body or b"{}")
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest("body must be a JSON object of the tool's arguments")
    return value


def json_error(status: int, message: str) -> JSONResponse:
    """A JSON error answer the worker shows to the model as the tool's output."""
    return JSONResponse({"error": message}, status_code=status)


def verify_allowed(request: Request, token: str | None) -> bool:
    """Whether the request carries the controller's bearer token (always true without one)."""
    if token is None:
        return True
    given = request.headers.get("authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())


class Sessions(Generic[_S]):
    """Per-session state, named by a random key (a cookie's value), the least recently used dropped first.

    Bounded, so a long run (or a hostile agent opening sessions) cannot grow it without limit.
    """

    def __init__(self, make: Callable[[], _S], *, limit: int = 10_000) -> None:
        """Make new state with ``make``; keep at most ``limit`` sessions."""
        self._make = make
        self._limit = limit
        self._states: OrderedDict[str, _S] = OrderedDict()

    def get(self, key: str | None) -> _S | None:
        """The session's state, if ``key`` names one."""
        return None if key is None else self._states.get(key)

    def open(self) -> tuple[str, _S]:
        """A new session: its key and its state."""
        key = secrets.token_hex(16)
        state = self._states[key] = self._make()
        while len(self._states) > self._limit:
            self._states.popitem(last=False)
        return key, state

    def find_or_open(self, key: str | None) -> tuple[str, _S, bool]:
        """The session ``key`` names (now the most recently used), else a new one; whether it is new."""
        if key is not None and key in self._states:
            self._states.move_to_end(key)
            return key, self._states[key], False
        return (*self.open(), True)

    def close(self, key: str | None) -> None:
        """Forget the session (nothing happens if ``key`` names none)."""
        if key is not None:
            self._states.pop(key, None)
