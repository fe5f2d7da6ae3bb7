"""A black-box harness's model calls, read off the wire: one record, whoever saw the exchange.

A harness (NOOA, a command-line agent) calls the model itself, over plain HTTP.
Two parties see each exchange: the worker's loopback forwarder inside the sandbox
(for ``result.json``) and the supervisor's egress proxy outside it (for the
journal, from ``model_capture.jsonl``). Both turn an exchange into the same
``ModelCall`` here, with the tool calls the response asks for as pending
``ToolCall`` records named as the builtin loop names them (``call_<index>_<k>``),
so the journal and the result agree on every id.

A model call is a ``POST`` to ``/chat/completions`` or ``/responses`` below the
model route; anything else (``GET /models``) is traffic, not a call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from rollcage.agent import own_call_ids
from rollcage.model import ServerEventError, WireError, assemble_stream, parse_payload, sse_events, sse_lines
from rollcage.protocol import MAX_JSON_DEPTH, ModelCall, RunnerError, ToolCall, json_problem

__all__ = ["Api", "WireExchange", "model_call", "model_call_api", "requested_tool_calls"]

Api = Literal["chat", "responses"]

_CALL_PATHS: dict[str, Api] = {"/chat/completions": "chat", "/responses": "responses"}
_RAW_REQUEST_CHARS = 65_536
_ERROR_SNIPPET = 500
# The model client's table (rollcage.model): a request the server rejects is the policy's; everything
# else that is not an answer (credentials, a missing endpoint, overload, a broken body) the infrastructure's.
_FATAL_STATUSES = frozenset({400, 413, 422})


def model_call_api(method: str, path: str) -> Api | None:
    """The API style when ``method path`` is a model call, else ``None``.

    Args:
        method: The HTTP method.
        path: The path below the model route's ``/v1`` (``/chat/completions``); a query is ignored.
    """
    if method != "POST":
        return None
    return _CALL_PATHS.get(path.partition("?")[0].rstrip("/"))


@dataclass(frozen=True)
class WireExchange:
    """One model exchange as it crossed the wire.

    Attributes:
        api: The API style (from the path).
        request: The request body.
        status: The response status; ``None`` when no response came.
        content_type: The response's content type.
        response: The response body; ``None`` when it was not kept whole (larger than the capture keeps).
        started_at: Unix time the request arrived.
        first_byte_at: Unix time of the first response byte.
        ended_at: Unix time the exchange ended.
        error: Why the exchange did not end normally (upstream unreachable, cut off), if it did not.
    """

    api: Api
    request: bytes
    status: int | None
    content_type: str | None
    response: bytes | None
    started_at: float
    first_byte_at: float | None
    ended_at: float
    error: str | None = None


async def model_call(index: int, exchange: WireExchange) -> tuple[ModelCall, list[str | None]]:
    """The ``ModelCall`` an exchange was, with its function calls renamed ``call_<index>_<k>``.

    A non-2xx answer, an answer that cannot be read, or none at all is a ``failed``
    call whose error says whose fault it was (400/413/422: ``fatal``, the policy's
    request; anything else: ``transient``). Never raises for anything the wire holds.

    Returns:
        The call, and the server's ids of its function calls in order (``None`` where it gave none).

    **Cancellation:** safe; nothing is kept.
    """
    request = _request_payload(exchange.request)
    base: dict[str, Any] = {
        "index": index,
        "api": exchange.api,
        "request": request,
        "http_status": exchange.status,
        "started_at": exchange.started_at,
        "first_byte_at": exchange.first_byte_at,
        "ended_at": exchange.ended_at,
    }
    status, body = exchange.status, exchange.response
    if status is None:
        return _failed(base, None, "transient", f"no answer: {exchange.error or 'the exchange ended early'}")
    if not 200 <= status < 300:
        kind: Literal["transient", "fatal"] = "fatal" if status in _FATAL_STATUSES else "transient"
        return _failed(base, None, kind, f"HTTP {status}: {_snippet(body)}")
    if exchange.error is not None:
        return _failed(base, None, "transient", f"the answer was cut off: {exchange.error}")
    if body is None:
        return _failed(
            base, None, "transient", "the answer was larger than the capture keeps (see model_capture.jsonl)"
        )
    try:
        payload = await _payload(exchange.api, body, exchange.content_type)
        problem = json_problem(payload, max_depth=MAX_JSON_DEPTH)
        if problem is not None:
            raise WireError(f"the answer cannot be kept: {problem}")
        error = payload.get("error")
        if isinstance(error, dict) and not {"choices", "output"} & payload.keys():
            return _failed(
                base, payload, "transient", f"the server answered with an error: {_snippet(error)}"
            )
        outcome = parse_payload(exchange.api, payload)
    except ServerEventError as exc:
        return _failed(base, None, "transient", f"the server reported an error in the stream: {exc}")
    except (WireError, ValueError) as exc:
        return _failed(base, None, "transient", f"malformed response from the server: {exc}")
    if outcome.status == "failed":
        message = f"the response failed: {outcome.error_code or 'no code'}: {outcome.error_message or ''}"
        return _failed(base, payload, "transient", message)
    call = ModelCall(
        **base,
        response=payload,
        status=outcome.status,
        incomplete_reason=outcome.incomplete_reason,
        output=outcome.output,
        usage=outcome.usage,
    )
    return own_call_ids(call)


def requested_tool_calls(call: ModelCall, server_ids: list[str | None]) -> list[ToolCall]:
    """The calls ``call`` asks for, as pending records a harness will (or will not) report on.

    Args:
        call: A model call with its own ids (see :func:`model_call`).
        server_ids: The server's ids of its function calls, in order.
    """
    items = [item for item in call.output if item.get("type") == "function_call"]
    return [
        ToolCall(
            call_id=str(item.get("call_id")),
            server_call_id=server_id,
            name=str(item.get("name", "")),
            arguments=str(item.get("arguments", "")),
            turn=call.index,
            status="pending",
            started_at=call.ended_at,
            reported_by="harness",
        )
        for item, server_id in zip(items, server_ids, strict=False)
    ]


def _failed(
    base: dict[str, Any], response: dict[str, Any] | None, kind: Literal["transient", "fatal"], message: str
) -> tuple[ModelCall, list[str | None]]:
    call = ModelCall(
        **base,
        response=response,
        status="failed",
        error=RunnerError(kind=kind, type="HarnessModelCall", message=message),
    )
    return call, []


def _request_payload(body: bytes) -> dict[str, Any]:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and json_problem(value, max_depth=MAX_JSON_DEPTH) is None:
        return value
    # Not a JSON object (or one that cannot be kept): the evidence is its text, as far as it goes.
    return {"unparsed": body[:_RAW_REQUEST_CHARS].decode("utf-8", "replace")}


async def _payload(api: Api, body: bytes, content_type: str | None) -> dict[str, Any]:
    if content_type is not None and "text/event-stream" in content_type:
        assembled = await assemble_stream(api, sse_events(sse_lines(_once(body))))
        return assembled.payload
    value = orjson.loads(body)
    if not isinstance(value, dict):
        raise WireError(f"the answer is a JSON {type(value).__name__}, not an object")
    return value


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


def _snippet(value: object) -> str:
    if isinstance(value, bytes | bytearray):
        text = bytes(value[:_ERROR_SNIPPET]).decode("utf-8", "replace")
    elif value is None:
        text = ""
    else:
        text = str(value)[:_ERROR_SNIPPET]
    return " ".join(text.split()) or "(no body)"
