"""The ASGI app of the scripted policy: routes, stateless turn selection, fault injection and logs."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import Field
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rollcage.headers import decode_id
from rollcage.policy._faults import CONTENT_FAULTS, WIRE_FAULTS, FaultPlan, FaultRecord, FaultRule, RequestKey
from rollcage.policy._hostile import hostile_body, hostile_events, trickled
from rollcage.policy._render import (
    TokenAsk,
    chat_body,
    chat_events,
    prompt_token_ids,
    reply_for,
    responses_body,
    responses_events,
    with_fault,
)
from rollcage.policy._script import PolicyScript
from rollcage.procs import first_of

__all__ = ["PolicyApp", "PolicyState", "RequestRecord", "count_model_turns", "find_task_marker"]

_TASK_MARKER = re.compile(r"\[task:([^\]\s]+)\]")
_TRANSPORT_KEY = "rollcage.transport"


class RequestRecord(RequestKey):
    """One model request the server answered (or failed on purpose)."""

    fault: str | None = Field(default=None, description="The injected fault's kind, if any.")
    at: float = Field(description="Unix time the request arrived.")
    body: dict[str, Any] | None = Field(
        default=None, description="The request's JSON body, when the server keeps bodies (tests); else None."
    )


class PolicyState:
    """What the server counts and logs; safe to read from any thread while the server runs.

    Args:
        fault_log: Append every injected fault as a JSON line here; None: memory only.
        keep_bodies: Keep each request's body in its record (memory grows with traffic: tests only).
        log_limit: Keep only the latest this many request records; None: all. The total count
            stays exact; a per-rollout wait then sees only the kept records. A long run on the
            embedded policy would otherwise grow with every request.
    """

    def __init__(
        self,
        fault_log: str | os.PathLike[str] | None = None,
        *,
        keep_bodies: bool = False,
        log_limit: int | None = None,
    ) -> None:
        self.keep_bodies = keep_bodies
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._calls = 0
        self._per_rollout: dict[str, int] = {}
        self._requests: collections.deque[RequestRecord] = collections.deque(maxlen=log_limit)
        self._logged = 0
        self._logged_by_rollout: dict[str, int] = {}
        self._faults: list[FaultRecord] = []
        self._fault_log = Path(fault_log) if fault_log is not None else None
        self.shutting_down = asyncio.Event()
        """Set when the server stops: releases hanging and delayed requests at once."""

    def next_call(self, rollout_id: str) -> tuple[int, int]:
        """Count one model request; return its (server-wide, per-rollout) 1-based numbers."""
        with self._lock:
            self._calls += 1
            rollout_call = self._per_rollout.get(rollout_id, 0) + 1
            self._per_rollout[rollout_id] = rollout_call
            return self._calls, rollout_call

    def log_request(self, record: RequestRecord) -> None:
        """Keep one request record."""
        with self._lock:
            self._requests.append(record)
            self._logged += 1
            if self._requests.maxlen is None:  # a bounded log is for long runs: no per-rollout map there
                self._logged_by_rollout[record.rollout_id] = (
                    self._logged_by_rollout.get(record.rollout_id, 0) + 1
                )
            self._changed.notify_all()

    def log_fault(self, record: FaultRecord) -> None:
        """Keep one fault record, and append it to the fault log file if there is one."""
        with self._lock:
            self._faults.append(record)
            if self._fault_log is not None:
                # Opened per record and flushed at once: the log must survive the server being killed.
                with self._fault_log.open("ab") as handle:
                    handle.write(orjson.dumps(record.model_dump()) + b"\n")

    def wait_for_requests(self, count: int, timeout: float, *, rollout_id: str | None = None) -> bool:
        """Block until at least ``count`` model requests (of ``rollout_id``, if given) have arrived.

        For tests and controllers that must act once a request is in flight (e.g.
        stop a server while a request hangs), or compare counts with a client's,
        without sleeping.

        Returns:
            True once they have arrived; False if ``timeout`` passed first.

        **Cancellation:** a plain thread wait; it ends by itself within ``timeout``.
        """

        def arrived() -> bool:
            if rollout_id is None:
                return self._logged >= count
            if self._requests.maxlen is not None:
                return sum(record.rollout_id == rollout_id for record in self._requests) >= count
            return self._logged_by_rollout.get(rollout_id, 0) >= count

        with self._lock:
            return self._changed.wait_for(arrived, timeout)

    @property
    def calls(self) -> int:
        """Model requests received so far."""
        with self._lock:
            return self._calls

    @property
    def requests_by_rollout(self) -> dict[str, int]:
        """Model requests per rollout id ('' for requests without ``X-Rollout-Id``)."""
        with self._lock:
            return dict(self._per_rollout)

    @property
    def requests(self) -> list[RequestRecord]:
        """Every model request so far (the latest ``log_limit`` of them), in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    @property
    def faults(self) -> list[FaultRecord]:
        """Every injected fault so far, in order (a copy)."""
        with self._lock:
            return list(self._faults)


