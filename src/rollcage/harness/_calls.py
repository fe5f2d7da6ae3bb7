"""A black-box harness's model calls, read off the wire: one record, whoever saw the exchange.

A harness (NOOA, a command-line agent) calls the model itself, over plain HTTP.
Two parties see each exchange: the worker's loopback forwarder inside the sandbox
(for ``result.json``) and the supervisor's egress proxy outside it (for the
journal, from ``model_capture.jsonl``). Both turn an exchange into the same
``ModelCall`` here, with the tool calls the response asks for as pending
``ToolCall`` records named as the builtin loop names them (``call_<index>_<k>``),
so the journal and the result agree on every id.

Each call is recorded as the builtin loop records its own: an id
(``<rollout_id>:m<index>``), its one HTTP attempt (status and timings from the
wire), the token ids and log probabilities the server returned (read by the
model client's parser, lifted out of the kept response), and, for a chat call,
its messages read back as Responses items. A harness's turns are not visible
from outside, so every model call is one turn (``<rollout_id>:t<index>``) whose
question is what the request added to the conversation since the previous call
(:class:`WireCalls`).

A model call is a ``POST`` to ``/chat/completions`` or ``/responses`` below the
model route; anything else (``GET /models``) is traffic, not a call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import orjson

from rollcage.errors import ModelEndpointNotFoundError
from rollcage.http import Api, model_call_api
from rollcage.protocol import (
    MAX_JSON_DEPTH,
    CallAttempt,
    ModelCall,
    ResponseItem,
    RunnerError,
    ToolCall,
    TurnStart,
    json_problem,
    kept_body,
)
from rollcage.trajectory import INTERRUPTED
from rollcage.wire import (
    ServerEventError,
    WireError,
    assemble_stream,
    chat_input_items,
    own_call_ids,
    parse_payload,
    sse_events,
    sse_lines,
    without_lifted,
)

__all__ = [
    "Api",
    "WireCall",
    "WireCalls",
    "WireExchange",
    "model_call",
    "model_call_api",
    "requested_tool_calls",
]

_RAW_REQUEST_CHARS = 65_536
_ERROR_SNIPPET = 500
# The model client's table (rollcage.model): a request the server rejects is the policy's; everything
# else that is not an answer (credentials, a missing endpoint, overload, a broken body) the infrastructure's.
_FATAL_STATUSES = frozenset({400, 413, 422})
_HARNESS_CALL = "HarnessModelCall"
"""The error type of a harness's failed model call (the worker did not make it, so no client raised)."""


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
        interrupted: The rollout stopped while the exchange was in flight.
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
    interrupted: bool = False


class WireCall(NamedTuple):
    """One model exchange as evidence: the turn it is, the call, and the tool calls it asks for (pending)."""

    turn: TurnStart
    call: ModelCall
    tools: list[ToolCall]


class WireCalls:
    """Numbers a harness's model calls and gives each its turn, the same way on both sides of the sandbox.

    The worker (from its forwarder) and the supervisor (from the capture) each keep
    one and feed it the same exchanges in the same order, so the journal and the
    result agree on every id, turn and question.

    Args:
        rollout_id: The rollout the ids are made of.
    """

    def __init__(self, rollout_id: str) -> None:
        self._rollout_id = rollout_id
        self._count = 0
        self._asked: list[ResponseItem] | None = None

    @property
    def count(self) -> int:
        """Model calls numbered so far."""
        return self._count

    async def next(self, exchange: WireExchange) -> WireCall:
        """The next call's evidence (see :func:`model_call` for how the wire is read; never raises for it).

        **Cancellation:** safe; the call is not numbered.
        """
        index = self._count
        call, server_ids = await model_call(index, exchange, rollout_id=self._rollout_id)
        asked = _asked_items(call)
        start = TurnStart(
            index=index,
            id=f"{self._rollout_id}:t{index}",
            model_call_id=call.id,
            started_at=call.started_at,
            input=_question(self._asked, asked),
        )
        self._count += 1
        self._asked = asked
        return WireCall(start, call, requested_tool_calls(call, server_ids))


def _asked_items(call: ModelCall) -> list[ResponseItem]:
    """The conversation a call sent, as Responses items (a Responses text input: one user message)."""
    text = call.request.get("input")
    if call.api == "responses" and isinstance(text, str):
        return [{"type": "message", "role": "user", "content": text}]
    return call.input_items()


def _question(before: list[ResponseItem] | None, asked: list[ResponseItem]) -> list[ResponseItem]:
    """What a call added to the conversation since the previous one: past their common part, less the echo
    of the previous answer (a harness that rewrote its history asks everything anew)."""
    if before is None:
        return list(asked)
    keep = 0
    for old, new in zip(before, asked, strict=False):
        if old != new:
            break
        keep += 1
    rest = asked[keep:]
    while rest and _is_model_item(rest[0]):
        rest = rest[1:]
    return list(rest)


