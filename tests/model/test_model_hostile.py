"""The model client against hostile servers: every wire-level surprise is classified, none escapes.

One scripted policy server plays every variant of every hostile kind (see
``rollcage.policy._hostile``) in both API styles, streamed and not. What must hold:

* a broken answer (wrong JSON types, broken SSE framing, a stream of only
  ``[DONE]``, nesting too deep, a stream under a JSON label) is a
  ``TransientModelError`` after the bounded retries, never another exception;
* an error the server reports about the credentials is a ``TransientModelError``
  (infrastructure) at once, not retried;
* legal-but-odd framing and trickled bytes give exactly the clean answer.

Property tests then mutate valid payloads and streams *anywhere* and check that
the parsers either read them or raise ``WireError``: nothing else.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage.errors import ModelError, TransientModelError
from rollcage.model import ModelClient, failed_call
from rollcage.policy import PolicyServer
from rollcage.policy._render import chat_body, chat_events, reply_for, responses_body, responses_events
from rollcage.policy._script import Turn
from rollcage.protocol import ModelCall
from rollcage.wire import ServerEventError, WireError, assemble_stream, parse_payload, sse_events, sse_lines

SCRIPT = {
    "tasks": {
        "t": [
            {
                "reasoning": "think, then call",
                "text": "Calling, with a comma, and more",
                "tool_calls": [{"name": "python", "arguments": {"code": "print('a, b')"}}],
            }
        ]
    }
}
RETRIES = 1
REJECTED = {  # kind -> variants; every one must be refused as malformed (retried, then transient)
    "wrong_types": 8,
    "no_answer": 1,
    "deep": 1,
}
STREAM_ONLY_REJECTED = {"bad_sse": 3, "lying_type": 1}  # a whole-body request reads these fine
READ = {"odd_sse": 5, "trickle": 1}  # legal: must give exactly the clean answer
MODES = list(itertools.product(("chat", "responses"), (False, True)))


def _rollout(kind: str, variant: int, api: str, stream: bool) -> str:
    return f"{kind}-{variant}-{api}-{'stream' if stream else 'plain'}"


@pytest.fixture(scope="module")
def server() -> Iterator[PolicyServer]:
    kinds = {**REJECTED, **STREAM_ONLY_REJECTED, **READ, "failed": 1}
    rules = [
        f"rollout={_rollout(kind, variant, api, stream)}:kind={kind}:variant={variant}:delay=0.2"
        for kind, count in kinds.items()
        for variant in range(count)
        for api, stream in MODES
    ]
    with PolicyServer(SCRIPT, faults=rules) as srv:
        yield srv


async def _call(server: PolicyServer, rollout: str, api: str, stream: bool) -> ModelCall:
    endpoint = server.endpoint(api=api).model_copy(  # type: ignore[arg-type]
        update={"stream": stream, "max_retries": RETRIES, "retry_backoff_s": 0, "timeout_s": 10}
    )
    async with ModelClient(endpoint, rollout_id=rollout, task_id="t") as client:
        return await client.call("go")


async def _refused(server: PolicyServer, rollout: str, api: str, stream: bool) -> ModelError:
    with pytest.raises(ModelError) as raised:
        await _call(server, rollout, api, stream)
    return raised.value


@pytest.mark.parametrize(("api", "stream"), MODES)
@pytest.mark.parametrize("kind", [*REJECTED, *STREAM_ONLY_REJECTED])
async def test_a_broken_answer_is_a_transient_malformed_response_after_the_retries(
    server: PolicyServer, kind: str, api: str, stream: bool
) -> None:
    variants = {**REJECTED, **STREAM_ONLY_REJECTED}[kind]
    for variant in range(variants):
        rollout = _rollout(kind, variant, api, stream)
        if kind in STREAM_ONLY_REJECTED and not stream:
            assert (await _call(server, rollout, api, stream)).status == "completed"
            continue
        error = await _refused(server, rollout, api, stream)
        assert type(error) is TransientModelError, (rollout, error)
        assert "malformed response" in str(error), (rollout, error)
        record = failed_call(error)
        assert record is not None and len(record.attempts) == RETRIES + 1, rollout


@pytest.mark.parametrize(("api", "stream"), MODES)
async def test_a_credentials_error_in_a_2xx_answer_is_infrastructure_and_not_retried(
    server: PolicyServer, api: str, stream: bool
) -> None:
    error = await _refused(server, _rollout("failed", 0, api, stream), api, stream)
    assert type(error) is TransientModelError and "credentials" in str(error), error
    record = failed_call(error)
    assert record is not None and len(record.attempts) == 1


@pytest.mark.parametrize(("api", "stream"), MODES)
@pytest.mark.parametrize("kind", list(READ))
async def test_legal_but_odd_framing_and_trickled_bytes_read_as_the_clean_answer(
    server: PolicyServer, kind: str, api: str, stream: bool
) -> None:
    clean = await _call(server, f"clean-{api}-{stream}", api, stream)
    for variant in range(READ[kind]):
        call = await _call(server, _rollout(kind, variant, api, stream), api, stream)
        assert call.status == "completed" and len(call.attempts) == 1
        # Item ids are the server's per response (kept as evidence); everything else must be the same.
        assert _without_ids(call.output) == _without_ids(clean.output), _rollout(kind, variant, api, stream)


def _without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in item.items() if key != "id"} for item in items]


# --------------------------------------------------------------------------- anywhere: property tests

_REPLY = reply_for(Turn.model_validate(SCRIPT["tasks"]["t"][0]), 0)  # type: ignore[index]
_REQUEST = {"model": "m", "input": [{"type": "message", "role": "user", "content": "go"}]}
_BODIES = {
    "chat": chat_body(_REPLY, model="m", response_id="c1", created=1, prompt=3),
    "responses": responses_body(_REPLY, _REQUEST, model="m", response_id="resp_1", created=1, prompt=3),
}
_EVENTS = {
    "chat": chat_events(_REPLY, model="m", response_id="c1", created=1, prompt=3, include_usage=True),
    "responses": responses_events(_REPLY, _REQUEST, model="m", response_id="resp_1", created=1, prompt=3),
}

_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["zero", "x", "[DONE]", "error", "function_call", "message", "response.completed"]),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)


def _paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value, containers and leaves."""
    yield path
    children = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, child in children:
        yield from _paths(child, (*path, key))


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = orjson.loads(orjson.dumps(value))
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return copy


