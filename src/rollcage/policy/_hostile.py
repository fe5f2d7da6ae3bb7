"""Hostile wire-level answers: what a broken or adversarial OpenAI-compatible server sends.

Each kind has a few *variants* (``FaultPlan.variant`` picks one, from the rule or
from the seed), all of the same family, so one seeded run covers the family and
not one example. Every variant of ``wrong_types``, ``bad_sse``, ``no_answer``,
``deep`` and ``failed`` is an answer a client must reject (as a transient,
malformed response, or as the error it reports); every variant of ``odd_sse`` is
legal and must be read as the normal answer; every variant of ``bad_tokens`` is
the normal answer whose token data a client must drop, keeping the answer; ``lying_type`` and ``trickle``
depend on what was asked (see ``rollcage.policy._faults``). ``bad_sse`` and
``odd_sse`` are about event streams: a request for a whole body gets the normal one.

The payload (or the list of ``data:`` frames) rendered for the turn goes in, the
bytes to send and their content type come out.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import orjson

__all__ = ["BAD_TOKENS", "hostile_body", "hostile_events", "trickled"]

Api = Literal["chat", "responses"]

_DEEP = 100
_SSE = "text/event-stream"
_JSON = "application/json"


# --------------------------------------------------------------------------- whole bodies


def hostile_body(kind: str, variant: int, api: Api, payload: dict[str, Any], code: str) -> tuple[bytes, str]:
    """The non-streamed answer ``payload`` as the hostile ``kind`` sends it: (body, content type)."""
    body = copy.deepcopy(payload)
    if kind == "bad_tokens":
        _with_bad_tokens(api, body, variant)
        return _dumps(body), _JSON
    if kind == "wrong_types":
        mutations = _CHAT_BODY_TYPES if api == "chat" else _RESPONSES_BODY_TYPES
        mutations[variant % len(mutations)](body)
        return orjson.dumps(body), _JSON
    if kind == "no_answer":
        if api == "chat":
            return orjson.dumps({**_head(body), "object": "chat.completion", "choices": []}), _JSON
        return orjson.dumps(
            {**_head(body), "object": "response", "status": "in_progress", "output": []}
        ), _JSON
    if kind == "deep":
        body["rollcage_deep"] = _nested(_DEEP)
        return orjson.dumps(body), _JSON
    if kind == "failed":
        error = {"code": code, "message": f"injected fault: {code}", "type": "invalid_request_error"}
        if api == "chat":
            return orjson.dumps({"error": error}), _JSON
        return orjson.dumps({**body, "status": "failed", "error": error, "output": []}), _JSON
    if kind == "lying_type":
        return orjson.dumps(body), _SSE  # JSON under the event-stream label
    return orjson.dumps(body), _JSON  # the stream kinds (bad_sse, odd_sse, trickle's pacing) change no body


def _head(body: dict[str, Any]) -> dict[str, Any]:
    return {key: body[key] for key in ("id", "created", "created_at", "model") if key in body}


def _first_message(body: dict[str, Any]) -> dict[str, Any]:
    return body["choices"][0]["message"]  # type: ignore[no-any-return]


def _set_tool_calls(body: dict[str, Any]) -> None:
    _first_message(body)["tool_calls"] = [{"type": "function", "function": {"name": 5, "arguments": 5}}]


_CHAT_BODY_TYPES: list[Callable[[dict[str, Any]], None]] = [
    lambda b: b.update(choices="x"),
    lambda b: b["choices"][0].update(message="x"),
    lambda b: _first_message(b).update(content=7),
    lambda b: _first_message(b).update(tool_calls={"0": {}}),
    lambda b: b["choices"][0].update(index="zero"),
    lambda b: b.update(usage={**(b.get("usage") or {}), "prompt_tokens": "lots"}),
    lambda b: b["choices"][0].update(finish_reason=["stop"]),
    _set_tool_calls,
]


def _responses_item(body: dict[str, Any], item: dict[str, Any]) -> None:
    body["output"] = [*body.get("output", []), item]


_RESPONSES_BODY_TYPES: list[Callable[[dict[str, Any]], None]] = [
    lambda b: b.update(output={}),
    lambda b: b.update(output=["x"]),
    lambda b: _responses_item(b, {"type": "message", "role": "assistant", "content": 5}),
    lambda b: _responses_item(b, {"type": "function_call", "call_id": "c", "name": 7, "arguments": "{}"}),
    lambda b: _responses_item(
        b, {"type": "function_call", "call_id": "c", "name": "python", "arguments": [1]}
    ),
    lambda b: b.update(usage={**(b.get("usage") or {}), "input_tokens": -3}),
    lambda b: b.update(status=5),
    lambda b: _responses_item(b, {"type": "reasoning", "summary": "x"}),
]


# --------------------------------------------------------------------------- token data

_BIG = 2**70

BAD_TOKENS: list[tuple[str, dict[str, Any]]] = [
    # (name, {ids: generation token ids, entries: logprob entries, probs: NeMo Gym's log probabilities})
    ("token-id-beyond-64-bits", {"entries": [{"token": f"token_id:{_BIG}", "logprob": -0.5}]}),
    ("ids-as-strings", {"ids": ["7", "8"], "probs": [-0.1, -0.2]}),
    ("ids-as-booleans", {"ids": [True, False], "probs": [-0.1, -0.2]}),
    ("negative-ids", {"ids": [7, -1], "probs": [-0.1, -0.2]}),
    ("ids-at-2^63", {"ids": [2**63], "probs": [-0.1]}),
    ("ids-beyond-64-bits", {"ids": [_BIG], "probs": [-0.1]}),
    ("positive-logprobs", {"ids": [7], "probs": [0.5], "entries": [{"token": "token_id:7", "logprob": 0.5}]}),
    ("logprobs-of-the-wrong-shape", {"entries": "high"}),
]
"""The ``bad_tokens`` variants: token data that is invalid, each in its own way."""


def _with_bad_tokens(api: Api, body: dict[str, Any], variant: int) -> None:
    """Put the variant's token data where the API style's servers put theirs (vLLM's, NeMo Gym's)."""
    bad = BAD_TOKENS[variant % len(BAD_TOKENS)][1]
    body["prompt_token_ids"] = [1, 2, 3]
    if api == "chat":
        choice = body["choices"][0] if body.get("choices") else {}
        if "ids" in bad:
            choice["token_ids"] = bad["ids"]
        if "entries" in bad:
            entries = bad["entries"]
            choice["logprobs"] = {"content": entries} if isinstance(entries, list) else entries
        return
    items = body.get("output") or []
    if "ids" in bad and items:
        items[-1] = {**items[-1], "generation_token_ids": bad["ids"], "generation_log_probs": bad["probs"]}
    elif "entries" in bad:
        for item in items:
            for part in item.get("content") or [] if item.get("type") == "message" else []:
                if isinstance(part, dict) and part.get("type") == "output_text":
                    part["logprobs"] = bad["entries"]


def _bad_token_events(variant: int, api: Api, events: list[bytes]) -> list[bytes]:
    if api == "chat":
        first = _parse(events[0])
        _with_bad_tokens("chat", first, variant)
        return [_frame(first), *events[1:]]
    *body, terminal = events
    final = _parse(terminal)
    _with_bad_tokens("responses", final["response"], variant)
    return [*body, _frame(final, event=final.get("type"))]


def _dumps(value: Any) -> bytes:
    """JSON bytes, integers beyond 64 bits included (orjson refuses them; a server need not)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value).encode()