def count_model_turns(api: Literal["chat", "responses"], body: Mapping[str, Any]) -> int:
    """The turn to play: how many assistant turns the request's history already holds.

    Chat: assistant messages. Responses: runs of consecutive model items
    (assistant ``message``, ``function_call``, ``reasoning``), one run per turn.
    """
    if api == "chat":
        messages = body.get("messages") or []
        return sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "assistant")
    items = body.get("input")
    if not isinstance(items, list):
        return 0
    turns = 0
    in_turn = False
    for item in items:
        if not isinstance(item, dict):
            in_turn = False
            continue
        kind = item.get("type", "message")
        is_model = kind in ("function_call", "reasoning") or (
            kind == "message" and item.get("role") == "assistant"
        )
        if is_model and not in_turn:
            turns += 1
        in_turn = is_model
    return turns


def find_task_marker(body: Mapping[str, Any]) -> str | None:
    """The first ``[task:ID]`` marker in the request's instructions or input, if any."""
    for text in _all_strings([body.get("instructions"), body.get("messages"), body.get("input")]):
        found = _TASK_MARKER.search(text)
        if found:
            return found.group(1)
    return None


def _all_strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [text for element in value for text in _all_strings(element)]
    if isinstance(value, dict):
        return [text for element in value.values() for text in _all_strings(element)]
    return []


