"""rollcage.model.ModelClient: both API styles, every fault kind classified, every call bounded.

Most tests talk to the real scripted policy server over loopback HTTP (or a Unix
socket); wire details (headers, cookies, token fields, error bodies) use
``httpx.MockTransport``, the client's own fake wire. Time bounds are asserted
against the configured values (``max_call_seconds``), never fixed constants.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from rollcage.errors import (
    FatalModelError,
    ModelEndpointNotFoundError,
    ModelError,
    ModelTimeoutError,
    TransientModelError,
)
from rollcage.model import (
    ClientState,
    ModelClient,
    failed_call,
    max_call_seconds,
    retry_wait_bounds,
)
from rollcage.policy import PolicyServer, bind_socket, count_tokens
from rollcage.protocol import ModelCall, ModelEndpoint
from rollcage.wire import build_request

SCRIPT: dict[str, Any] = {
    "model": "scripted-policy",
    "tasks": {
        "weather": [
            {
                "reasoning": "Need the weather and a sum.",
                "tool_calls": [
                    {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    {"name": "python", "arguments": {"code": "print(sum([40, 2]))"}},
                ],
            },
            {"text": "cold;sum=42"},
        ],
        "*": [{"text": "I don't know"}],
    },
}
USER = [{"type": "message", "role": "user", "content": "What is the weather in Oslo, and 40+2?"}]
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]
APIS = ["chat", "responses"]
MODES = [pytest.param(False, id="plain"), pytest.param(True, id="stream")]

# Deadlines: short where an attempt is meant to time out, so a hanging server costs (R+1)*T = 0.75 s,
# and generous elsewhere, so a slow shared test machine never turns an answer into a timeout.
TIMEOUT_S = 0.25
SAFE_TIMEOUT_S = 5.0
RETRIES = 2
BACKOFF_S = 0.01


def endpoint_of(server: PolicyServer, api: str, stream: bool, **settings: Any) -> ModelEndpoint:
    settings = {key: value for key, value in settings.items() if value is not None}
    settings = {"timeout_s": SAFE_TIMEOUT_S, "max_retries": RETRIES, "retry_backoff_s": BACKOFF_S, **settings}
    return server.endpoint(api=api, stream=stream, connect_timeout_s=settings["timeout_s"], **settings)  # type: ignore[arg-type]


def text_of(record: ModelCall) -> str:
    return "".join(
        part["text"] for item in record.output if item["type"] == "message" for part in item["content"]
    )


def calls_of(record: ModelCall) -> list[tuple[str, str, str]]:
    return [
        (item["call_id"], item["name"], item["arguments"])
        for item in record.output
        if item["type"] == "function_call"
    ]


# --------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize("stream", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_two_turn_tool_episode_is_normalised_to_responses_items(
    serve_policy: Callable[..., PolicyServer], api: str, stream: bool
) -> None:
    server = serve_policy()
    endpoint = endpoint_of(server, api, stream)
    async with ModelClient(endpoint, rollout_id="r-happy", task_id="weather") as client:
        first = await client.call(USER, instructions="Be brief.", tools=TOOLS, index=0)
        outputs = [
            {"type": "function_call_output", "call_id": call_id, "output": "result"}
            for call_id, _, _ in calls_of(first)
        ]
        second = await client.call([*USER, *first.output, *outputs], tools=TOOLS, index=1)

    assert first.status == "completed" and first.error is None
    assert [item["type"] for item in first.output] == ["reasoning", "function_call", "function_call"]
    assert first.output[0]["summary"] == [{"type": "summary_text", "text": "Need the weather and a sum."}]
    assert calls_of(first) == [
        ("call_0_0", "get_weather", '{"city":"Oslo"}'),
        ("call_0_1", "python", '{"code":"print(sum([40, 2]))"}'),
    ]
    assert second.index == 1 and text_of(second) == "cold;sum=42"
    assert len(first.attempts) == 1 and first.http_status == 200
    assert first.response is not None
    assert first.started_at <= (first.first_byte_at or 0) <= first.ended_at
    # The record keeps the exact payload that went over the wire.
    assert first.request == build_request(endpoint, USER, instructions="Be brief.", tools=TOOLS)
    # The server's documented token rule, carried over exactly.
    reasoning = count_tokens("Need the weather and a sum.")
    assert first.usage.reasoning_tokens == reasoning
    assert first.usage.output_tokens == reasoning + sum(
        count_tokens(name) + count_tokens(arguments) for _, name, arguments in calls_of(first)
    )
    assert first.usage.cached_tokens == 0
    assert first.usage.total_tokens == (first.usage.input_tokens or 0) + first.usage.output_tokens


async def test_unix_socket_transport_reaches_the_server(
    serve_policy: Callable[..., PolicyServer], tmp_path: Path
) -> None:
    server = serve_policy(uds=tmp_path / "policy.sock")
    endpoint = server.endpoint(api="responses", timeout_s=5.0)
    assert endpoint.uds == str(tmp_path / "policy.sock")
    async with ModelClient(endpoint, rollout_id="r-uds", task_id="weather") as client:
        record = await client.call(USER)
    assert calls_of(record)[0][1] == "get_weather"
    assert server.requests == {"r-uds": 1}


async def test_stream_records_first_event_time_and_assembled_payload(
    serve_policy: Callable[..., PolicyServer],
) -> None:
    server = serve_policy()
    async with ModelClient(endpoint_of(server, "chat", True), rollout_id="r-s", task_id="x") as client:
        record = await client.call(USER)
    assert record.response is not None and record.response["object"] == "chat.completion"
    assert record.response["choices"][0]["message"]["content"] == "I don't know"
    assert record.first_byte_at is not None and record.started_at <= record.first_byte_at <= record.ended_at
    # stream_options.include_usage is asked for, so a stream reports usage too.
    assert record.usage.input_tokens is not None


# --------------------------------------------------------------------------- faults, one rollout id each


FAILING = [
    # (fault rule, error raised once retries are exhausted, attempts made)
    ("status=503", TransientModelError, RETRIES + 1),
    ("status=500", TransientModelError, RETRIES + 1),
    ("status=502", TransientModelError, RETRIES + 1),
    ("status=408", TransientModelError, RETRIES + 1),
    ("status=409", TransientModelError, RETRIES + 1),
    ("status=429:retry_after=0", TransientModelError, RETRIES + 1),
    ("kind=reset", TransientModelError, RETRIES + 1),
    ("kind=truncated", TransientModelError, RETRIES + 1),
    ("kind=malformed", TransientModelError, RETRIES + 1),
    ("kind=hang", ModelTimeoutError, RETRIES + 1),
    ("kind=latency:delay=30", ModelTimeoutError, RETRIES + 1),
    ("status=400", FatalModelError, 1),
    # Credentials and a missing endpoint/model are infrastructure: transient, but not retried.
    ("status=401", TransientModelError, 1),
    ("status=403", TransientModelError, 1),
    ("status=404", ModelEndpointNotFoundError, 1),
    ("status=422", FatalModelError, 1),
]
RECOVERING = [
    "status=503",
    "status=429:retry_after=0",
    "kind=reset",
    "kind=truncated",
    "kind=malformed",
    "kind=hang",
]


def _rollout(prefix: str, rule: str, api: str, stream: bool) -> str:
    return f"{prefix}-{rule.replace(':', '-').replace('=', '-')}-{api}-{'stream' if stream else 'plain'}"


@pytest.fixture(scope="module")
def faulty_server() -> Iterator[PolicyServer]:
    """One server for every fault case: each rule is scoped to its own rollout id."""
    rules = []
    for api in APIS:
        for stream in (False, True):
            rules += [f"rollout={_rollout('fail', rule, api, stream)}:{rule}" for rule, _, _ in FAILING]
            rules += [f"rollout={_rollout('once', rule, api, stream)}:call=1:{rule}" for rule in RECOVERING]
    with PolicyServer(SCRIPT, faults=rules) as server:
        yield server


@pytest.mark.parametrize("stream", MODES)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("rule", "error", "attempts"), FAILING, ids=[case[0] for case in FAILING])
async def test_fault_is_classified_retried_as_bounded_and_timed(
    faulty_server: PolicyServer, rule: str, error: type[ModelError], attempts: int, api: str, stream: bool
) -> None:
    rollout = _rollout("fail", rule, api, stream)
    endpoint = endpoint_of(
        faulty_server, api, stream, timeout_s=TIMEOUT_S if error is ModelTimeoutError else None
    )
    started = time.monotonic()
    async with ModelClient(endpoint, rollout_id=rollout, task_id="weather") as client:
        with pytest.raises(ModelError) as raised:
            await client.call(USER)
    elapsed = time.monotonic() - started

    assert type(raised.value) is error
    # A timed-out client may be back before the server thread has logged its last request.
    faulty_server.state.wait_for_requests(attempts, 10.0, rollout_id=rollout)
    injected = [fault for fault in faulty_server.faults_injected if fault.rollout_id == rollout]
    assert faulty_server.requests[rollout] == attempts == len(injected)
    assert elapsed <= max_call_seconds(endpoint)
    if error is ModelTimeoutError:
        # Every attempt waited out its own deadline, no more.
        assert elapsed >= attempts * endpoint.timeout_s
    record = failed_call(raised.value)
    assert record is not None and record is getattr(raised.value, "record", None)
    assert record.status == "failed" and len(record.attempts) == attempts
    assert record.error is not None and record.error.type == error.__name__
    assert record.error.kind == error.kind
    assert record.request["model"] == "scripted-policy" and record.response is None


@pytest.mark.parametrize("stream", MODES)
@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("rule", RECOVERING)
async def test_transient_fault_on_first_attempt_replays_the_same_turn(
    faulty_server: PolicyServer, rule: str, api: str, stream: bool
) -> None:
    rollout = _rollout("once", rule, api, stream)
    # A hung first attempt costs its whole deadline; the second must still answer well within one.
    endpoint = endpoint_of(faulty_server, api, stream, timeout_s=1.0 if rule == "kind=hang" else None)
    async with ModelClient(endpoint, rollout_id=rollout, task_id="weather") as client:
        record = await client.call(USER)
    assert record.status == "completed" and len(record.attempts) == 2
    assert faulty_server.requests[rollout] == 2
    assert [f.rollout_call for f in faulty_server.faults_injected if f.rollout_id == rollout] == [1]
    assert [name for _, name, _ in calls_of(record)] == ["get_weather", "python"]


@pytest.mark.parametrize("stream", MODES)
@pytest.mark.parametrize("api", APIS)
async def test_content_faults_are_answers_not_errors(
    serve_policy: Callable[..., PolicyServer], api: str, stream: bool
) -> None:
    server = serve_policy(faults=["call=1:kind=length", "call=2:kind=empty", "call=3:kind=bad_arguments"])
    async with ModelClient(
        endpoint_of(server, api, stream), rollout_id="r-content", task_id="weather"
    ) as client:
        length = await client.call(USER)
        empty = await client.call(USER)
        bad = await client.call(USER)

    assert length.status == "incomplete"
    assert length.incomplete_reason == ("length" if api == "chat" else "max_output_tokens")
    assert not calls_of(length)
    assert empty.status == "completed" and text_of(empty) == "" and not calls_of(empty)
    arguments = [arguments for _, _, arguments in calls_of(bad)]
    assert len(arguments) == 2
    for raw in arguments:  # kept verbatim although not JSON: the agent decides
        with pytest.raises(orjson.JSONDecodeError):
            orjson.loads(raw)
    assert [fault.kind for fault in server.faults_injected] == ["length", "empty", "bad_arguments"]


async def test_retry_after_is_honoured(serve_policy: Callable[..., PolicyServer]) -> None:
    server = serve_policy(faults=["call=1:status=429:retry_after=0.3"])
    endpoint = endpoint_of(server, "chat", False, timeout_s=2.0)
    started = time.monotonic()
    async with ModelClient(endpoint, rollout_id="r-429", task_id="weather") as client:
        record = await client.call(USER)
    assert len(record.attempts) == 2
    assert time.monotonic() - started >= 0.3


async def test_retry_after_is_capped_so_the_call_stays_bounded(
    serve_policy: Callable[..., PolicyServer],
) -> None:
    server = serve_policy(faults=["status=429:retry_after=3600"])
    endpoint = endpoint_of(server, "chat", False, max_retries=1, timeout_s=TIMEOUT_S)
    started = time.monotonic()
    async with ModelClient(endpoint, rollout_id="r-cap", task_id="weather") as client:
        with pytest.raises(TransientModelError):
            await client.call(USER)
    assert time.monotonic() - started <= max_call_seconds(endpoint)
    assert retry_wait_bounds(endpoint) == [TIMEOUT_S]


async def test_refused_connection_is_transient_and_bounded() -> None:
    sock = bind_socket()
    port = sock.getsockname()[1]
    sock.close()  # nobody listens there any more
    endpoint = ModelEndpoint(
        base_url=f"http://127.0.0.1:{port}/v1",
        model="m",
        timeout_s=TIMEOUT_S,
        max_retries=2,
        retry_backoff_s=0.01,
    )
    started = time.monotonic()
    async with ModelClient(endpoint, rollout_id="r", task_id="t") as client:
        with pytest.raises(TransientModelError) as raised:
            await client.call(USER)
    assert type(raised.value) is TransientModelError
    assert (record := failed_call(raised.value)) is not None and len(record.attempts) == 3
    assert time.monotonic() - started <= max_call_seconds(endpoint)


@pytest.mark.parametrize("stream", MODES)
async def test_server_that_accepts_and_never_reads_does_not_hang_the_client(stream: bool) -> None:
    sock = bind_socket()  # listening, never accepting: the kernel completes the handshake, nobody answers
    try:
        endpoint = ModelEndpoint(
            base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1",
            model="m",
            stream=stream,
            timeout_s=TIMEOUT_S,
            connect_timeout_s=TIMEOUT_S,
            max_retries=1,
            retry_backoff_s=0.01,
        )
        started = time.monotonic()
        async with ModelClient(endpoint, rollout_id="r", task_id="t") as client:
            with pytest.raises(ModelTimeoutError):
                await client.call(USER)
        elapsed = time.monotonic() - started
    finally:
        sock.close()
    assert 2 * TIMEOUT_S <= elapsed <= max_call_seconds(endpoint)


async def test_cancelling_a_hanging_call_propagates_and_makes_no_record(
    serve_policy: Callable[..., PolicyServer],
) -> None:
    server = serve_policy(faults=["kind=hang"])
    endpoint = endpoint_of(server, "chat", False, timeout_s=30.0)
    async with ModelClient(endpoint, rollout_id="r-cancel", task_id="weather") as client:
        task = asyncio.create_task(client.call(USER))
        arrived = await asyncio.to_thread(server.state.wait_for_requests, 1, 10.0)
        assert arrived
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# --------------------------------------------------------------------------- the wire, on a mock transport


def mock_endpoint(api: str = "chat", **settings: Any) -> ModelEndpoint:
    settings = {"max_retries": 1, "retry_backoff_s": 0.0, **settings}
    return ModelEndpoint(base_url="http://model.test/v1", model="m", api=api, **settings)


CHAT_TEXT = {
    "id": "c",
    "object": "chat.completion",
    "created": 0,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}


async def test_headers_name_the_rollout_and_never_carry_credentials(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Credentials lying around in the environment must not leak into the sandbox's requests.
    netrc = tmp_path / "netrc"
    netrc.write_text("machine model.test login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:1")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=CHAT_TEXT)

    client = ModelClient(
        mock_endpoint(), rollout_id="r-7", task_id="t-3", transport=httpx.MockTransport(handler)
    )
    async with client:
        await client.call(USER)
    (request,) = seen
    assert request.headers["x-rollout-id"] == "r-7"
    assert request.headers["x-task-id"] == "t-3"
    assert "authorization" not in request.headers
    assert request.url == "http://model.test/v1/chat/completions"


async def test_a_request_goes_out_as_httpx_s_client_would_send_it() -> None:
    # The client hands each request to its transport itself: what httpx's client adds must be there.
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=CHAT_TEXT)

    endpoint = mock_endpoint(timeout_s=7.5, connect_timeout_s=2.5)
    client = ModelClient(endpoint, rollout_id="r", task_id="t", transport=httpx.MockTransport(handler))
    async with client:
        await client.call(USER)
        await client.call(USER)
    assert len(seen) == 2
    expected = httpx.AsyncClient(headers={"User-Agent": "rollcage"}).build_request(
        "POST", "http://model.test/v1/chat/completions", content=seen[0].content
    )
    for request in seen:
        assert request.method == "POST"
        for name in ("user-agent", "accept-encoding", "connection", "host", "content-length"):
            assert request.headers[name] == expected.headers[name], name
        assert request.headers["content-type"] == "application/json"
        assert request.extensions["timeout"] == {"connect": 2.5, "read": 7.5, "write": 7.5, "pool": 7.5}


async def test_cookies_are_forwarded_and_kept_from_set_cookie() -> None:
    sent: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request.headers.get("cookie"))
        headers = [("set-cookie", "sticky=node-4; Path=/"), ("set-cookie", "old=; Max-Age=0")]
        return httpx.Response(200, json=CHAT_TEXT, headers=headers if len(sent) == 1 else [])

    client = ModelClient(
        mock_endpoint(),
        rollout_id="r",
        task_id="t",
        cookies={"session": "abc", "old": "1"},
        transport=httpx.MockTransport(handler),
    )
    async with client:
        await client.call(USER)
        assert client.cookies == {"session": "abc", "sticky": "node-4"}
        await client.call(USER)
    assert sent == ["session=abc; old=1", "session=abc; sticky=node-4"]


@pytest.mark.parametrize("api", APIS)
async def test_missing_token_counts_stay_none_and_reported_ones_are_exact(api: str) -> None:
    if api == "chat":
        partial = {**CHAT_TEXT, "usage": {"prompt_tokens": 11, "completion_tokens": 0, "total_tokens": 11}}
        bare = CHAT_TEXT
    else:
        base = {
            "id": "r",
            "object": "response",
            "status": "completed",
            "output": [
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}
            ],
        }
        partial = {**base, "usage": {"input_tokens": 11, "output_tokens": 0, "total_tokens": 11}}
        bare = base
    bodies = iter([partial, bare])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(bodies))

    async with ModelClient(
        mock_endpoint(api), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        reported = await client.call(USER)
        missing = await client.call(USER)
    assert reported.usage.model_dump() == {
        "input_tokens": 11,
        "output_tokens": 0,  # a reported 0 is kept as 0
        "total_tokens": 11,
        "reasoning_tokens": None,
        "cached_tokens": None,
    }
    assert set(missing.usage.model_dump().values()) == {None}


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (400, {"error": {"message": "This model's maximum context length is 4096 tokens.", "code": None}}),
        (400, {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400}),
        (500, {"error": {"message": "x", "code": "context_length_exceeded"}}),
        (413, {"detail": "request too large"}),
    ],
    ids=["vllm-context-length", "vllm-400", "500-context-length", "413"],
)
async def test_request_errors_are_fatal_and_never_retried(status: int, body: dict[str, Any]) -> None:
    attempts = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal attempts
        attempts += 1
        return httpx.Response(status, json=body)

    async with ModelClient(
        mock_endpoint(max_retries=3), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        with pytest.raises(FatalModelError) as raised:
            await client.call(USER)
    assert attempts == 1
    assert f"HTTP {status}" in str(raised.value)


@pytest.mark.parametrize(
    "body",
    [
        {"id": "x", "object": "chat.completion"},  # no choices
        {"id": "x", "choices": []},
        [1, 2, 3],
    ],
    ids=["no-choices", "empty-choices", "not-an-object"],
)
async def test_a_2xx_body_of_the_wrong_shape_is_the_servers_fault(body: Any) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    async with ModelClient(
        mock_endpoint(), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        with pytest.raises(TransientModelError) as raised:
            await client.call(USER)
    assert (record := failed_call(raised.value)) is not None and len(record.attempts) == 2


async def test_failed_responses_status_is_classified_by_its_code() -> None:
    body = {"id": "r", "status": "failed", "output": [], "error": {"code": "server_error", "message": "boom"}}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=body)

    async with ModelClient(
        mock_endpoint("responses"), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        with pytest.raises(TransientModelError) as raised:
            await client.call(USER)
    record = failed_call(raised.value)
    assert record is not None and record.response == body and len(record.attempts) == 2


async def test_in_stream_error_event_is_classified() -> None:
    stream = b'data: {"error": {"message": "maximum context length exceeded", "code": 400}}\n\n'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=stream, headers={"content-type": "text/event-stream"})

    async with ModelClient(
        mock_endpoint(stream=True), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        with pytest.raises(FatalModelError):
            await client.call(USER)


async def test_retry_after_ms_and_http_date_are_understood() -> None:
    answers = iter(
        [
            httpx.Response(503, headers={"retry-after-ms": "50"}),
            httpx.Response(503, headers={"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}),  # in the past: 0
            httpx.Response(200, json=CHAT_TEXT),
        ]
    )

    def handler(request: httpx.Request) -> httpx.Response:
        return next(answers)

    started = time.monotonic()
    async with ModelClient(
        mock_endpoint(max_retries=2), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        record = await client.call(USER)
    assert len(record.attempts) == 3 and time.monotonic() - started >= 0.05


def test_chat_request_groups_one_model_turn_into_one_assistant_message() -> None:
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hmm"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Let me look."}],
        },
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "g", "arguments": "{bad"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call_output", "call_id": "b", "output": "2"},
    ]
    payload = build_request(
        ModelEndpoint(base_url="http://x/v1", model="m", sampling={"max_output_tokens": 5, "seed": 1}),
        items,
        instructions="sys",
        tools=TOOLS,
    )
    assert payload["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{bad"}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": "1"},
        {"role": "tool", "tool_call_id": "b", "content": "2"},
    ]
    assert payload["tools"] == [
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}
    ]
    assert payload["max_tokens"] == 5 and payload["seed"] == 1 and "stream" not in payload


async def test_input_a_chat_endpoint_cannot_take_is_fatal_without_a_request() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request may be sent")

    async with ModelClient(
        mock_endpoint(), rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        with pytest.raises(FatalModelError):
            await client.call([{"type": "web_search_call", "id": "w"}])


async def test_lifecycle_is_explicit_and_misuse_fails_loudly() -> None:
    client = ModelClient(mock_endpoint(), rollout_id="r", task_id="t")
    assert client.state is ClientState.UNOPENED
    with pytest.raises(RuntimeError):
        await client.call(USER)
    async with client:
        assert client.state is ClientState.OPENED
        with pytest.raises(RuntimeError):
            async with client:
                pass
    assert client.state is ClientState.CLOSED
    with pytest.raises(RuntimeError):
        await client.call(USER)
    await client.aclose()  # closing twice is fine


def test_retry_waits_and_call_bound_follow_the_configuration() -> None:
    endpoint = ModelEndpoint(
        base_url="http://x/v1", model="m", timeout_s=10.0, max_retries=3, retry_backoff_s=0.5
    )
    assert retry_wait_bounds(endpoint) == [10.0, 10.0, 10.0]
    assert max_call_seconds(endpoint) == 4 * 10.0 + 30.0
    slow = endpoint.model_copy(update={"retry_backoff_s": 20.0, "timeout_s": 1.0})
    assert retry_wait_bounds(slow) == [20.0, 30.0, 30.0]


# -------------------------------------------------------------- seeded chaos: injected vs classified


RETRYABLE_KINDS = {"status", "rate_limit", "reset", "truncated", "malformed"}


@pytest.mark.parametrize("api", APIS)
async def test_random_faults_are_classified_as_injected(
    serve_policy: Callable[..., PolicyServer], api: str
) -> None:
    server = serve_policy(
        fault_rate=0.5,
        seed=11,
        fault_kinds="500,503,429,reset,truncated,malformed,length,empty,bad_arguments",
    )
    endpoint = endpoint_of(server, api, False, max_retries=3)
    outcomes: dict[str, ModelCall | ModelError] = {}
    for number in range(12):
        rollout = f"chaos-{number}"
        async with ModelClient(endpoint, rollout_id=rollout, task_id="weather") as client:
            try:
                outcomes[rollout] = await client.call(USER)
            except ModelError as exc:
                outcomes[rollout] = exc

    log = server.request_log
    assert {fault.source for fault in server.faults_injected} == {"random"}
    for rollout, outcome in outcomes.items():
        faults = [record.fault for record in log if record.rollout_id == rollout]
        # Replay what the client should have done with what the server says it injected.
        retried = 0
        while retried < len(faults) - 1 and faults[retried] in RETRYABLE_KINDS:
            retried += 1
        last = faults[retried]
        assert len(faults) == retried + 1  # no request after the one that settled the call
        if isinstance(outcome, ModelError):
            assert type(outcome) is TransientModelError and last in RETRYABLE_KINDS
            assert retried == endpoint.max_retries
            continue
        assert len(outcome.attempts) == len(faults) and last not in RETRYABLE_KINDS
        assert outcome.status == ("incomplete" if last == "length" else "completed")
        if last == "empty":
            assert text_of(outcome) == "" and not calls_of(outcome)
        if last is None:
            assert [name for _, name, _ in calls_of(outcome)] == ["get_weather", "python"]
    assert any(isinstance(outcome, ModelCall) and len(outcome.attempts) > 1 for outcome in outcomes.values())


async def test_latency_within_the_deadline_is_just_slow(serve_policy: Callable[..., PolicyServer]) -> None:
    server = serve_policy(faults=["kind=latency:delay=0.1"])
    async with ModelClient(endpoint_of(server, "chat", True), rollout_id="r", task_id="x") as client:
        record = await client.call(USER)
    assert len(record.attempts) == 1 and record.ended_at - record.started_at >= 0.1
    assert [fault.kind for fault in server.faults_injected] == ["latency"]


def test_the_client_imports_stay_lean() -> None:
    # The worker imports the client once per rollout: no SDK, server, CLI or YAML code may come with it.
    probe = (
        "import sys, rollcage.model\n"
        "heavy = {'openai', 'httpx2', 'starlette', 'uvicorn', 'rich', 'typer', 'click', 'yaml', 'pygments'}\n"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))"
    )
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
