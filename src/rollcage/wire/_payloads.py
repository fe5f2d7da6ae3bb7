"""The wire: request payloads for both API styles, and their responses read back as Responses items.

The pydantic models here describe only the part of the OpenAI APIs rollcage
reads, and ignore everything else: servers (vLLM, SGLang, NIM, OpenAI) add
fields freely, and a field we do not read must never fail a call. A body that
does not fit even this lenient shape is the server's fault (``WireError``),
which the client classifies as transient.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollcage.protocol import (
    MAX_TOKEN_COUNT,
    CallTokens,
    FunctionToolChoice,
    ModelEndpoint,
    ResponseItem,
    SamplingParams,
    TokenUsage,
)
from rollcage.wire._tokens import read_entries, read_log_probs, read_prompt_log_probs, read_token_ids

__all__ = [
    "LIFTED_FIELDS",
    "CallOutcome",
    "Lenient",
    "WireError",
    "build_request",
    "chat_input_items",
    "chat_messages",
    "chat_tools",
    "parse_chat_completion",
    "parse_payload",
    "parse_response",
    "responses_tools",
    "without_lifted",
]

Api = Literal["chat", "responses"]

LIFTED_FIELDS = ("prompt_token_ids", "prompt_logprobs")
"""Response fields as long as the prompt, moved into ``ModelCall.tokens`` and out of the kept response:
every call's prompt repeats the conversation, and keeping them twice would make each record O(transcript)."""


class WireError(ValueError):
    """A response body that is not JSON, or not shaped like the API's response (the server's fault)."""


class Lenient(BaseModel):
    """Base of the wire models: unknown fields are ignored, never an error; known ones must have their type.

    Validators are built on first use, not at import: a worker that fails before
    its first model call should not pay for them (the protocol models do the same).
    Infinity and NaN are refused like any other number that is not one.
    """

    model_config = ConfigDict(extra="ignore", defer_build=True, allow_inf_nan=False)


_Count = Annotated[int, Field(ge=0, le=MAX_TOKEN_COUNT, strict=True)] | None
"""A token count: a JSON integer within ``0..MAX_TOKEN_COUNT``, or not reported."""


# --------------------------------------------------------------------------- chat completions


class _ChatFunction(Lenient):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class _ChatToolCall(Lenient):
    id: str | None = None
    type: str | None = None
    function: _ChatFunction


class _ContentPart(Lenient):
    type: str | None = None
    text: str | None = None
    refusal: str | None = None


class _TokenBundle(Lenient):
    """Token arrays as NeMo Gym's model servers put them on a message or output item.

    Token data is taken as it came and read strictly by ``rollcage.wire._tokens``:
    a bad array is dropped with a note, it never fails the call.
    """

    prompt_token_ids: Any = None
    generation_token_ids: Any = None
    generation_log_probs: Any = None


class _ChatMessage(_TokenBundle):
    role: str | None = None
    content: str | list[_ContentPart] | None = None
    # vLLM has emitted the reasoning parser's output under both names over its versions.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ChatToolCall] | None = None


class _ChatChoice(Lenient):
    index: int = 0
    message: _ChatMessage
    finish_reason: str | None = None
    # {"content": [{"token", "logprob", ...}, ...]}, read by rollcage.wire._tokens.
    logprobs: Any = None
    # vLLM with return_token_ids: the sampled token ids on the choice, the prompt's on the body.
    token_ids: Any = None


class _CompletionDetails(Lenient):
    reasoning_tokens: _Count = None


class _PromptDetails(Lenient):
    cached_tokens: _Count = None


class _ChatUsage(Lenient):
    prompt_tokens: _Count = None
    completion_tokens: _Count = None
    total_tokens: _Count = None
    completion_tokens_details: _CompletionDetails | None = None
    prompt_tokens_details: _PromptDetails | None = None


class _ChatCompletion(Lenient):
    choices: list[_ChatChoice]
    usage: _ChatUsage | None = None
    prompt_token_ids: Any = None
    # vLLM's prompt_logprobs: per prompt position, None or {token id: {"logprob": ...}, ...}.
    prompt_logprobs: Any = None


# --------------------------------------------------------------------------- responses