@st.composite
def _mutated_body(draw: st.DrawFn) -> tuple[str, Any]:
    api = draw(st.sampled_from(["chat", "responses"]))
    body = _BODIES[api]
    path = draw(st.sampled_from(list(_paths(body))))
    return api, _replaced(body, path, draw(_JSON_VALUES))


@given(_mutated_body())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_payload_with_any_value_of_any_type_anywhere_parses_or_is_a_wire_error(
    case: tuple[str, Any],
) -> None:
    api, body = case
    if not isinstance(body, dict):
        return  # the client refuses a body that is not an object before parsing (tested above)
    try:
        parse_payload(api, body)  # type: ignore[arg-type]
    except WireError:
        pass


async def _lines(chunks: list[bytes]) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def _assemble(api: str, frames: list[bytes]) -> dict[str, Any]:
    result = await assemble_stream(api, sse_events(sse_lines(_lines(frames))))  # type: ignore[arg-type]
    return result.payload


@st.composite
def _mutated_stream(draw: st.DrawFn) -> tuple[str, list[bytes]]:
    api = draw(st.sampled_from(["chat", "responses"]))
    frames = list(_EVENTS[api])
    index = draw(st.integers(min_value=0, max_value=len(frames) - 2))  # not the chat [DONE]
    event = frames[index]
    head, _, data = event.rpartition(b"data: ")
    value = orjson.loads(data)
    path = draw(st.sampled_from(list(_paths(value))))
    frames[index] = head + b"data: " + orjson.dumps(_replaced(value, path, draw(_JSON_VALUES))) + b"\n\n"
    return api, frames


@given(_mutated_stream())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
async def test_a_stream_with_any_value_of_any_type_anywhere_assembles_or_is_a_wire_error(
    case: tuple[str, list[bytes]],
) -> None:
    api, frames = case
    try:
        payload = await _assemble(api, frames)
        parse_payload(api, payload)  # type: ignore[arg-type]
    except (WireError, ServerEventError):
        pass


@given(st.sampled_from(["chat", "responses"]), st.data())
@settings(max_examples=100, deadline=None)
async def test_a_stream_cut_into_any_chunks_reads_the_same(api: str, data: st.DataObject) -> None:
    whole = b"".join(_EVENTS[api]).replace(b"\n", data.draw(st.sampled_from([b"\n", b"\r\n", b"\r"])))
    cuts = sorted(data.draw(st.lists(st.integers(min_value=0, max_value=len(whole)), max_size=40)))
    chunks = [whole[a:b] for a, b in itertools.pairwise([0, *cuts, len(whole)])]
    assert await _assemble(api, chunks) == await _assemble(api, [whole])