def _is_model_item(item: ResponseItem) -> bool:
    kind = item.get("type", "message")
    return kind in ("function_call", "reasoning") or (kind == "message" and item.get("role") == "assistant")


async def model_call(
    index: int, exchange: WireExchange, *, rollout_id: str
) -> tuple[ModelCall, list[str | None]]:
    """The ``ModelCall`` an exchange was, with its function calls renamed ``call_<index>_<k>``.

    A non-2xx answer, an answer that cannot be read, or none at all is a ``failed``
    call whose error says whose fault it was (400/413/422: ``fatal``, the policy's
    request; anything else: ``transient``); one in flight when the rollout stopped is
    ``incomplete`` (``interrupted``). Its one attempt carries the wire's status and
    timings; its token data is what the server returned. Never raises for anything the
    wire holds.

    Returns:
        The call, and the server's ids of its function calls in order (``None`` where it gave none).

    **Cancellation:** safe; nothing is kept.
    """
    request = _request_payload(exchange.request)
    attempt = CallAttempt(
        index=0,
        status="completed",
        http_status=exchange.status,
        started_at=exchange.started_at,
        first_byte_at=exchange.first_byte_at,
        ended_at=exchange.ended_at,
    )
    base: dict[str, Any] = {
        "id": f"{rollout_id}:m{index}",
        "index": index,
        "turn": index,
        "api": exchange.api,
        "request": request,
        "input": chat_input_items(request.get("messages")) if exchange.api == "chat" else None,
        "http_status": exchange.status,
        "attempts": [attempt],
        "started_at": exchange.started_at,
        "first_byte_at": exchange.first_byte_at,
        "ended_at": exchange.ended_at,
    }
    status, body = exchange.status, exchange.response
    if exchange.interrupted:
        base["attempts"] = [attempt.model_copy(update={"status": "incomplete"})]
        return ModelCall(**base, status="incomplete", incomplete_reason=INTERRUPTED), []
    if status is None:
        return _failed(
            base, None, "transient", f"no answer: {exchange.error or 'the exchange ended early'}", body=body
        )
    if not 200 <= status < 300:
        kind: Literal["transient", "fatal"] = "fatal" if status in _FATAL_STATUSES else "transient"
        # A 404 is the endpoint having no such route or model: final for the run, as for the builtin loop.
        error_type = ModelEndpointNotFoundError.__name__ if status == 404 else _HARNESS_CALL
        return _failed(base, None, kind, f"HTTP {status}: {_snippet(body)}", body=body, error_type=error_type)
    if exchange.error is not None:
        return _failed(base, None, "transient", f"the answer was cut off: {exchange.error}", body=body)
    if body is None:
        return _failed(
            base,
            None,
            "transient",
            "the answer was larger than the capture keeps (see model_capture.jsonl)",
            body=body,
        )
    try:
        payload = await _payload(exchange.api, body, exchange.content_type)
        problem = json_problem(payload, max_depth=MAX_JSON_DEPTH)
        if problem is not None:
            raise WireError(f"the answer cannot be kept: {problem}")
        error = payload.get("error")
        if isinstance(error, dict) and not {"choices", "output"} & payload.keys():
            return _failed(
                base,
                payload,
                "transient",
                f"the server answered with an error: {_snippet(error)}",
                body=body,
            )
        outcome = parse_payload(exchange.api, payload)
    except ServerEventError as exc:
        return _failed(
            base, None, "transient", f"the server reported an error in the stream: {exc}", body=body
        )
    except (WireError, ValueError) as exc:
        return _failed(base, None, "transient", f"malformed response from the server: {exc}", body=body)
    if outcome.status == "failed":
        message = f"the response failed: {outcome.error_code or 'no code'}: {outcome.error_message or ''}"
        return _failed(base, payload, "transient", message, body=body)
    call = ModelCall(
        **base,
        response=without_lifted(exchange.api, payload),
        status=outcome.status,
        incomplete_reason=outcome.incomplete_reason,
        output=outcome.output,
        usage=outcome.usage,
        tokens=outcome.tokens,
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
            turn=call.turn,
            status="pending",
            started_at=call.ended_at,
            reported_by="harness",
        )
        for item, server_id in zip(items, server_ids, strict=False)
    ]


def _failed(
    base: dict[str, Any],
    response: dict[str, Any] | None,
    kind: Literal["transient", "fatal"],
    message: str,
    *,
    body: bytes | None,
    error_type: str = _HARNESS_CALL,
) -> tuple[ModelCall, list[str | None]]:
    error = RunnerError(kind=kind, type=error_type, message=message)
    kept, truncated = kept_body(body)
    update = {"status": "failed", "error": error, "response_body": kept, "response_body_truncated": truncated}
    attempt = base["attempts"][0].model_copy(update=update)
    call = ModelCall(**{**base, "attempts": [attempt]}, response=response, status="failed", error=error)
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