class _ResponsesUsage(Lenient):
    input_tokens: _Count = None
    output_tokens: _Count = None
    total_tokens: _Count = None
    input_tokens_details: _PromptDetails | None = None
    output_tokens_details: _CompletionDetails | None = None


class _IncompleteDetails(Lenient):
    reason: str | None = None


class _ResponsesError(Lenient):
    code: str | None = None
    message: str | None = None


class _Item(Lenient):
    """Any output item: only its type is read here; the type's own model reads the rest."""

    type: str | None = None


class _OutputPart(_ContentPart):
    logprobs: Any = None


class _MessageItem(_TokenBundle):
    id: str | None = None
    content: list[_OutputPart] | str | None = None


class _FunctionCallItem(_TokenBundle):
    call_id: str | None = None
    id: str | None = None
    name: str
    arguments: str | dict[str, Any] | None = None


class _ReasoningItem(_TokenBundle):
    id: str | None = None
    summary: list[_ContentPart] | None = None
    content: list[_ContentPart] | None = None
    encrypted_content: str | None = None


class _Response(Lenient):
    status: str | None = None
    output: list[dict[str, Any]]
    usage: _ResponsesUsage | None = None
    incomplete_details: _IncompleteDetails | None = None
    error: _ResponsesError | None = None
    prompt_token_ids: Any = None


class CallOutcome(BaseModel):
    """What one successful HTTP exchange meant, in the terms of ``ModelCall``."""

    model_config = ConfigDict(extra="forbid", defer_build=True)

    status: Literal["completed", "incomplete", "failed"]
    """``failed`` only for a Responses body whose own ``status`` is ``failed``."""
    incomplete_reason: str | None = None
    """The server's word for an incomplete output (``length``, ``max_output_tokens``...)."""
    output: list[ResponseItem]
    """The output as Responses-API items."""
    usage: TokenUsage
    """Token counts as reported; ``None`` where not reported."""
    tokens: CallTokens
    """Token ids and log probabilities as reported; unobserved where not."""
    error_code: str | None = None
    """For ``failed``: the server's error code."""
    error_message: str | None = None
    """For ``failed``: the server's error message."""


# --------------------------------------------------------------------------- requests


def build_request(
    endpoint: ModelEndpoint,
    input: str | Sequence[Mapping[str, Any]],
    *,
    instructions: str | None,
    tools: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """Build the JSON payload of one request in the endpoint's API style.

    Args:
        endpoint: Model name, API style, sampling parameters and streaming flag.
        input: Responses-API input items, or a text taken as one user message.
        instructions: System instructions; ``None`` sends none.
        tools: Responses-style function tools (``{"type": "function", "name", ...}``);
            chat-style tools are accepted too and converted as needed.

    Returns:
        The payload, exactly as it will be sent. ``seed``, ``stop`` and ``logprobs`` are
        sent with Chat Completions only: the Responses API has no such parameters (it
        asks for logprobs with ``include``). ``parallel_tool_calls``, ``tool_choice``,
        ``reasoning`` and ``text`` go out in each API's own terms (``tool_choice_payload``,
        ``chat_reasoning_and_text``); the first two only with tools, as the APIs take
        them only then. ``sampling.extra_body`` follows, as it is.
    """
    items: list[dict[str, Any]] = (
        [{"type": "message", "role": "user", "content": input}]
        if isinstance(input, str)
        else [dict(item) for item in input]
    )
    sampling = endpoint.sampling
    payload: dict[str, Any] = {"model": endpoint.model}
    if endpoint.api == "chat":
        payload["messages"] = chat_messages(items, instructions)
        if tools:
            payload["tools"] = chat_tools(tools)
        optional = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_output_tokens,
            "seed": sampling.seed,
            "stop": sampling.stop,
            "logprobs": sampling.logprobs,
            "top_logprobs": sampling.top_logprobs,
            **chat_reasoning_and_text(sampling),
        }
        if endpoint.stream:
            payload["stream"] = True
            # Without this, usage is never reported on a stream.
            payload["stream_options"] = {"include_usage": True}
    else:
        payload["input"] = items
        if instructions is not None:
            payload["instructions"] = instructions
        if tools:
            payload["tools"] = responses_tools(tools)
        optional = {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_output_tokens": sampling.max_output_tokens,
            "top_logprobs": sampling.top_logprobs,
            "reasoning": sampling.reasoning.model_dump(exclude_none=True) if sampling.reasoning else None,
            "text": sampling.text.model_dump(exclude_none=True, by_alias=True) if sampling.text else None,
        }
        if sampling.logprobs:
            payload["include"] = ["message.output_text.logprobs"]
        if endpoint.stream:
            payload["stream"] = True
    if tools:  # both APIs take these only beside tools (without tools no call can be made anyway)
        optional["parallel_tool_calls"] = sampling.parallel_tool_calls
        optional["tool_choice"] = tool_choice_payload(sampling.tool_choice, api=endpoint.api)
    payload.update({key: value for key, value in optional.items() if value is not None})
    # Validated on the way in: no key of extra_body is one rollcage sets (RESERVED_REQUEST_FIELDS).
    payload.update(sampling.extra_body)
    return payload


