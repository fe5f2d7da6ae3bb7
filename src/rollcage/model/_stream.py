"""Server-sent events of both API styles, assembled into the payload a non-streamed call returns.

A stream counts only when it ends the way the API says it ends (``data: [DONE]``
for Chat Completions, a ``response.completed``/``response.incomplete``/
``response.failed`` event for Responses); a stream cut off before that is a
``WireError`` (the server's or the network's fault), never a shorter answer.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import orjson

from rollcage.model._wire import WireError

__all__ = ["ServerEventError", "SseEvent", "StreamResult", "assemble_stream", "sse_events"]


class ServerEventError(Exception):
    """The server reported an error inside the stream (an ``error`` event or ``{"error": ...}`` chunk)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code
        """The server's error code, if it gave one."""


class SseEvent:
    """One server-sent event."""

    __slots__ = ("data", "event")

    def __init__(self, event: str | None, data: str) -> None:
        self.event = event
        """The ``event:`` field, if any."""
        self.data = data
        """The ``data:`` lines, joined by newlines."""


class StreamResult:
    """An assembled stream."""

    __slots__ = ("first_event_at", "payload")

    def __init__(self, payload: dict[str, Any], first_event_at: float | None = None) -> None:
        self.payload = payload
        """The payload, shaped like the non-streamed response of the same API."""
        self.first_event_at = first_event_at
        """Unix time the first event arrived; ``None`` if none did."""


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[SseEvent]:
    """Decode ``text/event-stream`` lines into events (comments and ``id``/``retry`` fields are skipped).

    **Cancellation:** safe to cancel between lines; nothing is buffered beyond the current event.
    """
    event: str | None = None
    data: list[str] = []
    async for line in lines:
        if not line:
            if data:
                yield SseEvent(event, "\n".join(data))
            event, data = None, []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
    if data:
        # A final event without its blank line is still an event; whether the stream ended properly
        # is decided by the assembler (the terminal marker), not by the framing.
        yield SseEvent(event, "\n".join(data))


async def assemble_stream(api: Literal["chat", "responses"], events: AsyncIterator[SseEvent]) -> StreamResult:
    """Assemble a whole stream into one payload.

    Raises:
        WireError: an event is not JSON, or the stream ended before its terminal marker.
        ServerEventError: the server sent an error inside the stream.

    **Cancellation:** safe to cancel; the partial assembly is discarded.
    """
    result = StreamResult(payload={})
    assembler = _ChatAssembler() if api == "chat" else _ResponsesAssembler()
    async for event in events:
        if result.first_event_at is None:
            result.first_event_at = time.time()
        if assembler.feed(event):
            result.payload = assembler.payload()
            return result
    raise WireError(f"the {api} stream ended before its terminal event (truncated)")


def _load(data: str) -> dict[str, Any]:
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise WireError(f"stream event is not JSON: {data[:200]!r}") from exc
    if not isinstance(value, dict):
        raise WireError(f"stream event is not a JSON object: {data[:200]!r}")
    return value


def _raise_error(error: Any) -> None:
    if isinstance(error, dict):
        raise ServerEventError(str(error.get("message", error)), _as_code(error.get("code")))
    raise ServerEventError(str(error), None)


def _as_code(code: Any) -> str | None:
    return None if code is None else str(code)


class _ToolCallParts:
    __slots__ = ("arguments", "id", "name")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name = ""
        self.arguments: list[str] = []


class _ChatAssembler:
    """Folds ``chat.completion.chunk`` events into one ``chat.completion``."""

    def __init__(self) -> None:
        self._head: dict[str, Any] = {}
        self._content: list[str] | None = None
        self._reasoning: list[str] = []
        self._tools: dict[int, _ToolCallParts] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def feed(self, event: SseEvent) -> bool:
        if event.data.strip() == "[DONE]":
            return True
        chunk = _load(event.data)
        if "error" in chunk and "choices" not in chunk:
            _raise_error(chunk["error"])
        if chunk.get("object") == "error":  # vLLM's older in-stream error shape
            _raise_error(chunk)
        if not self._head:
            self._head = {key: chunk[key] for key in ("id", "created", "model") if key in chunk}
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content") is not None:
                if self._content is None:
                    self._content = []
                self._content.append(delta["content"])
            for key in ("reasoning_content", "reasoning"):
                if delta.get(key):
                    self._reasoning.append(delta[key])
            for call in delta.get("tool_calls") or []:
                parts = self._tools.setdefault(call.get("index", len(self._tools)), _ToolCallParts())
                parts.id = call.get("id") or parts.id
                function = call.get("function") or {}
                parts.name += function.get("name") or ""
                if function.get("arguments"):
                    parts.arguments.append(function["arguments"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return False

    def payload(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self._content is None else "".join(self._content),
        }
        if self._reasoning:
            message["reasoning_content"] = "".join(self._reasoning)
        if self._tools:
            message["tool_calls"] = [
                {
                    "id": parts.id,
                    "type": "function",
                    "function": {"name": parts.name, "arguments": "".join(parts.arguments)},
                }
                for _, parts in sorted(self._tools.items())
            ]
        return {
            **self._head,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "finish_reason": self._finish}],
            "usage": self._usage,
        }


class _ResponsesAssembler:
    """Keeps the terminal event's response, filling its output from ``output_item.done`` if it came empty."""

    _TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

    def __init__(self) -> None:
        self._items: dict[int, dict[str, Any]] = {}
        self._final: dict[str, Any] = {}

    def feed(self, event: SseEvent) -> bool:
        body = _load(event.data)
        kind = body.get("type") or event.event
        if kind == "error":
            _raise_error(body.get("error") or body)
        if kind == "response.output_item.done" and isinstance(body.get("item"), dict):
            self._items[int(body.get("output_index", len(self._items)))] = body["item"]
        if kind in self._TERMINAL:
            response = body.get("response")
            if not isinstance(response, dict):
                raise WireError(f"{kind} event without a response object")
            self._final = response
            return True
        return False

    def payload(self) -> dict[str, Any]:
        if not self._final.get("output") and self._items:
            return {**self._final, "output": [item for _, item in sorted(self._items.items())]}
        return self._final
