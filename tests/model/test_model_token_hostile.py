"""Hostile token data at the wire: only int64 ids >= 0 and finite log probabilities <= 0 are kept.

Whatever a server puts where token data goes (vLLM's ``token_ids``/``prompt_token_ids``,
its ``logprobs`` entries and their ``token_id:N`` tokens, ``prompt_logprobs``, NeMo Gym's
arrays on messages and items), in both API styles, streamed or not, the call stands: what
is invalid is dropped with a note naming the field, the token data is never ``observed``
then, and the record always crosses the journal (orjson) and the exporters.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage.durable import CheckpointJournal, read_journal
from rollcage.errors import TransientModelError
from rollcage.export._atif import _metrics
from rollcage.model import ModelClient, failed_call
from rollcage.protocol import MAX_TOKEN_ID, CallTokens, ModelCall, ModelEndpoint
from rollcage.wire import parse_payload

USER = [{"type": "message", "role": "user", "content": "hi"}]
BIG = 2**70


def _chat(*, body: dict[str, Any] | None = None, choice: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        **(body or {}),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                **(choice or {}),
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


def _entries(tokens: list[Any], probs: list[Any]) -> dict[str, Any]:
    return {"content": [{"token": t, "logprob": p} for t, p in zip(tokens, probs, strict=True)]}


GOOD = {"prompt_token_ids": [1, 2, 3]}
HOSTILE = {
    # vLLM's return_tokens_as_token_ids form, the example: an id beyond 64 bits
    "token-id-string-2^70": (
        _chat(body=GOOD, choice={"logprobs": _entries([f"token_id:{BIG}", "token_id:5"], [-0.1, -0.2])}),
        "choices[0].logprobs.content[0].token",
    ),
    "token-id-string-2^63": (
        _chat(body=GOOD, choice={"logprobs": _entries([f"token_id:{MAX_TOKEN_ID + 1}"], [-0.1])}),
        "choices[0].logprobs.content[0].token",
    ),
    "token-id-string-negative": (
        _chat(body=GOOD, choice={"logprobs": _entries(["token_id:-4"], [-0.1])}),
        "choices[0].logprobs.content[0].token",
    ),
    "token-id-string-non-ascii-digits": (
        _chat(body=GOOD, choice={"logprobs": _entries(["token_id:٣"], [-0.1])}),
        "choices[0].logprobs.content[0].token",
    ),
    "token-id-string-underscores": (
        _chat(body=GOOD, choice={"logprobs": _entries(["token_id:1_000"], [-0.1])}),
        "choices[0].logprobs.content[0].token",
    ),
    "token-id-strings-mixed-with-text": (
        _chat(body=GOOD, choice={"logprobs": _entries(["token_id:4", "hi"], [-0.1, -0.2])}),
        "choices[0].logprobs.content[1].token",
    ),
    "ids-as-strings": (_chat(body=GOOD, choice={"token_ids": ["7", "8"]}), "choices[0].token_ids[0]"),
    "ids-as-booleans": (_chat(body=GOOD, choice={"token_ids": [True, 8]}), "choices[0].token_ids[0]"),
    "ids-as-floats": (_chat(body=GOOD, choice={"token_ids": [7.0]}), "choices[0].token_ids[0]"),
    "negative-ids": (_chat(body=GOOD, choice={"token_ids": [7, -1]}), "choices[0].token_ids[1]"),
    "ids-at-2^63": (_chat(body=GOOD, choice={"token_ids": [MAX_TOKEN_ID + 1]}), "choices[0].token_ids[0]"),
    "ids-beyond-64-bits": (_chat(body=GOOD, choice={"token_ids": [BIG]}), "choices[0].token_ids[0]"),
    "prompt-ids-negative": (_chat(body={"prompt_token_ids": [1, -2]}), "prompt_token_ids[1]"),
    "positive-logprob": (
        _chat(body=GOOD, choice={"token_ids": [7], "logprobs": _entries(["a"], [0.5])}),
        "choices[0].logprobs.content[0].logprob",
    ),
    "nan-logprob": (
        _chat(body=GOOD, choice={"token_ids": [7], "logprobs": _entries(["a"], [math.nan])}),
        "choices[0].logprobs.content[0].logprob",
    ),
    "minus-infinity-logprob": (
        _chat(body=GOOD, choice={"token_ids": [7], "logprobs": _entries(["a"], [-math.inf])}),
        "choices[0].logprobs.content[0].logprob",
    ),
    "boolean-logprob": (
        _chat(body=GOOD, choice={"token_ids": [7], "logprobs": _entries(["a"], [False])}),
        "choices[0].logprobs.content[0].logprob",
    ),
    "logprobs-not-an-object": (_chat(body=GOOD, choice={"logprobs": [1, 2]}), "choices[0].logprobs"),
    "prompt-logprob-positive": (
        _chat(body={**GOOD, "prompt_logprobs": [None, {"2": {"logprob": 3.0}}, None]}),
        "prompt_logprobs[1]",
    ),
    "nemo-gym-generation-ids-negative": (
        _chat(
            body=GOOD, choice={"message": {"role": "assistant", "content": "x", "generation_token_ids": [-3]}}
        ),
        "choices[0].message.generation_token_ids[0]",
    ),
    "nemo-gym-log-probs-positive": (
        _chat(
            body=GOOD,
            choice={
                "message": {
                    "role": "assistant",
                    "content": "x",
                    "generation_token_ids": [3],
                    "generation_log_probs": [1.5],
                }
            },
        ),
        "choices[0].message.generation_log_probs[0]",
    ),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_invalid_token_data_is_dropped_with_a_note_naming_the_field_and_the_call_stands(name: str) -> None:
    payload, field = HOSTILE[name]
    outcome = parse_payload("chat", payload)
    assert outcome.status == "completed"
    tokens = outcome.tokens
    assert tokens.status != "observed" and tokens.note is not None and field in tokens.note
    _assert_kept_values_are_valid(tokens)
    # What is kept crosses the journal and comes back the same.
    assert CallTokens.model_validate_json(orjson.dumps(tokens.model_dump(mode="json"))) == tokens


def test_the_responses_api_token_shapes_are_read_as_strictly() -> None:
    message = {
        "type": "message",
        "id": "m",
        "content": [
            {"type": "output_text", "text": "hi", "logprobs": [{"token": f"token_id:{BIG}", "logprob": 0}]}
        ],
    }
    outcome = parse_payload(
        "responses", {"status": "completed", "output": [message], "prompt_token_ids": [True]}
    )
    assert outcome.status == "completed"
    assert outcome.tokens.prompt_token_ids is None and outcome.tokens.generation_token_ids is None
    assert outcome.tokens.generation_log_probs == [0.0] and outcome.tokens.status == "partial"
    note = outcome.tokens.note or ""
    assert "prompt_token_ids[0]" in note and "output[0].content[0].logprobs[0].token" in note
    item = {**message, "generation_token_ids": [1, 2], "generation_log_probs": [-0.1, float("inf")]}
    outcome = parse_payload("responses", {"status": "completed", "output": [item]})
    assert outcome.tokens.generation_log_probs is None and "output[0].generation_log_probs[1]" in (
        outcome.tokens.note or ""
    )


def test_valid_token_data_at_the_int64_edge_is_kept_observed() -> None:
    payload = _chat(
        body={"prompt_token_ids": [0, MAX_TOKEN_ID]},
        choice={"logprobs": _entries([f"token_id:{MAX_TOKEN_ID}", "token_id:0"], [0, -1e300])},
    )
    tokens = parse_payload("chat", payload).tokens
    assert tokens.status == "observed" and tokens.note is None
    assert tokens.generation_token_ids == [MAX_TOKEN_ID, 0] and tokens.generation_log_probs == [0.0, -1e300]


# ----------------------------------------------------------------------------- properties

_ODD_STRINGS = st.sampled_from(
    [
        f"token_id:{BIG}",
        f"token_id:{MAX_TOKEN_ID}",
        f"token_id:{MAX_TOKEN_ID + 1}",
        "token_id:-1",
        "token_id: 5",
        "token_id:+5",
        "token_id:1_0",
        "token_id:٣",
        "token_id:",
        "token_id:7",
        "7",
        "",
    ]
)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=MAX_TOKEN_ID),
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    _ODD_STRINGS,
)
_VALUES = st.one_of(_SCALARS, st.dictionaries(st.text(max_size=3), _SCALARS, max_size=2))
_ARRAYS = st.one_of(st.lists(_VALUES, max_size=4), _SCALARS)
_ENTRIES = st.one_of(
    st.lists(st.fixed_dictionaries({"token": _VALUES, "logprob": _VALUES}), max_size=4),
    st.lists(_VALUES, max_size=2),
    _SCALARS,
)
_PROMPT_LOGPROBS = st.one_of(
    st.lists(
        st.one_of(st.none(), st.dictionaries(_ODD_STRINGS, st.fixed_dictionaries({"logprob": _VALUES}))),
        max_size=4,
    ),
    _SCALARS,
)


@st.composite
def _chat_payloads(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {}
    choice: dict[str, Any] = {}
    message: dict[str, Any] = {"role": "assistant", "content": "hi"}
    for target, key, values in (
        (body, "prompt_token_ids", _ARRAYS),
        (body, "prompt_logprobs", _PROMPT_LOGPROBS),
        (choice, "token_ids", _ARRAYS),
        (choice, "logprobs", st.one_of(st.fixed_dictionaries({"content": _ENTRIES}), _SCALARS)),
        (message, "prompt_token_ids", _ARRAYS),
        (message, "generation_token_ids", _ARRAYS),
        (message, "generation_log_probs", _ARRAYS),
    ):
        if draw(st.booleans()):
            target[key] = draw(values)
    return _chat(body=body, choice={**choice, "message": message})


@st.composite
def _responses_payloads(draw: st.DrawFn) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": "hi"}
    if draw(st.booleans()):
        part["logprobs"] = draw(_ENTRIES)
    item: dict[str, Any] = {"type": "message", "id": "m", "role": "assistant", "content": [part]}
    for key in ("prompt_token_ids", "generation_token_ids", "generation_log_probs"):
        if draw(st.booleans()):
            item[key] = draw(_ARRAYS)
    payload: dict[str, Any] = {"id": "r", "object": "response", "status": "completed", "output": [item]}
    if draw(st.booleans()):
        payload["prompt_token_ids"] = draw(_ARRAYS)
    return payload


def _assert_kept_values_are_valid(tokens: CallTokens) -> None:
    for ids in (tokens.prompt_token_ids, tokens.generation_token_ids):
        assert ids is None or all(type(i) is int and 0 <= i <= MAX_TOKEN_ID for i in ids)
    for probs in (tokens.generation_log_probs, tokens.prompt_log_probs):
        assert probs is None or all(
            p is None or (type(p) is float and math.isfinite(p) and p <= 0) for p in probs
        )


def _journal_and_export(call: ModelCall, directory: Path) -> None:
    """The record crosses the checkpoint journal (orjson) and back, and the exporters take it."""
    path = directory / "checkpoint.jsonl"
    path.unlink(missing_ok=True)

    async def journal() -> None:
        async with CheckpointJournal(path, inline=True) as writer:
            await writer.append({"kind": "model_call", "model_call": call.model_dump(mode="json")})

    asyncio.run(journal())
    [line] = read_journal(path)
    assert ModelCall.model_validate(line["model_call"]) == call
    orjson.dumps(_metrics([call]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(api=st.sampled_from(["chat", "responses"]), data=st.data())
def test_any_token_values_parse_to_a_kept_subset_that_is_valid_and_serialisable(
    api: str, data: st.DataObject, tmp_path: Path
) -> None:
    payload = data.draw(_chat_payloads() if api == "chat" else _responses_payloads())
    outcome = parse_payload(api, payload)  # type: ignore[arg-type]
    tokens = outcome.tokens
    _assert_kept_values_are_valid(tokens)
    assert tokens.status != "observed" or tokens.note is None or "not kept" in tokens.note
    assert CallTokens.model_validate_json(orjson.dumps(tokens.model_dump(mode="json"))) == tokens


def _sse(api: str, payload: dict[str, Any]) -> bytes:
    """The payload as a stream: chat's token data spread over two chunks, Responses' in its final event."""
    if api == "responses":
        done = {"type": "response.completed", "response": payload}
        return b"data: " + orjson.dumps(done) + b"\n\ndata: [DONE]\n\n"
    choice = payload["choices"][0]
    head = {k: v for k, v in payload.items() if k not in ("choices", "usage")}
    share: dict[str, Any] = {k: choice[k] for k in ("token_ids", "logprobs") if k in choice}
    first = {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "h"}, **share}]}
    second = {"choices": [{"index": 0, "delta": {"content": "i"}, "finish_reason": "stop", **share}]}
    usage = {"choices": [], "usage": payload["usage"]}
    return (
        b"".join(b"data: " + orjson.dumps(event) + b"\n\n" for event in (first, second, usage))
        + b"data: [DONE]\n\n"
    )


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(api=st.sampled_from(["chat", "responses"]), stream=st.booleans(), data=st.data())
def test_any_token_values_on_the_wire_end_in_a_classified_call_that_journals_and_exports(
    api: str, stream: bool, data: st.DataObject, tmp_path: Path
) -> None:
    payload = data.draw(_chat_payloads() if api == "chat" else _responses_payloads())
    try:
        # What a server can put on the wire: JSON has no NaN, Infinity or >64-bit integers for orjson.
        body = orjson.dumps(payload) if not stream else _sse(api, payload)
    except orjson.JSONEncodeError:
        # The standard library writes what orjson will not (>64-bit integers, NaN): a server could.
        body = json.dumps(payload, default=str).encode() if not stream else b"data: {oops\n\n"
    kind = "text/event-stream" if stream else "application/json"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": kind})
    )
    endpoint = ModelEndpoint(base_url="http://model/v1", model="m", max_retries=0, api=api, stream=stream)  # type: ignore[arg-type]

    async def call() -> ModelCall:
        async with ModelClient(endpoint, rollout_id="r", task_id="t", transport=transport) as client:
            return await client.call(USER, index=0)

    try:
        record = asyncio.run(call())
    except TransientModelError as exc:  # a body that is no answer at all: the server's fault, with its record
        failed = failed_call(exc)
        assert failed is not None and failed.status == "failed"
        record = failed
    else:
        assert record.status == "completed"
        _assert_kept_values_are_valid(record.tokens)
    _journal_and_export(record, tmp_path)


# ----------------------------------------------------------------------------- the scripted policy's family

FAMILY_SCRIPT = {"tasks": {"*": [{"reasoning": "r", "text": "42"}]}}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_every_bad_tokens_variant_of_the_scripted_policy_is_dropped_and_the_answer_kept(
    api: str, stream: bool, tmp_path: Path
) -> None:
    from rollcage.policy import PolicyServer
    from rollcage.policy._hostile import BAD_TOKENS

    rules = [f"task=v{n}:kind=bad_tokens:variant={n}" for n in range(len(BAD_TOKENS))]
    with PolicyServer(FAMILY_SCRIPT, faults=rules) as server:
        endpoint = server.endpoint(api=api, stream=stream, max_retries=0, timeout_s=10.0)  # type: ignore[arg-type]
        for n, (name, _) in enumerate(BAD_TOKENS):
            async with ModelClient(endpoint, rollout_id=f"r{n}", task_id=f"v{n}") as client:
                call = await client.call(USER, index=0)
            assert call.status == "completed", name
            assert call.output[-1]["content"][0]["text"] == "42", name
            assert call.tokens.status != "observed" and call.tokens.note, (name, call.tokens)
            await asyncio.to_thread(_journal_and_export, call, tmp_path)


def test_entries_read_only_for_what_the_arrays_did_not_give_add_no_false_note() -> None:
    # Ids from token_ids; the entries give only the log probabilities: their odd tokens are not read.
    payload = _chat(body=GOOD, choice={"token_ids": [7], "logprobs": _entries([f"token_id:{BIG}"], [-0.5])})
    tokens = parse_payload("chat", payload).tokens
    assert (tokens.status, tokens.note, tokens.generation_token_ids) == ("observed", None, [7])
