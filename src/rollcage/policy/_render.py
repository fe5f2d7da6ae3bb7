"""A scripted turn rendered as a Chat Completions or Responses answer, whole or as server-sent events.

Token usage follows one documented rule, so the same request always reports the
same counts: ``tokens(text) = ceil(len(text.encode("utf-8")) / 4)``. Input
tokens are, per message or input item, 4 plus the tokens of its texts (content,
tool-call name and arguments, tool output), plus the tokens of the instructions
and of the tools' JSON. Output tokens are the tokens of the message text, the
reasoning, and each tool call's name and arguments; reasoning tokens are the
reasoning's share of them. Cached tokens are always reported as 0.

Token ids follow the same rule, so they always agree with the counts: a text is
cut into 4-byte pieces, each piece one token whose id is ``100 + (the piece as a
little-endian integer) % 100000``; every message or item opens with 4 header
tokens (ids below 100, by role). A prompt is the instructions, the tools' JSON,
then the items in order; a generation is the reasoning, the text, then each tool
call's name and arguments. Each token's log probability is
``-(1 + (id * 7919 + position) % 997) / 1000`` (position: 0-based in its prompt or
generation). They are sent the way vLLM sends them when asked: Chat Completions'
``logprobs`` (and ``top_logprobs`` alternatives, ``return_tokens_as_token_ids``),
``return_token_ids`` (``prompt_token_ids`` on the body, ``token_ids`` on the choice;
streamed: the prompt's in the first chunk, the generation's spread over the deltas),
``prompt_logprobs``; Responses' ``include: ["message.output_text.logprobs"]`` (the
message text's tokens on its ``output_text`` part), and, with ``return_token_ids``,
NeMo Gym's arrays (``prompt_token_ids``, ``generation_token_ids``,
``generation_log_probs``) on the last output item.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

from rollcage.policy._faults import CONTENT_FAULTS, FaultRule
from rollcage.policy._script import Turn

__all__ = [
    "UNKNOWN_TOOL",
    "Reply",
    "TokenAsk",
    "chat_body",
    "chat_events",
    "count_tokens",
    "generation_token_ids",
    "prompt_token_ids",
    "prompt_tokens",
    "reply_for",
    "responses_body",
    "responses_events",
    "token_ids",
    "token_log_prob",
    "with_fault",
]

_PIECE = 16
"""Characters per streamed delta: small enough that every answer arrives in several events."""


@dataclass(frozen=True, slots=True)
class ToolCallOut:
    """One tool call as it will be sent."""

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class Reply:
    """What one answer contains, independent of the API style."""

    text: str | None
    reasoning: str | None
    tool_calls: tuple[ToolCallOut, ...]
    finish: Literal["stop", "length"]


def reply_for(turn: Turn, turn_index: int) -> Reply:
    """The reply that plays ``turn`` as the ``turn_index``-th model turn (call ids: ``call_<turn>_<k>``)."""
    calls = tuple(
        ToolCallOut(f"call_{turn_index}_{k}", call.name, call.arguments_text())
        for k, call in enumerate(turn.tool_calls)
    )
    return Reply(text=turn.message_text(), reasoning=turn.reasoning, tool_calls=calls, finish=turn.finish)


UNKNOWN_TOOL = "no_such_tool"
"""The tool name an ``unknown_tool`` fault calls."""


def with_fault(reply: Reply, rule: FaultRule, turn_index: int) -> Reply:
    """The reply changed by a content fault (``CONTENT_FAULTS``); other kinds leave it as it is.

    ``bad_arguments`` and ``many_calls`` give a turn without tool calls one python
    call to act on; the other tool-call kinds leave such a turn (a final answer) alone.
    """
    kind = rule.kind
    if kind == "length":
        # Generation stopped mid-way: half the text (or of the first call, spilled as text), no calls.
        source = reply.text or (reply.tool_calls[0].arguments if reply.tool_calls else "")
        return Reply(
            text=source[: len(source) // 2], reasoning=reply.reasoning, tool_calls=(), finish="length"
        )
    if kind == "empty":
        return Reply(text="", reasoning=None, tool_calls=(), finish="stop")
    if kind not in CONTENT_FAULTS or (not reply.tool_calls and kind not in ("bad_arguments", "many_calls")):
        return reply
    calls = reply.tool_calls or (ToolCallOut(f"call_{turn_index}_0", "python", '{"code": "print(1)"}'),)
    if kind == "bad_arguments":
        calls = tuple(replace(call, arguments=_cut_json(call.arguments)) for call in calls)
    elif kind == "no_ids":
        calls = tuple(replace(call, call_id="") for call in calls)
    elif kind == "reused_ids":
        calls = tuple(replace(call, call_id="call_reused") for call in calls)
    elif kind == "many_calls":
        first = calls[0]
        calls = tuple(replace(first, call_id=f"call_{turn_index}_{k}") for k in range(rule.count))
    elif kind == "huge_arguments":
        calls = tuple(replace(call, arguments=_padded(call.arguments, rule.size)) for call in calls)
    elif kind == "unknown_tool":
        calls = tuple(replace(call, name=UNKNOWN_TOOL) for call in calls)
    return replace(reply, tool_calls=calls)


def _padded(arguments: str, size: int) -> str:
    """The arguments with a ``padding`` member of ``size`` bytes (still a JSON object where they were one)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        value = {}
    return json.dumps({**value, "padding": "x" * size}, separators=(",", ":"))