# --------------------------------------------------------------------------- streams


def hostile_events(
    kind: str, variant: int, api: Api, events: list[bytes], code: str
) -> tuple[list[bytes], str]:
    """The streamed answer (its ``data:`` frames) as the hostile ``kind`` sends it: (chunks, content type)."""
    if kind == "wrong_types":
        return _wrong_type_events(variant, api, events), _SSE
    if kind == "bad_tokens":
        return _bad_token_events(variant, api, events), _SSE
    if kind in ("bad_sse", "odd_sse"):
        return list(_frames(kind, variant, events)), _SSE
    if kind == "no_answer":
        return [b"data: [DONE]\n\n"], _SSE
    if kind == "deep":
        if api == "chat":
            extra = _frame({"choices": [], "usage": {"rollcage_deep": _nested(_DEEP)}})
            return [*events[:-1], extra, events[-1]], _SSE
        *body, terminal = events
        final = _parse(terminal)
        final["response"]["rollcage_deep"] = _nested(_DEEP)
        return [*body, _frame(final, event=final.get("type"))], _SSE
    if kind == "failed":
        error = {"code": code, "message": f"injected fault: {code}"}
        if api == "chat":
            return [events[0], _frame({"error": error})], _SSE
        *body, terminal = events
        final = _parse(terminal)
        failed = {**final["response"], "status": "failed", "error": error}
        return [
            *body,
            _frame({**final, "type": "response.failed", "response": failed}, event="response.failed"),
        ], _SSE
    if kind == "lying_type":
        return events, _JSON  # events under the JSON label
    return events, _SSE


