"""What every bundled environment shares: JSON bodies, errors and the ``/verify`` guard."""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

__all__ = ["BadRequest", "json_error", "read_json_object", "verify_allowed"]

_MAX_BODY = 4 * 1024 * 1024


class BadRequest(Exception):
    """The request body is unusable; answered with 400 and the message."""


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's JSON object body.

    Raises:
        BadRequest: The body is too large, not JSON, or not an object.
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