def _cut_json(arguments: str) -> str:
    cut = arguments[: max(1, len(arguments) // 2)]
    try:
        json.loads(cut)
    except ValueError:
        return cut
    return cut + "{"  # still valid after the cut (e.g. '{}' -> '{'): make sure it is not


# --------------------------------------------------------------------------- tokens


def count_tokens(text: str) -> int:
    """``ceil(len(utf8 bytes) / 4)``: the documented stand-in for a tokenizer."""
    return (len(text.encode("utf-8")) + 3) // 4


_VOCAB = 100_000
_SPECIAL = 100
_ROLES = {"system": 10, "developer": 10, "user": 11, "assistant": 12, "tool": 13}


def _token_pieces(text: str) -> list[bytes]:
    raw = text.encode("utf-8")
    return [raw[start : start + 4] for start in range(0, len(raw), 4)]


def _piece_id(piece: bytes) -> int:
    return _SPECIAL + int.from_bytes(piece, "little") % _VOCAB


def token_ids(text: str) -> list[int]:
    """The ids of a text's tokens: one per 4-byte piece (``count_tokens(text)`` of them)."""
    return [_piece_id(piece) for piece in _token_pieces(text)]


def token_log_prob(token: int, position: int) -> float:
    """The log probability the scripted policy reports for ``token`` at ``position``."""
    return -(1 + (token * 7919 + position) % 997) / 1000


def prompt_token_ids(request: Mapping[str, Any]) -> list[int]:
    """Token ids of a chat or responses request's prompt (see the module's rule)."""
    ids: list[int] = []
    instructions = request.get("instructions")
    if isinstance(instructions, str):
        ids += token_ids(instructions)
    tools = request.get("tools")
    if tools:
        ids += token_ids(json.dumps(tools, sort_keys=True))
    messages = request.get("messages")
    items = messages if isinstance(messages, list) else request.get("input")
    if isinstance(items, str):
        ids += [1, _ROLES["user"], 2, 3, *token_ids(items)]
    elif isinstance(items, list):
        for item in items:
            ids += [1, _role_token(item), 2, 3]
            for text in _texts(item):
                ids += token_ids(text)
    return ids


def prompt_tokens(request: Mapping[str, Any]) -> int:
    """Input tokens of a chat or responses request, by the module's rule."""
    return len(prompt_token_ids(request))


def _role_token(item: Any) -> int:
    if not isinstance(item, dict):
        return 14
    kind = item.get("type", "message")
    if kind in ("function_call", "reasoning"):
        return _ROLES["assistant"]
    if kind == "function_call_output":
        return _ROLES["tool"]
    return _ROLES.get(str(item.get("role")), 14)


def _generation_texts(reply: Reply) -> list[str]:
    return [
        reply.reasoning or "",
        reply.text or "",
        *(t for c in reply.tool_calls for t in (c.name, c.arguments)),
    ]


def generation_token_ids(reply: Reply) -> list[int]:
    """Token ids of what a reply generates: reasoning, text, then each tool call's name and arguments."""
    return [token for text in _generation_texts(reply) for token in token_ids(text)]


@dataclass(frozen=True, slots=True)
class TokenAsk:
    """What token data a request asks for, in vLLM's (and OpenAI's) request fields.

    Attributes:
        logprobs: Per-token log probabilities (chat ``logprobs``).
        top: Alternatives per token (``top_logprobs``).
        as_ids: Logprob tokens written ``token_id:N`` (``return_tokens_as_token_ids``).
        return_ids: Prompt and generation token ids (``return_token_ids``).
        prompt_logprobs: Alternatives per prompt token (``prompt_logprobs``); None: not asked.
        text_logprobs: The message text's logprobs (Responses ``include``).
    """

    logprobs: bool = False
    top: int = 0
    as_ids: bool = False
    return_ids: bool = False
    prompt_logprobs: int | None = None
    text_logprobs: bool = False

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> TokenAsk:
        """Read a request body (wrong types count as not asked)."""
        top = body.get("top_logprobs")
        prompt = body.get("prompt_logprobs")
        include = body.get("include")
        return cls(
            logprobs=body.get("logprobs") is True,
            top=top if isinstance(top, int) and not isinstance(top, bool) and 0 <= top <= 20 else 0,
            as_ids=body.get("return_tokens_as_token_ids") is True,
            return_ids=body.get("return_token_ids") is True,
            prompt_logprobs=prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None,
            text_logprobs=isinstance(include, list) and "message.output_text.logprobs" in include,
        )


def _logprob_entries(texts: Iterable[str], ask: TokenAsk) -> list[dict[str, Any]]:
    """OpenAI-style logprob entries (token, logprob, bytes, top_logprobs) of the texts' tokens."""
    entries: list[dict[str, Any]] = []
    for piece in (piece for text in texts for piece in _token_pieces(text)):
        token = _piece_id(piece)
        logprob = token_log_prob(token, len(entries))
        shown = f"token_id:{token}" if ask.as_ids else piece.decode("utf-8", "replace")
        alternatives = [
            {
                "token": f"token_id:{token + k}" if ask.as_ids else shown if k == 0 else f"<alt{k}>",
                "logprob": logprob - k,
                "bytes": list(piece) if k == 0 else [],
            }
            for k in range(ask.top)
        ]
        entries.append(
            {"token": shown, "logprob": logprob, "bytes": list(piece), "top_logprobs": alternatives}
        )
    return entries


def _prompt_log_probs(prompt_ids: list[int]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then {id: {logprob, rank, decoded_token}}."""
    return [None] + [
        {str(token): {"logprob": token_log_prob(token, position), "rank": 1, "decoded_token": ""}}
        for position, token in enumerate(prompt_ids)
        if position > 0
    ]


def _chat_token_fields(
    reply: Reply, prompt_ids: list[int], ask: TokenAsk
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The token fields of a chat answer: (on the body, on the choice), as vLLM sends them when asked."""
    body: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    if ask.return_ids:
        body["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = generation_token_ids(reply)
    if ask.prompt_logprobs is not None:
        body["prompt_logprobs"] = _prompt_log_probs(prompt_ids)
    if ask.logprobs:
        choice["logprobs"] = {"content": _logprob_entries(_generation_texts(reply), ask)}
    return body, choice


def _texts(value: Any) -> Iterable[str]:
    """Every model-visible string in a message or item (not its type/role/id keys)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for element in value:
            yield from _texts(element)
    elif isinstance(value, dict):
        for key, element in value.items():
            if key in ("content", "text", "arguments", "output", "name", "function", "tool_calls", "summary"):
                yield from _texts(element)


def _output_counts(reply: Reply) -> tuple[int, int]:
    reasoning = count_tokens(reply.reasoning or "")
    output = count_tokens(reply.text or "") + reasoning
    output += sum(count_tokens(call.name) + count_tokens(call.arguments) for call in reply.tool_calls)
    return output, reasoning


# --------------------------------------------------------------------------- chat completions


def _chat_usage(reply: Reply, prompt: int) -> dict[str, Any]:
    output, reasoning = _output_counts(reply)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": 0},
        "completion_tokens_details": {"reasoning_tokens": reasoning},
    }


def _finish_reason(reply: Reply) -> str:
    if reply.finish == "length":
        return "length"
    return "tool_calls" if reply.tool_calls else "stop"


def chat_body(
    reply: Reply,
    *,
    model: str,
    response_id: str,
    created: int,
    prompt: int,
    prompt_ids: list[int] | None = None,
    ask: TokenAsk | None = None,
) -> dict[str, Any]:
    """A ``chat.completion`` object (reasoning as vLLM sends it: ``message.reasoning_content``).

    With ``ask``, the token data it asks for, as vLLM sends it (``prompt_ids``: the prompt's ids).
    """
    message: dict[str, Any] = {"role": "assistant", "content": reply.text}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = [
            {
                **_id("id", call.call_id),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in reply.tool_calls
        ]
    on_body, on_choice = _chat_token_fields(reply, prompt_ids or [], ask or TokenAsk())
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        **on_body,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": _finish_reason(reply),
                "logprobs": None,
                **on_choice,
            }
        ],
        "usage": _chat_usage(reply, prompt),
    }


def chat_events(
    reply: Reply,
    *,
    model: str,
    response_id: str,
    created: int,
    prompt: int,
    include_usage: bool,
    prompt_ids: list[int] | None = None,
    ask: TokenAsk | None = None,
) -> list[bytes]:
    """``chat.completion.chunk`` events, each one ``data: ...`` SSE frame, ending with ``data: [DONE]``.

    Token data as vLLM streams it when asked: the prompt's in the first chunk, the
    generation's spread over the chunks that carry deltas, in order.
    """
    head = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": "" if reply.text is not None else None}]
    deltas += [{"reasoning_content": piece} for piece in _pieces(reply.reasoning)]
    deltas += [{"content": piece} for piece in _pieces(reply.text)]
    for k, call in enumerate(reply.tool_calls):
        opening = {"index": k, **_id("id", call.call_id), "type": "function"}
        deltas.append({"tool_calls": [{**opening, "function": {"name": call.name, "arguments": ""}}]})
        deltas += [
            {"tool_calls": [{"index": k, "function": {"arguments": p}}]} for p in _pieces(call.arguments)
        ]
    on_body, on_choice = _chat_token_fields(reply, prompt_ids or [], ask or TokenAsk())
    shares = _spread(on_choice, len(deltas))
    events = [
        _frame(
            {
                **head,
                **(on_body if position == 0 else {}),
                "choices": [{"index": 0, "delta": delta, "finish_reason": None, "logprobs": None, **share}],
            }
        )
        for position, (delta, share) in enumerate(zip(deltas, shares, strict=True))
    ]
    events.append(
        _frame(
            {
                **head,
                "choices": [
                    {"index": 0, "delta": {}, "finish_reason": _finish_reason(reply), "logprobs": None}
                ],
            }
        )
    )
    if include_usage:
        events.append(_frame({**head, "choices": [], "usage": _chat_usage(reply, prompt)}))
    events.append(b"data: [DONE]\n\n")
    return events


def _spread(on_choice: dict[str, Any], chunks: int) -> list[dict[str, Any]]:
    """The choice's token fields cut into ``chunks`` consecutive shares (sizes differ by at most one)."""
    ids = on_choice.get("token_ids")
    entries = on_choice.get("logprobs", {}).get("content") if "logprobs" in on_choice else None
    total = len(ids) if ids is not None else len(entries) if entries is not None else 0
    shares: list[dict[str, Any]] = []
    for k in range(chunks):
        start, end = total * k // chunks, total * (k + 1) // chunks
        share: dict[str, Any] = {}
        if ids is not None:
            share["token_ids"] = ids[start:end]
        if entries is not None:
            share["logprobs"] = {"content": entries[start:end]}
        shares.append(share)
    return shares


# --------------------------------------------------------------------------- responses


def _responses_usage(reply: Reply, prompt: int) -> dict[str, Any]:
    output, reasoning = _output_counts(reply)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }


def _responses_items(
    reply: Reply, response_id: str, prompt_ids: list[int] | None = None, ask: TokenAsk | None = None
) -> list[dict[str, Any]]:
    ask = ask or TokenAsk()
    suffix = response_id.removeprefix("resp_")
    items: list[dict[str, Any]] = []
    if reply.reasoning is not None:
        items.append(
            {
                "id": f"rs_{suffix}",
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": reply.reasoning}],
            }
        )
    if reply.text is not None:
        items.append(
            {
                "id": f"msg_{suffix}",
                "type": "message",
                "role": "assistant",
                "status": "incomplete" if reply.finish == "length" else "completed",
                "content": [
                    {
                        "type": "output_text",
                        "text": reply.text,
                        "annotations": [],
                        **({"logprobs": _logprob_entries([reply.text], ask)} if ask.text_logprobs else {}),
                    }
                ],
            }
        )
    for k, call in enumerate(reply.tool_calls):
        items.append(
            {
                **_id("id", call.call_id and f"fc_{suffix}_{k}"),
                "type": "function_call",
                **_id("call_id", call.call_id),
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
        )
    if ask.return_ids and items:
        # NeMo Gym's model servers carry a call's token arrays on the item that holds its generation.
        generation = generation_token_ids(reply)
        items[-1] = {
            **items[-1],
            "prompt_token_ids": prompt_ids or [],
            "generation_token_ids": generation,
            "generation_log_probs": [token_log_prob(t, p) for p, t in enumerate(generation)],
        }
    return items


def _response_object(
    request: Mapping[str, Any],
    *,
    model: str,
    response_id: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete: bool,
) -> dict[str, Any]:
    tools = [
        {**tool, "strict": tool.get("strict", False)} if tool.get("type") == "function" else tool
        for tool in request.get("tools") or []
        if isinstance(tool, dict)
    ]
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": {},
        "output": output,
        "parallel_tool_calls": True,
        "temperature": request.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": tools,
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
    }


def responses_body(
    reply: Reply,
    request: Mapping[str, Any],
    *,
    model: str,
    response_id: str,
    created: int,
    prompt: int,
    prompt_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A Responses ``response`` object; a length-stopped reply is ``incomplete`` (``max_output_tokens``).

    The token data the request asks for (``TokenAsk``) rides on the items.
    """
    incomplete = reply.finish == "length"
    return _response_object(
        request,
        model=model,
        response_id=response_id,
        created=created,
        status="incomplete" if incomplete else "completed",
        output=_responses_items(reply, response_id, prompt_ids, TokenAsk.of(request)),
        usage=_responses_usage(reply, prompt),
        incomplete=incomplete,
    )


def responses_events(
    reply: Reply,
    request: Mapping[str, Any],
    *,
    model: str,
    response_id: str,
    created: int,
    prompt: int,
    prompt_ids: list[int] | None = None,
) -> list[bytes]:
    """The Responses event stream, from ``response.created`` to ``response.completed``/``.incomplete``."""
    events: list[bytes] = []

    def emit(kind: str, **fields: Any) -> None:
        events.append(_frame({"type": kind, "sequence_number": len(events), **fields}, event=kind))

    skeleton = _response_object(
        request,
        model=model,
        response_id=response_id,
        created=created,
        status="in_progress",
        output=[],
        usage=None,
        incomplete=False,
    )
    emit("response.created", response=skeleton)
    emit("response.in_progress", response=skeleton)
    items = _responses_items(reply, response_id, prompt_ids, TokenAsk.of(request))
    for index, item in enumerate(items):
        item_id = item.get("id", "")
        if item["type"] == "reasoning":
            text = item["summary"][0]["text"]
            emit("response.output_item.added", output_index=index, item={**item, "summary": []})
            part: dict[str, Any] = {"type": "summary_text", "text": ""}
            emit(
                "response.reasoning_summary_part.added",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                part=part,
            )
            for piece in _pieces(text):
                emit(
                    "response.reasoning_summary_text.delta",
                    item_id=item_id,
                    output_index=index,
                    summary_index=0,
                    delta=piece,
                )
            emit(
                "response.reasoning_summary_text.done",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                text=text,
            )
            emit(
                "response.reasoning_summary_part.done",
                item_id=item_id,
                output_index=index,
                summary_index=0,
                part={"type": "summary_text", "text": text},
            )
        elif item["type"] == "message":
            text = item["content"][0]["text"]
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            part = {"type": "output_text", "text": "", "annotations": []}
            emit(
                "response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part
            )
            for piece in _pieces(text):
                emit(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=index,
                    content_index=0,
                    delta=piece,
                    logprobs=[],
                )
            emit(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            emit(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part={**part, "text": text},
            )
        else:
            emit(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            )
            for piece in _pieces(item["arguments"]):
                emit(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=piece
                )
            emit(
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            )
        emit("response.output_item.done", output_index=index, item=item)
    final = responses_body(
        reply,
        request,
        model=model,
        response_id=response_id,
        created=created,
        prompt=prompt,
        prompt_ids=prompt_ids,
    )
    emit("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)
    return events


# --------------------------------------------------------------------------- framing


def _id(key: str, value: str) -> dict[str, str]:
    """``{key: value}``, or nothing for an empty id (a server that sends no ids omits the key)."""
    return {key: value} if value else {}


def _frame(data: Mapping[str, Any], *, event: str | None = None) -> bytes:
    head = b"" if event is None else b"event: " + event.encode() + b"\n"
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def _pieces(text: str | None) -> list[str]:
    if not text:
        return []
    return [text[start : start + _PIECE] for start in range(0, len(text), _PIECE)]