def tool_choice_payload(choice: str | FunctionToolChoice | None, *, api: Literal["chat", "responses"]) -> Any:
    """``tool_choice`` as the API spells it: the same words on both; one named function differs."""
    if choice is None or isinstance(choice, str):
        return choice
    if api == "chat":
        return {"type": "function", "function": {"name": choice.name}}
    return {"type": "function", "name": choice.name}


def chat_reasoning_and_text(sampling: SamplingParams) -> dict[str, Any]:
    """``reasoning`` and ``text`` in Chat Completions' terms: ``reasoning_effort``, ``response_format``,
    ``verbosity`` (reasoning summaries have no chat form: a chat server returns reasoning as it does)."""
    fields: dict[str, Any] = {}
    if sampling.reasoning is not None and sampling.reasoning.effort is not None:
        fields["reasoning_effort"] = sampling.reasoning.effort
    text = sampling.text
    if text is not None and text.format is not None:
        if text.format.type == "json_schema":
            schema = text.format.model_dump(exclude_none=True, by_alias=True, exclude={"type"})
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        else:
            fields["response_format"] = {"type": text.format.type}
    if text is not None and text.verbosity is not None:
        fields["verbosity"] = text.verbosity
    return fields


def chat_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Convert Responses-style function tools to Chat Completions tools (chat-style ones pass through)."""
    converted: list[dict[str, Any]] = []
    for tool in tools:
        if tool.get("type") == "function" and "function" not in tool:
            function = {
                key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool
            }
            converted.append({"type": "function", "function": function})
        else:
            converted.append(dict(tool))
    return converted


def responses_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Convert chat-style function tools to Responses tools (Responses-style ones pass through).

    A function tool that does not say ``strict`` is sent with ``strict: false``:
    the Responses API defaults it to true, which rejects any parameter schema
    not written for strict mode, while Chat Completions defaults it to false.
    """
    converted: list[dict[str, Any]] = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type") == "function" and isinstance(function, Mapping):
            converted.append({"type": "function", **function})
        else:
            converted.append(dict(tool))
        if converted[-1].get("type") == "function":
            converted[-1].setdefault("strict", False)
    return converted


