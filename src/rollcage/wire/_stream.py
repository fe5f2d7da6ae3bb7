"""Server-sent events of both API styles, assembled into the payload a non-streamed call returns.

A stream counts only when it ends the way the API says it ends (``data: [DONE]``
for Chat Completions, a ``response.completed``/``response.incomplete``/
``response.failed`` event for Responses) and says something on the way: a stream
cut off before its end, or a chat stream that is nothing but ``data: [DONE]``, is
a ``WireError`` (the server's or the network's fault), never a shorter or empty
answer. So is an event that is not JSON, or whose fields rollcage reads have the
wrong JSON types (``{"choices": "x"}``, a tool-call delta with ``"index": "zero"``).
"""

from __future__ import annotations

import codecs
import re
import time
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rollcage.wire._payloads import Lenient, WireError

__all__ = ["ServerEventError", "SseEvent", "StreamResult", "assemble_stream", "sse_events", "sse_lines"]

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_E = TypeVar("_E", bound=BaseModel)


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


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """Decode a byte stream into lines as ``text/event-stream`` defines them (CRLF, LF or CR).

    Bytes that are not UTF-8 become U+FFFD (the event that holds them then fails
    as JSON, or carries the replacement character). Unicode line separators
    inside JSON strings are not line breaks here.

    **Cancellation:** safe to cancel between chunks; the partial line is discarded.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    pending = ""
    async for chunk in chunks:
        text = pending + decoder.decode(chunk)
        # A CR at the very end may be the first half of a CRLF: wait for the next chunk to tell.
        hold = 1 if text.endswith("\r") else 0
        lines = _LINE_BREAK.split(text[: len(text) - hold] if hold else text)
        pending = lines.pop() + text[len(text) - hold :]
        for line in lines:
            yield line
    pending += decoder.decode(b"", final=True)
    for line in _LINE_BREAK.split(pending):
        if line:
            yield line


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
        WireError: an event is not JSON or has fields of the wrong JSON type, the
            stream ended before its terminal marker, or (chat) it ended without a
            single choice.
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


def _read(model: type[_E], value: dict[str, Any], what: str) -> _E:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part) for part in error["loc"]) or "event"
        raise WireError(f"{what} has a field of the wrong type: {where}: {error['msg']}") from exc


def _raise_error(error: Any) -> None:
    if isinstance(error, dict):
        raise ServerEventError(str(error.get("message", error))[:500], _as_code(error.get("code")))
    raise ServerEventError(str(error)[:500], None)


def _as_code(code: Any) -> str | None:
    return None if code is None else str(code)[:200]


# --------------------------------------------------------------------------- chat


class _FunctionDelta(Lenient):
    name: str | None = None
    arguments: str | None = None


class _ToolCallDelta(Lenient):
    index: int | None = None
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(Lenient):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _ChunkChoice(Lenient):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None
    # Token data is kept as it came: the parser reads it strictly from the assembled payload
    # (rollcage.wire._tokens), where a bad array is dropped with a note instead of failing the call.
    logprobs: Any = None
    token_ids: Any = None


class _Chunk(Lenient):
    choices: list[_ChunkChoice] | None = None
    usage: dict[str, Any] | None = None
    # vLLM's return_token_ids / prompt_logprobs: sent once, in the first chunk.
    prompt_token_ids: Any = None
    prompt_logprobs: Any = None


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
        self._answered = False
        self._content: list[str] | None = None
        self._reasoning: list[str] = []
        self._tools: dict[int, _ToolCallParts] = {}
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        # Token data, concatenated over the deltas; a share that is not an array stands for the
        # whole (the parser then drops it with a note).
        self._logprobs: Any = None
        self._token_ids: Any = None
        self._prompt: dict[str, Any] = {}

    def feed(self, event: SseEvent) -> bool:
        if event.data.strip() == "[DONE]":
            if not self._answered:
                # Nothing but the end marker (or chunks that carry nothing): no answer was given,
                # which is the server's failure, not an empty answer by the policy.
                raise WireError(
                    "the chat stream ended ([DONE]) without an answer: no content, tool call or finish_reason"
                )
            return True
        raw = _load(event.data)
        if "error" in raw and "choices" not in raw:
            _raise_error(raw["error"])
        if raw.get("object") == "error":  # vLLM's older in-stream error shape
            _raise_error(raw)
        chunk = _read(_Chunk, raw, "a chat stream chunk")
        if not self._head:
            self._head = {key: raw[key] for key in ("id", "created", "model") if key in raw}
        if chunk.usage:
            self._usage = chunk.usage
        for key in ("prompt_token_ids", "prompt_logprobs"):
            if getattr(chunk, key) is not None:
                self._prompt[key] = raw[key]
        for choice in chunk.choices or []:
            if choice.index == 0:
                self._take(choice)
        return False

    def _take(self, choice: _ChunkChoice) -> None:
        """Fold one delta of the first choice into the answer being assembled."""
        # Token data arrives per delta: the assembled answer carries all of it, in order.
        logprobs = choice.logprobs
        if logprobs is not None:
            content = logprobs.get("content") if isinstance(logprobs, dict) else logprobs
            if content is not None:
                self._logprobs = _concatenated(self._logprobs, content)
        if choice.token_ids is not None:
            self._token_ids = _concatenated(self._token_ids, choice.token_ids)
        delta = choice.delta or _Delta()
        self._answered = self._answered or bool(
            delta.content is not None
            or delta.reasoning_content
            or delta.reasoning
            or delta.tool_calls
            or choice.finish_reason
        )
        if delta.content is not None:
            if self._content is None:
                self._content = []
            self._content.append(delta.content)
        for text in (delta.reasoning_content, delta.reasoning):
            if text:
                self._reasoning.append(text)
        for call in delta.tool_calls or []:
            parts = self._tools.setdefault(
                call.index if call.index is not None else len(self._tools), _ToolCallParts()
            )
            parts.id = call.id or parts.id
            function = call.function or _FunctionDelta()
            parts.name += function.name or ""
            if function.arguments:
                parts.arguments.append(function.arguments)
        if choice.finish_reason:
            self._finish = choice.finish_reason

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
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": self._finish}
        if self._logprobs is not None:
            choice["logprobs"] = {"content": self._logprobs}
        if self._token_ids is not None:
            choice["token_ids"] = self._token_ids
        return {
            **self._head,
            **self._prompt,
            "object": "chat.completion",
            "choices": [choice],
            "usage": self._usage,
        }


def _concatenated(before: Any, share: Any) -> Any:
    """``before`` then ``share`` when both are arrays; else the first value that is not one."""
    if before is not None and not isinstance(before, list):
        return before
    if not isinstance(share, list):
        return share
    if before is None:
        return list(share)
    before.extend(share)  # in place: a stream of n deltas costs O(n), not O(n^2)
    return before


# --------------------------------------------------------------------------- responses


class _ResponsesEvent(Lenient):
    type: str | None = None
    output_index: int | None = None
    item: dict[str, Any] | None = None
    response: dict[str, Any] | None = None


class _ResponsesAssembler:
    """Keeps the terminal event's response, filling its output from ``output_item.done`` if it came empty."""

    _TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})

    def __init__(self) -> None:
        self._items: dict[int, dict[str, Any]] = {}
        self._final: dict[str, Any] = {}

    def feed(self, event: SseEvent) -> bool:
        raw = _load(event.data)
        if (raw.get("type") or event.event) == "error":
            _raise_error(raw.get("error") or raw)
        body = _read(_ResponsesEvent, raw, "a responses stream event")
        kind = body.type or event.event
        if kind == "response.output_item.done" and body.item is not None:
            index = body.output_index if body.output_index is not None else len(self._items)
            self._items[index] = body.item
        if kind in self._TERMINAL:
            if body.response is None:
                raise WireError(f"{kind} event without a response object")
            self._final = body.response
            return True
        return False

    def payload(self) -> dict[str, Any]:
        # Only a missing or empty list is filled in: output of a wrong type stays, for the parser to refuse.
        if self._final.get("output") in (None, []) and self._items:
            return {**self._final, "output": [item for _, item in sorted(self._items.items())]}
        return self._final
