"""rollcage.policy: the scripted server as the openai SDK sees it; its turns, faults and lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rollcage.errors import ConfigError
from rollcage.policy import (
    FaultPlan,
    PolicyServer,
    bind_socket,
    count_model_turns,
    find_task_marker,
    load_script,
    parse_fault_kinds,
    parse_fault_spec,
)
from tests.helpers.paths import REPO

DEMO = REPO / "examples" / "policy-demo.yaml"

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
        "codeact": [{"text": "Let me run:", "code": "print(1)"}, {"code": "submit('1')"}],
        "loop": [
            {"text": "again", "tool_calls": [{"name": "python", "arguments": {"code": "1"}}], "repeat": True}
        ],
        "short": [{"text": "This is cut", "finish": "length"}],
        "*": [{"text": "I don't know"}],
    },
}
TOOLS_RESPONSES: list[Any] = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {}}}
]
TOOLS_CHAT: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def shared() -> Iterator[PolicyServer]:
    """One server for the tests that only read answers; content faults are scoped to rollout ids."""
    rules = ["rollout=length:kind=length", "rollout=empty:kind=empty", "rollout=bad:kind=bad_arguments"]
    with PolicyServer(SCRIPT, faults=rules) as server:
        yield server


def sdk(server: PolicyServer, task: str) -> openai.OpenAI:
    return openai.OpenAI(
        api_key="unused", base_url=server.base_url, max_retries=0, default_headers={"X-Task-Id": task}
    )


def sse_data(body: str) -> list[dict[str, Any]]:
    frames = [line.removeprefix("data: ") for line in body.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" or json.loads(frames[-1])["type"] in (
        "response.completed",
        "response.incomplete",
    )
    return [json.loads(frame) for frame in frames if frame != "[DONE]"]


# --------------------------------------------------------------------------- the openai SDK as a plain client


def test_openai_sdk_reads_chat_completions(shared: PolicyServer) -> None:
    server = shared
    with sdk(server, "weather") as client:
        first = client.chat.completions.create(
            model="scripted-policy", messages=[{"role": "user", "content": "hi"}], tools=TOOLS_CHAT
        )
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []] == [  # type: ignore[union-attr]
            ("call_0_0", "get_weather", '{"city":"Oslo"}'),
            ("call_0_1", "python", '{"code":"print(sum([40, 2]))"}'),
        ]
        assert getattr(message, "reasoning_content", None) == "Need the weather and a sum."
        history: list[Any] = [
            {"role": "user", "content": "hi"},
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": "call_0_0", "content": "cold"},
            {"role": "tool", "tool_call_id": "call_0_1", "content": "42"},
        ]
        second = client.chat.completions.create(model="scripted-policy", messages=history)
    assert second.choices[0].message.content == "cold;sum=42"
    assert second.usage is not None and second.usage.prompt_tokens > 0
    assert first.usage is not None and first.usage.completion_tokens_details is not None
    assert first.usage.completion_tokens_details.reasoning_tokens == 7


def test_openai_sdk_reads_chat_completion_streams(shared: PolicyServer) -> None:
    server = shared
    with sdk(server, "weather") as client:
        chunks = list(
            client.chat.completions.create(
                model="scripted-policy",
                messages=[{"role": "user", "content": "hi"}],
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
        with client.chat.completions.stream(
            model="scripted-policy", messages=[{"role": "user", "content": "hi"}]
        ) as stream:
            final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_weather", "python"]  # type: ignore[union-attr]
    assert [call.function.arguments for call in calls] == [
        '{"city":"Oslo"}',
        '{"code":"print(sum([40, 2]))"}',
    ]  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_sdk_reads_responses(shared: PolicyServer) -> None:
    server = shared
    with sdk(server, "weather") as client:
        first = client.responses.create(model="scripted-policy", input="hi", tools=TOOLS_RESPONSES)
        assert [item.type for item in first.output] == ["reasoning", "function_call", "function_call"]
        history: list[Any] = [
            {"role": "user", "content": "hi"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": "call_0_0", "output": "cold"},
            {"type": "function_call_output", "call_id": "call_0_1", "output": "42"},
        ]
        second = client.responses.create(model="scripted-policy", input=history)
        short = sdk(server, "short").responses.create(model="scripted-policy", input="hi")
    assert second.output_text == "cold;sum=42" and second.status == "completed"
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"
    assert first.usage is not None and first.usage.output_tokens_details.reasoning_tokens == 7


def test_openai_sdk_reads_response_streams(shared: PolicyServer) -> None:
    server = shared
    with sdk(server, "codeact") as client:
        events = list(client.responses.create(model="scripted-policy", input="hi", stream=True))
        assert events[0].type == "response.created" and events[-1].type == "response.completed"
        assert [event.sequence_number for event in events] == list(range(len(events)))
        # The SDK's own accumulator checks that every delta lands on an item it announced.
        with client.responses.stream(model="scripted-policy", input="hi") as stream:
            final = stream.get_final_response()
    assert final.output_text == "Let me run:\n\n```python\nprint(1)\n```"


def test_openai_sdk_lists_the_model(shared: PolicyServer) -> None:
    server = shared
    with sdk(server, "x") as client:
        assert [model.id for model in client.models.list()] == ["scripted-policy"]


BODY_CASES = [
    ("weather", "clean"),
    ("codeact", "clean"),
    ("short", "clean"),
    ("weather", "length"),
    ("weather", "empty"),
    ("*", "bad"),
]


@pytest.mark.parametrize(("task", "rollout"), BODY_CASES)
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_every_body_and_event_validates_strictly_against_the_sdk_types(
    shared: PolicyServer, api: str, task: str, rollout: str
) -> None:
    server = shared
    path = "/chat/completions" if api == "chat" else "/responses"
    request: dict[str, Any] = {"model": "scripted-policy"}
    if api == "chat":
        request |= {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS_CHAT}
    else:
        request |= {"input": "hi", "tools": TOOLS_RESPONSES, "instructions": "be brief"}
    headers = {"X-Task-Id": task, "X-Rollout-Id": rollout}
    with httpx.Client(base_url=server.base_url, headers=headers) as http:
        plain = http.post(path, json=request).json()
        stream = http.post(path, json={**request, "stream": True, "stream_options": {"include_usage": True}})
    if api == "chat":
        ChatCompletion.model_validate(plain, strict=False)
        for chunk in sse_data(stream.text):
            ChatCompletionChunk.model_validate(chunk)
    else:
        Response.model_validate(plain)
        for event in sse_data(stream.text):
            EVENTS.validate_python(event)


# --------------------------------------------------------------------------- turns and tasks


def test_turn_is_the_number_of_assistant_turns_in_the_history() -> None:
    assert count_model_turns("chat", {"messages": [{"role": "user", "content": "x"}]}) == 0
    assert (
        count_model_turns(
            "chat",
            {"messages": [{"role": "user"}, {"role": "assistant"}, {"role": "tool"}, {"role": "assistant"}]},
        )
        == 2
    )
    items = [
        {"role": "user", "content": "x"},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "a", "output": "1"},
        {"type": "function_call_output", "call_id": "b", "output": "1"},
        {"type": "message", "role": "assistant", "content": "more"},
        {"type": "message", "role": "user", "content": "go on"},
    ]
    assert count_model_turns("responses", {"input": items}) == 2
    assert count_model_turns("responses", {"input": "text"}) == 0


def test_task_comes_from_header_then_marker_then_default(serve_policy: Callable[..., PolicyServer]) -> None:
    server = serve_policy()
    request = {"model": "m", "messages": [{"role": "user", "content": "solve [task:short] please"}]}
    with httpx.Client(base_url=server.base_url) as http:
        by_header = http.post("/chat/completions", json=request, headers={"X-Task-Id": "codeact"}).json()
        by_marker = http.post("/chat/completions", json=request).json()
        default = http.post(
            "/chat/completions", json={**request, "messages": [{"role": "user", "content": "?"}]}
        )
    assert by_header["choices"][0]["message"]["content"].startswith("Let me run:")
    assert by_marker["choices"][0]["finish_reason"] == "length"
    assert default.json()["choices"][0]["message"]["content"] == "I don't know"
    assert [r.task_id for r in server.request_log] == ["codeact", "short", "*"]
    assert find_task_marker({"instructions": "[task:abc-1]"}) == "abc-1"


def test_unknown_task_without_default_is_a_client_error(serve_policy: Callable[..., PolicyServer]) -> None:
    server = serve_policy({"tasks": {"only": [{"text": "x"}]}})
    with httpx.Client(base_url=server.base_url) as http:
        response = http.post("/responses", json={"model": "m", "input": "hi"}, headers={"X-Task-Id": "other"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "task_not_in_script"


def test_script_past_its_end_repeats_or_restates_the_last_answer() -> None:
    script = load_script(SCRIPT)
    assert script.turn("loop", 5) == script.tasks["loop"][0]
    weather_end = script.turn("weather", 9)
    assert weather_end is not None and weather_end.text == "cold;sum=42" and not weather_end.tool_calls
    codeact_end = script.turn("codeact", 2)
    assert codeact_end is not None and "no turn 2" in (codeact_end.text or "")


def test_example_script_and_json_scripts_load(tmp_path: Path) -> None:
    demo = load_script(DEMO)
    assert {"weather-1", "codeact-1", "*"} <= set(demo.tasks)
    path = tmp_path / "script.json"
    path.write_text(json.dumps(SCRIPT))
    assert load_script(path) == load_script(SCRIPT)


@pytest.mark.parametrize(
    "tasks",
    [
        {"t": []},
        {"t": [{}]},
        {"t": [{"text": "a", "repeat": True}, {"text": "b"}]},
        {"t": [{"tool_calls": [{"name": "f", "arguments": {}, "arguments_raw": "{"}]}]},
        {"t": [{"text": "a", "finish": "tool_calls"}]},
        {"t": [{"text": "a", "surprise": 1}]},
    ],
    ids=["no-turns", "empty-turn", "repeat-not-last", "two-argument-forms", "bad-finish", "unknown-key"],
)
def test_invalid_scripts_are_config_errors(tasks: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        load_script({"tasks": tasks})


# --------------------------------------------------------------------------- faults


def test_fault_specs_parse() -> None:
    rule = parse_fault_spec("call=3:status=503")
    assert (rule.kind, rule.first_call, rule.last_call, rule.status) == ("status", 3, 3, 503)
    assert parse_fault_spec("call=2:kind=hang").kind == "hang"
    assert parse_fault_spec("status=429:retry_after=2").kind == "rate_limit"
    ranged = parse_fault_spec("rollout=r-1:call=2-4:kind=reset")
    assert ranged.matches(call=99, rollout_call=3, rollout_id="r-1", task_id="t")
    assert not ranged.matches(call=3, rollout_call=5, rollout_id="r-1", task_id="t")
    assert not ranged.matches(call=3, rollout_call=3, rollout_id="r-2", task_id="t")
    assert [rule.kind for rule in parse_fault_kinds("500,429,hang")] == ["status", "rate_limit", "hang"]


@pytest.mark.parametrize(
    "spec", ["call=1", "call=x:kind=hang", "kind=explode", "call=1:status=200", "frob=1"]
)
def test_bad_fault_specs_are_config_errors(spec: str) -> None:
    with pytest.raises(ConfigError):
        parse_fault_spec(spec)


def test_random_faults_are_reproducible_from_the_seed() -> None:
    def draws(seed: int) -> list[str | None]:
        plan = FaultPlan(rate=0.5, seed=seed)
        decisions = [plan.decide(call=n, rollout_call=n, rollout_id="r", task_id="t") for n in range(1, 60)]
        return [decision[0].kind if decision else None for decision in decisions]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert 10 < sum(kind is not None for kind in draws(7)) < 50
    assert "hang" not in draws(7)  # not drawn unless asked for


def test_faults_are_logged_in_memory_and_as_jsonl_with_the_request_they_hit(
    serve_policy: Callable[..., PolicyServer], tmp_path: Path
) -> None:
    log = tmp_path / "faults.jsonl"
    server = serve_policy(faults=["call=2:status=500", "rollout=b:call=1:kind=empty"], fault_log=log)
    with httpx.Client(base_url=server.base_url) as http:
        for rollout in ("a", "a", "b", "a"):
            http.post(
                "/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
                headers={"X-Rollout-Id": rollout, "X-Task-Id": "weather"},
            )
    assert server.requests == {"a": 3, "b": 1}
    injected = [(f.call, f.rollout_id, f.task_id, f.kind, f.status) for f in server.faults_injected]
    assert injected == [(2, "a", "weather", "status", 500), (3, "b", "weather", "empty", None)]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["call"], line["rollout_id"], line["kind"]) for line in lines] == [
        (2, "a", "status"),
        (3, "b", "empty"),
    ]
    assert [record.fault for record in server.request_log] == [None, "status", "empty", None]


def test_reset_drops_the_connection_without_any_answer(serve_policy: Callable[..., PolicyServer]) -> None:
    server = serve_policy(faults=["call=1:kind=reset"])
    with httpx.Client(base_url=server.base_url) as http:
        with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
            http.post("/chat/completions", json={"model": "m", "messages": []})
        assert http.post("/chat/completions", json={"model": "m", "messages": []}).status_code == 200


def test_a_hanging_request_does_not_block_shutdown(tmp_path: Path) -> None:
    server = PolicyServer(SCRIPT, faults=["kind=hang"], stop_timeout_s=5.0).start()
    outcome: list[BaseException | int] = []

    def hang() -> None:
        try:
            with httpx.Client(base_url=server.base_url, timeout=60.0) as http:
                outcome.append(
                    http.post("/chat/completions", json={"model": "m", "messages": []}).status_code
                )
        except httpx.HTTPError as exc:
            outcome.append(exc)

    client = threading.Thread(target=hang)
    client.start()
    try:
        assert server.state.wait_for_requests(1, timeout=10.0)
        started = time.monotonic()
        server.stop()  # raises if the server thread outlives stop_timeout_s
        stopped_in = time.monotonic() - started
    finally:
        server.stop()
        client.join(10.0)
    assert not client.is_alive()
    assert stopped_in < 5.0
    assert len(outcome) == 1 and isinstance(outcome[0], httpx.HTTPError)  # never an answer


def test_server_lifecycle_is_explicit() -> None:
    server = PolicyServer(SCRIPT)
    with server:
        with pytest.raises(RuntimeError):
            server.start()
    server.stop()  # idempotent
    with pytest.raises(RuntimeError):
        server.start()


# --------------------------------------------------------------------------- the command


def test_serve_policy_command_serves_a_script_with_faults_and_stops_on_sigint(tmp_path: Path) -> None:
    log = tmp_path / "faults.jsonl"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollcage",
            "serve-policy",
            "--script",
            str(DEMO),
            "--port",
            "0",
            "--fault",
            "call=1:status=503",
            "--fault-log",
            str(log),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stderr is not None
        ready, _, _ = select.select([process.stderr], [], [], 30.0)
        assert ready, "serve-policy did not announce itself"
        line = process.stderr.readline()
        base_url = line.split(" on ", 1)[1].split()[0]
        with openai.OpenAI(api_key="unused", base_url=base_url, max_retries=0) as client:
            with pytest.raises(openai.InternalServerError):
                client.responses.create(model="scripted-policy", input="[task:weather-1] go")
            answer = client.responses.create(model="scripted-policy", input="[task:weather-1] go")
        assert [item.type for item in answer.output] == ["reasoning", "function_call", "function_call"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15.0) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()
    assert [json.loads(line)["kind"] for line in log.read_text().splitlines()] == ["status"]


def test_request_log_limit_keeps_the_latest_records_and_exact_counts(
    serve_policy: Callable[..., PolicyServer],
) -> None:
    server = serve_policy(request_log_limit=2)
    body = {"model": "scripted-policy", "messages": [{"role": "user", "content": "hi"}]}
    for n in range(3):
        response = httpx.post(
            f"{server.base_url}/chat/completions", json=body, headers={"X-Rollout-Id": f"r{n}"}, timeout=10
        )
        assert response.status_code == 200
    assert [r.rollout_id for r in server.request_log] == ["r1", "r2"]
    assert server.state.calls == 3
    assert server.state.wait_for_requests(3, timeout=30)
    assert server.state.wait_for_requests(1, timeout=30, rollout_id="r2")


async def test_served_tcp_connections_send_without_waiting_for_acks() -> None:
    # uvicorn writes an answer's head and body apart: with Nagle's algorithm on, the body waited for
    # the client's delayed ACK (~40 ms a request). asyncio turns it off only on sockets that say TCP.
    nodelay: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = writer.get_extra_info("socket")
        nodelay.set_result(served.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(accepted, sock=bind_socket())
    try:
        host, port = server.sockets[0].getsockname()[:2]
        _, writer = await asyncio.open_connection(host, port)
        async with asyncio.timeout(30):
            assert await nodelay != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