def chat_messages(items: Sequence[Mapping[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Convert Responses-API input items to Chat Completions messages.

    A run of consecutive model items (assistant ``message``, ``function_call``,
    ``reasoning``) becomes one assistant message, so one model turn stays one
    turn. Reasoning items are dropped: chat templates do not take reasoning back
    as input. ``function_call_output`` items become ``tool`` messages.

    Raises:
        ValueError: an item has an unknown type or lacks a required field.
    """
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    turn: dict[str, Any] | None = None  # the assistant message being assembled
    for item in items:
        kind = item.get("type", "message")
        role = item.get("role")
        is_model_item = kind in ("function_call", "reasoning") or (kind == "message" and role == "assistant")
        if not is_model_item:
            turn = None
        if kind == "message":
            text_or_parts = _chat_content(item.get("content", ""))
            if role == "assistant":
                if turn is None:
                    turn = {"role": "assistant", "content": None}
                    messages.append(turn)
                turn["content"] = _join_text(turn["content"], text_or_parts)
            else:
                messages.append({"role": role or "user", "content": text_or_parts})
        elif kind == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            turn.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "")},
                }
            )
        elif kind == "reasoning":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": output if isinstance(output, str) else json.dumps(output),
                }
            )
        else:
            raise ValueError(f"input item of type {kind!r} cannot be sent to a Chat Completions endpoint")
    # An assistant turn made of reasoning alone would be an empty message; chat servers reject those.
    return [
        m
        for m in messages
        if not (m["role"] == "assistant" and m["content"] is None and "tool_calls" not in m)
    ]


def chat_input_items(messages: Any) -> list[ResponseItem] | None:
    """Read Chat Completions messages back as Responses-API input items (``chat_messages``' inverse).

    For a request rollcage did not build (a harness's): the items ``ModelCall.input``
    holds for a chat call. System and developer messages stay messages of their role,
    an assistant message becomes its text (``output_text``) and its ``function_call``
    items, a ``tool`` message a ``function_call_output``. Text is kept as sent.

    Returns:
        The items, or ``None`` when ``messages`` is not a list of messages this can
        read faithfully (the wire request is the evidence then).
    """
    if not isinstance(messages, list):
        return None
    items: list[ResponseItem] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return None
        role, content = message["role"], message.get("content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                return None
            output = _text_of(content)
            if output is None:
                return None
            items.append({"type": "function_call_output", "call_id": call_id, "output": output})
        elif role == "assistant":
            text = _text_of(content) if content is not None else ""
            if text is None:
                return None
            if text:
                items.append(_message_item(text))
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                return None
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(call.get("id"), str):
                    return None
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": str(function.get("name", "")),
                        "arguments": _raw_arguments(function.get("arguments")),
                    }
                )
        else:
            parts = _input_parts(content)
            if parts is None:
                return None
            items.append({"type": "message", "role": role, "content": parts})
    return items


def _text_of(content: Any) -> str | None:
    """Chat content as text: a string, or text parts joined; ``None`` for anything else."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def _input_parts(content: Any) -> str | list[dict[str, Any]] | None:
    """A user/system message's chat content as Responses content (``_chat_content``'s inverse)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return None
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "input_text", "text": part["text"]})
        elif kind == "image_url" and isinstance(part.get("image_url"), dict):
            parts.append({"type": "input_image", "image_url": str(part["image_url"].get("url", ""))})
        else:
            return None
    return parts


def _chat_content(content: Any) -> str | list[dict[str, Any]]:
    """Responses content (text or parts) as chat content: a string when it is all text."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": part.get("text", "")})
        elif kind == "input_image":
            parts.append({"type": "image_url", "image_url": {"url": part.get("image_url", "")}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": part.get("refusal", "")})
        else:
            raise ValueError(f"content part of type {kind!r} cannot be sent to a Chat Completions endpoint")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _join_text(before: Any, more: str | list[dict[str, Any]]) -> Any:
    """Concatenate assistant content: two model messages in one turn become one chat message."""
    if before is None:
        return more
    if isinstance(before, str) and isinstance(more, str):
        return before + more
    as_parts = [before] if isinstance(before, str) else before
    return [*as_parts, *([{"type": "text", "text": more}] if isinstance(more, str) else more)]


# --------------------------------------------------------------------------- responses read back


def parse_payload(api: Api, payload: Mapping[str, Any]) -> CallOutcome:
    """Read one response payload of either API style; see ``parse_chat_completion``/``parse_response``."""
    return parse_chat_completion(payload) if api == "chat" else parse_response(payload)


def parse_chat_completion(payload: Mapping[str, Any]) -> CallOutcome:
    """Read a Chat Completions response (or an assembled stream) as Responses items.

    The first choice is the answer (rollcage never asks for ``n > 1``). Output
    order: reasoning, message, function calls. A message item is emitted when
    the server sent content (even empty) or when nothing else was produced.
    ``finish_reason`` ``length`` or ``content_filter`` makes the call
    ``incomplete`` with that reason. A function call's ``call_id`` is the
    server's id, or ``None`` where it sent none: ids are the agent's to assign.
    Token data: vLLM's ``prompt_token_ids`` (body) and ``token_ids`` (choice), the
    choice's ``logprobs`` (their tokens give the ids when written ``token_id:N``)
    and ``prompt_logprobs``, or NeMo Gym's arrays on the message.

    Raises:
        WireError: the payload is not shaped like a chat completion, or a field
            rollcage reads has the wrong JSON type.
    """
    body = _validate(_ChatCompletion, payload, "a chat completion")
    if not body.choices:
        raise WireError("not a chat completion: 'choices' is empty")
    choice = body.choices[0]
    message = choice.message
    output: list[ResponseItem] = []
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning:
        output.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]})
    text = _chat_text(message.content)
    calls = message.tool_calls or []
    if text is not None and (text or not calls):
        output.append(_message_item(text))
    for call in calls:
        output.append(_function_call_item(call.id, call.function.name or "", call.function.arguments))
    finish = choice.finish_reason
    incomplete = finish in ("length", "content_filter")
    usage = body.usage
    return CallOutcome(
        status="incomplete" if incomplete else "completed",
        incomplete_reason=finish if incomplete else None,
        output=output,
        tokens=_chat_tokens(body, choice),
        usage=TokenUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            reasoning_tokens=usage.completion_tokens_details.reasoning_tokens
            if usage.completion_tokens_details
            else None,
            cached_tokens=usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None,
        )
        if usage is not None
        else TokenUsage(),
    )


def parse_response(payload: Mapping[str, Any]) -> CallOutcome:
    """Read a Responses API response object as normalised Responses items.

    Messages keep their ``output_text`` parts (annotations dropped; logprobs go to
    ``tokens``), function calls keep ``call_id`` (the server's, ``None`` where it
    sent none), ``name`` and the raw ``arguments``, reasoning keeps its summary
    (or, as vLLM emits it, its ``reasoning_text`` content as the summary); every
    item keeps the server's ``id``. Other item types pass through. Token data:
    NeMo Gym's arrays on the items (``prompt_token_ids``, ``generation_token_ids``,
    ``generation_log_probs``), else the ``output_text`` parts' logprobs.

    Raises:
        WireError: the payload is not shaped like a response object, or a field
            rollcage reads has the wrong JSON type.
    """
    body = _validate(_Response, payload, "a response object")
    output: list[ResponseItem] = []
    bundles: list[tuple[int, _TokenBundle]] = []
    text_logprobs: list[tuple[str, Any]] = []
    for position, raw in enumerate(body.output):
        where = f"a response object (output[{position}])"
        kind = _validate(_Item, raw, where).type
        if kind == "message":
            message = _validate(_MessageItem, raw, where)
            bundles.append((position, message))
            parts = [message.content] if isinstance(message.content, str) else message.content or []
            texts = [
                part
                if isinstance(part, str)
                else (part.text or "" if part.type == "output_text" else part.refusal or "")
                for part in parts
                if isinstance(part, str) or part.type in ("output_text", "refusal")
            ]
            for number, part in enumerate(parts):
                if isinstance(part, _OutputPart) and part.logprobs is not None:
                    text_logprobs.append((f"output[{position}].content[{number}].logprobs", part.logprobs))
            output.append(_message_item("".join(texts), message.id))
        elif kind == "function_call":
            call = _validate(_FunctionCallItem, raw, where)
            bundles.append((position, call))
            item = _function_call_item(call.call_id or call.id, call.name, call.arguments)
            output.append({**item, "id": call.id} if call.id else item)
        elif kind == "reasoning":
            reasoning_item = _validate(_ReasoningItem, raw, where)
            bundles.append((position, reasoning_item))
            output.append(_reasoning_item(reasoning_item))
        else:
            output.append(dict(raw))
    usage = body.usage
    status = body.status or "completed"
    error = body.error
    tokens = _responses_tokens(body.prompt_token_ids, bundles, text_logprobs)
    if status == "failed":
        return CallOutcome(
            status="failed",
            output=output,
            usage=_responses_usage(usage),
            tokens=tokens,
            error_code=error.code if error else None,
            error_message=error.message if error else None,
        )
    if status == "incomplete":
        reason = body.incomplete_details.reason if body.incomplete_details else None
        return CallOutcome(
            status="incomplete",
            incomplete_reason=reason or "unknown",
            output=output,
            usage=_responses_usage(usage),
            tokens=tokens,
        )
    if status != "completed":
        # queued/in_progress/cancelled: rollcage never asks for background mode, so this is a broken answer.
        raise WireError(f"response status {status!r} is not a final status")
    return CallOutcome(status="completed", output=output, usage=_responses_usage(usage), tokens=tokens)


def _reasoning_item(item: _ReasoningItem) -> ResponseItem:
    summary = [
        {"type": "summary_text", "text": part.text or ""}
        for part in item.summary or []
        if part.type == "summary_text"
    ]
    if not summary:
        text = "".join(
            part.text or "" for part in item.content or [] if part.type in ("reasoning_text", "text")
        )
        summary = [{"type": "summary_text", "text": text}] if text else []
    reasoning: ResponseItem = {"type": "reasoning", "summary": summary}
    if item.id:
        reasoning["id"] = item.id
    if item.encrypted_content:
        reasoning["encrypted_content"] = item.encrypted_content
    return reasoning


# --------------------------------------------------------------------------- token data


def _chat_tokens(body: _ChatCompletion, choice: _ChatChoice) -> CallTokens:
    """Token data of a chat answer: vLLM's (prompt_token_ids, token_ids, logprobs) or NeMo Gym's bundle."""
    notes: list[str] = []
    message = choice.message
    if body.prompt_token_ids is not None:
        prompt = read_token_ids(body.prompt_token_ids, "prompt_token_ids", notes)
    else:
        prompt = read_token_ids(message.prompt_token_ids, "choices[0].message.prompt_token_ids", notes)
    given_ids, ids_at = choice.token_ids, "choices[0].token_ids"
    if given_ids is None:
        given_ids, ids_at = message.generation_token_ids, "choices[0].message.generation_token_ids"
    ids = read_token_ids(given_ids, ids_at, notes)
    given_probs = message.generation_log_probs
    probs = read_log_probs(given_probs, "choices[0].message.generation_log_probs", notes)
    logprobs = choice.logprobs
    entries: Any = None
    if isinstance(logprobs, dict):
        entries = logprobs.get("content")
    elif logprobs is not None and (given_ids is None or given_probs is None):
        # Malformed, and needed: the arrays above left ids or logprobs to it.
        notes.append(f"choices[0].logprobs is {type(logprobs).__name__}, not an object; it was dropped")
    if entries is not None and (given_ids is None or given_probs is None):
        # The entries are read only for what the arrays above did not give.
        entry_ids, entry_probs = read_entries(
            entries, "choices[0].logprobs.content", notes, ids=given_ids is None, probs=given_probs is None
        )
        ids = entry_ids if given_ids is None else ids
        probs = entry_probs if given_probs is None else probs
    prompt_probs = read_prompt_log_probs(body.prompt_logprobs, prompt, "prompt_logprobs", notes)
    return _tokens(prompt, ids, probs, prompt_probs, "generation", notes)


def _responses_tokens(
    prompt_given: Any, bundles: list[tuple[int, _TokenBundle]], text_logprobs: list[tuple[str, Any]]
) -> CallTokens:
    """Token data of a Responses answer: NeMo Gym's arrays on its items, else output_text logprobs."""
    notes: list[str] = []
    carrying = [
        (position, b)
        for position, b in bundles
        if b.generation_token_ids is not None or b.generation_log_probs is not None
    ]
    if carrying:
        # One call's generation, spread over its items (NeMo Gym puts it on the item that carries it).
        given = next(((p, b.prompt_token_ids) for p, b in carrying if b.prompt_token_ids is not None), None)
        if given is not None:
            prompt = read_token_ids(given[1], f"output[{given[0]}].prompt_token_ids", notes)
        else:
            prompt = read_token_ids(prompt_given, "prompt_token_ids", notes)
        ids = _joined(
            [
                read_token_ids(b.generation_token_ids, f"output[{p}].generation_token_ids", notes)
                for p, b in carrying
            ]
        )
        probs = _joined(
            [
                read_log_probs(b.generation_log_probs, f"output[{p}].generation_log_probs", notes)
                for p, b in carrying
            ]
        )
        return _tokens(prompt, ids, probs, None, "generation", notes)
    prompt = read_token_ids(prompt_given, "prompt_token_ids", notes)
    if text_logprobs:
        read = [read_entries(entries, where, notes) for where, entries in text_logprobs]
        ids = _joined([part_ids for part_ids, _ in read])
        values = _joined([part_probs for _, part_probs in read])
        return _tokens(prompt, ids, values, None, "message_text", notes)
    return _tokens(prompt, None, None, None, "generation", notes)


_T = TypeVar("_T")


def _joined(parts: list[list[_T] | None]) -> list[_T] | None:
    if any(part is None for part in parts):
        return None
    return [value for part in parts if part is not None for value in part]


def _tokens(
    prompt: list[int] | None,
    ids: list[int] | None,
    probs: list[float] | None,
    prompt_probs: list[float | None] | None,
    scope: Literal["generation", "message_text"],
    notes: list[str],
) -> CallTokens:
    """The call's CallTokens; arrays that are invalid or contradict each other are dropped, with notes."""
    if ids is not None and probs is not None and len(ids) != len(probs):
        notes.append(
            f"the server returned {len(ids)} generation token ids and {len(probs)} log probabilities; "
            "the log probabilities were not kept"
        )
        probs = None
    if prompt is not None and prompt_probs is not None and len(prompt) != len(prompt_probs):
        notes.append(
            f"the server returned {len(prompt)} prompt token ids and {len(prompt_probs)} prompt log "
            "probabilities; the prompt log probabilities were not kept"
        )
        prompt_probs = None
    return CallTokens(
        prompt_token_ids=prompt,
        generation_token_ids=ids,
        generation_log_probs=probs,
        prompt_log_probs=prompt_probs,
        scope=scope,
        note="; ".join(notes) or None,
    )


def without_lifted(api: Api, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The response payload without the prompt-long arrays that ``tokens`` holds (``LIFTED_FIELDS``).

    Copies only what it changes: the top level, and the first choice's message (chat)
    or the output items (Responses) that carry a NeMo Gym token bundle.
    """
    kept = {key: value for key, value in payload.items() if key not in LIFTED_FIELDS}
    if api == "chat":
        choices = kept.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            if isinstance(message, dict) and "prompt_token_ids" in message:
                first = {
                    **choices[0],
                    "message": {k: v for k, v in message.items() if k != "prompt_token_ids"},
                }
                kept["choices"] = [first, *choices[1:]]
        return kept
    items = kept.get("output")
    if isinstance(items, list) and any(isinstance(i, dict) and "prompt_token_ids" in i for i in items):
        kept["output"] = [
            {k: v for k, v in item.items() if k != "prompt_token_ids"} if isinstance(item, dict) else item
            for item in items
        ]
    return kept


_M = TypeVar("_M", bound=BaseModel)


def _validate(model: type[_M], value: Any, what: str) -> _M:
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise WireError(f"not {what}: {_first_error(exc)}") from exc


def _function_call_item(
    server_id: str | None, name: str, arguments: str | dict[str, Any] | None
) -> ResponseItem:
    return {
        "type": "function_call",
        "call_id": server_id,
        "name": name,
        "arguments": _raw_arguments(arguments),
    }


def _responses_usage(usage: _ResponsesUsage | None) -> TokenUsage:
    if usage is None:
        return TokenUsage()
    return TokenUsage(
        input_tokens=usage.input_tokens,
        output_tokens=usage.output_tokens,
        total_tokens=usage.total_tokens,
        reasoning_tokens=usage.output_tokens_details.reasoning_tokens
        if usage.output_tokens_details
        else None,
        cached_tokens=usage.input_tokens_details.cached_tokens if usage.input_tokens_details else None,
    )


def _chat_text(content: str | list[_ContentPart] | None) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content if part.type in ("text", "output_text"))


def _message_item(text: str, item_id: str | None = None) -> ResponseItem:
    item: ResponseItem = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }
    if item_id:
        item["id"] = item_id
    return item


def _raw_arguments(arguments: str | dict[str, Any] | None) -> str:
    # Kept verbatim even when it is not valid JSON: whether that is usable is the agent's decision.
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(part) for part in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