def _error(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


class PolicyApp:
    """The ASGI app: ``/v1/chat/completions``, ``/v1/responses``, ``/v1/models`` (and ``/health``).

    The outer ASGI callable notes the server's transport (uvicorn's) in the scope,
    so a ``reset`` fault can abort the connection; everything else is starlette.

    Args:
        script: The policy script to play.
        faults: What to inject; None: nothing.
        state: Counters and logs; a fresh one if None.
    """

    def __init__(
        self, script: PolicyScript, *, faults: FaultPlan | None = None, state: PolicyState | None = None
    ) -> None:
        self.script = script
        self.faults = faults or FaultPlan()
        self.state = state or PolicyState()
        self._app = Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI entry point.

        **Cancellation:** the request being handled is abandoned and ``CancelledError``
        propagates.
        """
        if scope["type"] == "http":
            # uvicorn's send is a bound method of its request cycle, which holds the transport.
            scope[_TRANSPORT_KEY] = getattr(getattr(send, "__self__", None), "transport", None)
        await self._app(scope, receive, send)

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        model = {"id": self.script.model, "object": "model", "created": 0, "owned_by": "rollcage"}
        return JSONResponse({"object": "list", "data": [model]})

    async def _chat(self, request: Request) -> Response:
        return await self._play("chat", request)

    async def _responses(self, request: Request) -> Response:
        return await self._play("responses", request)

    async def _play(self, api: Literal["chat", "responses"], request: Request) -> Response:
        arrived = time.time()
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"request body is not JSON: {exc}", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object", "invalid_request_error")
        # Ids travel percent-encoded (rollcage.headers.encode_id): 'café' arrives as 'caf%C3%A9'.
        rollout_id = decode_id(request.headers.get("x-rollout-id", ""))
        task_id = decode_id(request.headers.get("x-task-id", "")) or find_task_marker(body) or "*"
        stream = bool(body.get("stream"))
        turn_index = count_model_turns(api, body)
        call, rollout_call = self.state.next_call(rollout_id)
        decision = self.faults.decide(
            call=call, rollout_call=rollout_call, rollout_id=rollout_id, task_id=task_id
        )
        # What the request log and the fault log both name this request by (RequestKey's fields).
        key: dict[str, Any] = {
            "call": call,
            "rollout_call": rollout_call,
            "rollout_id": rollout_id,
            "task_id": task_id,
            "api": api,
            "stream": stream,
            "turn": turn_index,
        }
        rule = decision[0] if decision else None
        if decision is not None:
            rule, source = decision
            self.state.log_fault(
                FaultRecord(
                    **key,
                    kind=rule.kind,
                    variant=self.faults.variant(rule, call) if rule.kind in WIRE_FAULTS else None,
                    status=_status_sent(rule),
                    source=source,
                    at=time.time(),
                )
            )
        # The request record comes last: waiting for it (wait_for_requests) then sees its fault too.
        self.state.log_request(
            RequestRecord(
                **key,
                fault=rule.kind if rule else None,
                at=arrived,
                body=body if self.state.keep_bodies else None,
            )
        )
        if rule is not None:
            early = await self._early_fault(rule, request)
            if early is not None:
                return early
        turn = self.script.turn(task_id, turn_index)
        if turn is None:
            return _error(
                404,
                f"the policy script has no entry for task {task_id!r} and no '*' default",
                "invalid_request_error",
                "task_not_in_script",
            )
        reply = reply_for(turn, turn_index)
        if rule is not None and rule.kind in CONTENT_FAULTS:
            reply = with_fault(reply, rule, turn_index)
        response_id = f"chatcmpl-{call}" if api == "chat" else f"resp_{call}"
        created = int(arrived)
        prompt_ids = prompt_token_ids(body)
        prompt = len(prompt_ids)
        ask = TokenAsk.of(body)
        model = str(body.get("model") or self.script.model)
        # What every rendering of this answer shares (the model's name, ids, the prompt and its tokens).
        shape: dict[str, Any] = {
            "model": model,
            "response_id": response_id,
            "created": created,
            "prompt": prompt,
            "prompt_ids": prompt_ids,
        }
        if stream:
            if api == "chat":
                options = body.get("stream_options")
                include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
                events = chat_events(reply, include_usage=include_usage, ask=ask, **shape)
            else:
                events = responses_events(reply, body, **shape)
            media_type = "text/event-stream"
            if rule is not None and rule.kind == "truncated":
                events = events[: max(1, len(events) // 2)]
            elif rule is not None and rule.kind == "malformed":
                events = [*events[:1], b'data: {"id": "' + response_id.encode() + b'", oops\n\n', *events[1:]]
            elif rule is not None and rule.kind in WIRE_FAULTS:
                events, media_type = hostile_events(
                    rule.kind, self.faults.variant(rule, call), api, events, rule.code
                )
            return self._send(rule, events, media_type)
        payload = (
            chat_body(reply, ask=ask, **shape) if api == "chat" else responses_body(reply, body, **shape)
        )
        raw, media_type = orjson.dumps(payload), "application/json"
        if rule is not None and rule.kind == "truncated":
            raw = raw[: len(raw) // 2]
        elif rule is not None and rule.kind == "malformed":
            raw = b'{"id": "' + response_id.encode() + b'", "object": oops, "choices": [}'
        elif rule is not None and rule.kind in WIRE_FAULTS:
            raw, media_type = hostile_body(
                rule.kind, self.faults.variant(rule, call), api, payload, rule.code
            )
        if rule is not None and rule.kind == "trickle":
            return self._send(rule, [raw], media_type)
        return Response(raw, media_type=media_type)

    def _send(self, rule: FaultRule | None, chunks: list[bytes], media_type: str) -> Response:
        """Stream ``chunks``; a ``trickle`` fault cuts them small and spreads them over its delay."""
        if rule is None or rule.kind != "trickle":
            return StreamingResponse(_iterate(chunks), media_type=media_type)
        pieces, pause = trickled(chunks, rule.delay_s)

        async def paced() -> AsyncIterator[bytes]:
            for number, piece in enumerate(pieces):
                if number:
                    await self._wait_for_shutdown(pause)
                yield piece

        return StreamingResponse(paced(), media_type=media_type)

    async def _early_fault(self, rule: FaultRule, request: Request) -> Response | None:
        """Faults that replace the answer (status, 429, reset, hang) or delay it (latency)."""
        if rule.kind == "latency":
            await self._wait_for_shutdown(rule.delay_s)
            return None
        if rule.kind == "status":
            kind = "server_error" if rule.status >= 500 else "invalid_request_error"
            return _error(rule.status, f"injected fault: HTTP {rule.status}", kind)
        if rule.kind == "rate_limit":
            response = _error(429, "injected fault: rate limited", "rate_limit_error", "rate_limit_exceeded")
            response.headers["Retry-After"] = _seconds(rule.retry_after_s)
            return response
        if rule.kind == "reset":
            return await self._abort(request)
        if rule.kind == "hang":
            await self._hang(request)
            return await self._abort(request)
        return None

    async def _wait_for_shutdown(self, seconds: float) -> None:
        """Wait ``seconds``, or less if the server shuts down meanwhile."""
        try:
            async with asyncio.timeout(seconds):
                await self.state.shutting_down.wait()
        except TimeoutError:
            pass

    async def _hang(self, request: Request) -> None:
        """Say nothing until the client disconnects or the server shuts down."""

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        await first_of(disconnected(), self.state.shutting_down.wait())

    async def _abort(self, request: Request) -> Response:
        """Drop the connection without an answer: RST on TCP, a bare close on a Unix socket."""
        transport = request.scope.get(_TRANSPORT_KEY)
        if transport is None:
            # Not uvicorn: the closest we can do is announce a body and never send it.
            return Response(b"", headers={"content-length": "1048576"})
        if not transport.is_closing():  # after a hang the client may have closed it already
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                # Linger 0: close() sends RST instead of FIN, which is what a reset is.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        # Let the server see the connection is gone, so it does not try to answer with a 500.
        for _ in range(3):
            await asyncio.sleep(0)
        return Response(b"")


def _status_sent(rule: FaultRule) -> int | None:
    """The HTTP status a fault answers with, for the ones that answer with an error status."""
    if rule.kind == "rate_limit":
        return 429
    return rule.status if rule.kind == "status" else None


async def _iterate(events: Sequence[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