def _wrong_type_events(variant: int, api: Api, events: list[bytes]) -> list[bytes]:
    if api == "chat":
        bad = [
            {"choices": "x"},
            {
                "choices": [
                    {"index": 0, "delta": {"tool_calls": [{"index": "zero", "function": {"arguments": 5}}]}}
                ]
            },
            {"choices": [{"index": 0, "delta": {"content": 5}}]},
            {"choices": [{"index": 0, "delta": []}]},
            {"choices": [{"index": "zero", "delta": {"content": "x"}}]},
            {"choices": [{"index": 0, "delta": {"reasoning_content": {"x": 1}}}]},
        ]
        return [events[0], _frame(bad[variant % len(bad)]), *events[1:]]
    *body, terminal = events
    final = _parse(terminal)
    choice = variant % 5
    if choice == 0:
        return [
            events[0],
            _frame({"type": "response.output_item.done", "output_index": "zero", "item": {}}),
            *events[1:],
        ]
    if choice == 1:
        return [*body, _frame({**final, "response": "x"})]
    if choice == 2:
        return [*body, _frame({**final, "response": {**final["response"], "output": {}}})]
    if choice == 3:
        return [events[0], b"data: [1, 2]\n\n", *events[1:]]
    usage = {**(final["response"].get("usage") or {}), "output_tokens": "many"}
    return [*body, _frame({**final, "response": {**final["response"], "usage": usage}})]


def _frames(kind: str, variant: int, events: list[bytes]) -> Iterator[bytes]:
    """The events re-framed: broken (``bad_sse``) or legal but unusual (``odd_sse``)."""
    datas = [_data_of(event) for event in events]
    if kind == "bad_sse":
        choice = variant % 3
        if choice == 0:  # no "data:" field at all: nothing is an event
            yield from (data + b"\n\n" for data in datas)
        elif choice == 1:  # events run together: each event's data is two JSON documents
            yield from (b"data: " + data + b"\n" for data in datas)
            yield b"\n"
        else:  # bytes that are not UTF-8, outside any JSON string
            first, *rest = datas
            yield b"data: " + first[:1] + b"\xff\xfe" + first[1:] + b"\n\n"
            yield from (b"data: " + data + b"\n\n" for data in rest)
        return
    choice = variant % 5
    if choice == 0:
        yield from (b"data: " + data + b"\r\r" for data in datas)
    elif choice == 1:
        yield from (b"data: " + data + b"\r\n\r\n" for data in datas)
    elif choice == 2:
        yield b": keep-alive\n\nretry: 100\n\n"
        for number, data in enumerate(datas):
            yield b": ping\nid: " + str(number).encode() + b"\ndata: " + data + b"\n\n"
    elif choice == 3:
        yield from (b"data:" + data + b"\n\n" for data in datas)
    else:  # one event over several data: lines (indented JSON: its line breaks are all between tokens)
        for data in datas:
            lines = _indented(data).split(b"\n")
            yield b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"


# --------------------------------------------------------------------------- framing helpers


def _frame(value: Any, *, event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + _dumps(value) + b"\n\n"


def _data_of(event: bytes) -> bytes:
    """The ``data:`` content of one frame as the renderer made it (one data line)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return line[len(b"data: ") :]
    return event.strip()


def _parse(event: bytes) -> dict[str, Any]:
    value = orjson.loads(_data_of(event))
    assert isinstance(value, dict)
    return value


def _indented(data: bytes) -> bytes:
    try:
        return orjson.dumps(orjson.loads(data), option=orjson.OPT_INDENT_2)
    except orjson.JSONDecodeError:
        return data  # [DONE]


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def trickled(chunks: list[bytes], seconds: float, *, piece: int = 7) -> tuple[list[bytes], float]:
    """The chunks in ``piece``-byte pieces, and the pause between pieces spreading them over ``seconds``."""
    data = b"".join(chunks)
    pieces = [data[start : start + piece] for start in range(0, len(data), piece)] or [b""]
    return pieces, seconds / max(1, len(pieces) - 1)
