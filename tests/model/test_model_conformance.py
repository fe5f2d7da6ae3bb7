"""Our client and the official openai SDK read the same bodies the same way.

The corpus: hand-written bodies shaped like OpenAI's and vLLM's/SGLang's
published responses (``tests/fixtures/responses/``: tool calls, reasoning,
length stops, usage details, missing usage, malformed tool arguments, streams),
and what ``serve-policy`` emits for every kind of turn. Each body is fed to both
over a mock transport; they must agree on text, tool calls, finish status,
reasoning and every token count. What we *send* is checked the other way round:
the SDK's request types accept our messages and tools, and the SDK, given our
payload's fields as its keyword arguments, sends exactly the same JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import httpx2
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.responses import FunctionToolParam, ResponseInputParam
from pydantic import TypeAdapter

from rollcage.model import ModelClient
from rollcage.policy import PolicyServer
from rollcage.protocol import ModelCall, ModelEndpoint
from rollcage.wire import build_request
from tests.helpers.paths import FIXTURES

FIXTURES = FIXTURES / "responses"
BASE_URL = "http://model.test/v1"

SCRIPT: dict[str, Any] = {
    "tasks": {
        "tools": [
            {
                "reasoning": "Two calls at once.",
                "tool_calls": [
                    {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    {"name": "python", "arguments": {"code": "print(sum([40, 2]))"}},
                ],
            }
        ],
        "text": [{"text": "cold;sum=42 – ünïcödé ✓"}],
        "codeact": [{"text": "Running:", "code": "print('hi')"}],
        "length": [{"text": "This stops", "finish": "length"}],
        "raw": [{"text": "Calling.", "tool_calls": [{"name": "python", "arguments_raw": "{bad json"}]}],
        "reasoning-only": [{"reasoning": "Just thinking."}],
    }
}


@dataclass(frozen=True)
class Case:
    """One response body and how it was asked for."""

    name: str
    api: str
    stream: bool
    body: bytes


@dataclass(frozen=True)
class View:
    """What both parsers must agree on."""

    text: str
    tool_calls: tuple[tuple[str, str, str], ...]
    status: str
    incomplete_reason: str | None
    reasoning: str
    input_tokens: int | None
    output_tokens: int | None
    reasoning_tokens: int | None
    cached_tokens: int | None
    total_tokens: int | None


def fixture_cases() -> list[Case]:
    cases = []
    for path in sorted(FIXTURES.iterdir()):
        api = "chat" if path.name.startswith("chat_") else "responses"
        cases.append(Case(path.stem, api, path.suffix == ".sse", path.read_bytes()))
    return cases


def server_cases() -> list[Case]:
    """What serve-policy emits, for every kind of turn, API style and mode."""
    cases = []
    with (
        PolicyServer(SCRIPT, faults=["task=text:rollout=empty:kind=empty"]) as server,
        httpx.Client() as http,
    ):
        for api in ("chat", "responses"):
            for stream in (False, True):
                for task, rollout in [(task, "r") for task in SCRIPT["tasks"]] + [("text", "empty")]:
                    request: dict[str, Any] = {"model": "scripted-policy", "stream": stream}
                    if api == "chat":
                        request |= {"messages": [{"role": "user", "content": "hi"}]}
                        request |= {"stream_options": {"include_usage": True}} if stream else {}
                    else:
                        request |= {"input": "hi"}
                    path = "/chat/completions" if api == "chat" else "/responses"
                    answer = http.post(
                        server.base_url + path,
                        json=request,
                        headers={"X-Task-Id": task, "X-Rollout-Id": rollout},
                    )
                    answer.raise_for_status()
                    name = f"server-{api}-{'stream' if stream else 'plain'}-{task}-{rollout}"
                    cases.append(Case(name, api, stream, answer.content))
    return cases


CORPUS = fixture_cases() + server_cases()


def test_corpus_covers_the_shapes_that_matter() -> None:
    names = {case.name for case in CORPUS}
    assert sum(case.api == "chat" and not case.name.startswith("server") for case in CORPUS) >= 6
    assert sum(case.api == "responses" and not case.name.startswith("server") for case in CORPUS) >= 4
    assert {"chat_vllm_reasoning_content_tool_call", "responses_openai_incomplete"} <= names
    assert any(case.stream for case in CORPUS if not case.name.startswith("server"))


def _content_type(case: Case) -> str:
    return "text/event-stream" if case.stream else "application/json"


async def ours(case: Case) -> ModelCall:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=case.body, headers={"content-type": _content_type(case)})

    endpoint = ModelEndpoint(base_url=BASE_URL, model="m", api=case.api, stream=case.stream)  # type: ignore[arg-type]
    async with ModelClient(
        endpoint, rollout_id="r", task_id="t", transport=httpx.MockTransport(handler)
    ) as client:
        return await client.call([{"type": "message", "role": "user", "content": "hi"}])


def view_of_ours(record: ModelCall) -> View:
    return View(
        text="".join(
            part["text"] for item in record.output if item["type"] == "message" for part in item["content"]
        ),
        tool_calls=tuple(
            (item["call_id"], item["name"], item["arguments"])
            for item in record.output
            if item["type"] == "function_call"
        ),
        status=record.status,
        incomplete_reason=record.incomplete_reason,
        reasoning="".join(
            part["text"] for item in record.output if item["type"] == "reasoning" for part in item["summary"]
        ),
        **record.usage.model_dump(),
    )


def sdk_client(case: Case) -> openai.AsyncOpenAI:
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, content=case.body, headers={"content-type": _content_type(case)})

    return openai.AsyncOpenAI(
        api_key="unused",
        base_url=BASE_URL,
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
    )


async def theirs(case: Case) -> View:
    async with sdk_client(case) as client:
        if case.api == "chat":
            messages: Any = [{"role": "user", "content": "hi"}]
            if case.stream:
                try:
                    async with client.chat.completions.stream(model="m", messages=messages) as stream:
                        completion: Any = await stream.get_final_completion()
                except openai.LengthFinishReasonError as exc:
                    completion = exc.completion  # the SDK's assembly, refused only for structured parsing
            else:
                completion = await client.chat.completions.create(model="m", messages=messages)
            return view_of_sdk_chat(completion)
        if case.stream and b"response.completed" in case.body:
            # The SDK's accumulator also checks every delta lands on an item announced before.
            async with client.responses.stream(model="m", input="hi") as events:
                response: Any = await events.get_final_response()
        elif case.stream:
            # The helper insists on response.completed; for incomplete streams take the SDK's terminal event.
            stream = await client.responses.create(model="m", input="hi", stream=True)
            terminal = [
                event
                async for event in stream
                if event.type.startswith("response.") and hasattr(event, "response")
            ]
            response = terminal[-1].response
        else:
            response = await client.responses.create(model="m", input="hi")
        return view_of_sdk_response(response)


def view_of_sdk_chat(completion: Any) -> View:
    choice = completion.choices[0]
    message = choice.message
    extra = message.model_extra or {}
    usage = completion.usage
    incomplete = choice.finish_reason in ("length", "content_filter")
    return View(
        text=message.content or "",
        tool_calls=tuple((c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []),
        status="incomplete" if incomplete else "completed",
        incomplete_reason=choice.finish_reason if incomplete else None,
        reasoning=extra.get("reasoning_content") or extra.get("reasoning") or "",
        input_tokens=usage.prompt_tokens if usage else None,
        output_tokens=usage.completion_tokens if usage else None,
        reasoning_tokens=usage.completion_tokens_details.reasoning_tokens
        if usage and usage.completion_tokens_details
        else None,
        cached_tokens=usage.prompt_tokens_details.cached_tokens
        if usage and usage.prompt_tokens_details
        else None,
        total_tokens=usage.total_tokens if usage else None,
    )


def view_of_sdk_response(response: Any) -> View:
    usage = response.usage
    reasoning = ""
    for item in response.output:
        if item.type == "reasoning":
            summary = "".join(part.text for part in item.summary)
            reasoning += summary or "".join(part.text for part in item.content or [])
    return View(
        text=response.output_text,
        tool_calls=tuple(
            (item.call_id, item.name, item.arguments)
            for item in response.output
            if item.type == "function_call"
        ),
        status=response.status,
        incomplete_reason=response.incomplete_details.reason if response.incomplete_details else None,
        reasoning=reasoning,
        input_tokens=usage.input_tokens if usage else None,
        output_tokens=usage.output_tokens if usage else None,
        reasoning_tokens=usage.output_tokens_details.reasoning_tokens
        if usage and usage.output_tokens_details
        else None,
        cached_tokens=usage.input_tokens_details.cached_tokens
        if usage and usage.input_tokens_details
        else None,
        total_tokens=usage.total_tokens if usage else None,
    )


@pytest.mark.parametrize("case", CORPUS, ids=[case.name for case in CORPUS])
async def test_our_parse_agrees_with_the_sdk(case: Case) -> None:
    mine = view_of_ours(await ours(case))
    reference = await theirs(case)
    assert mine == reference


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("chat_openai_parallel_tools", (1210, 183, 128, 1024, 1393)),
        ("chat_vllm_reasoning_content_tool_call", (312, 89, None, None, 401)),
        ("chat_vllm_reasoning_field_cached", (520, 41, None, 496, 561)),
        ("chat_vllm_no_usage", (None, None, None, None, None)),
        ("responses_openai_reasoning_function_calls", (2048, 310, 256, 1920, 2358)),
        ("responses_vllm_reasoning_text", (68, 23, 14, 64, 91)),
        ("responses_no_usage", (None, None, None, None, None)),
        ("chat_stream_vllm_reasoning_tool_call", (312, 40, 6, None, 352)),
    ],
)
async def test_token_fields_are_exact_and_missing_ones_stay_none(
    name: str, expected: tuple[int | None, ...]
) -> None:
    (case,) = [case for case in CORPUS if case.name == name]
    usage = (await ours(case)).usage
    got = (
        usage.input_tokens,
        usage.output_tokens,
        usage.reasoning_tokens,
        usage.cached_tokens,
        usage.total_tokens,
    )
    assert got == expected


# --------------------------------------------------------------------------- what we send


ITEMS: list[dict[str, Any]] = [
    {"type": "message", "role": "user", "content": "Weather in Oslo?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "cold"},
]
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_the_sdk_sends_what_we_send(api: str, stream: bool) -> None:
    endpoint = ModelEndpoint(
        base_url=BASE_URL,
        model="m",
        api=api,  # type: ignore[arg-type]
        stream=stream,
        sampling={"temperature": 0.5, "top_p": 0.9, "max_output_tokens": 64},
    )
    payload = build_request(endpoint, ITEMS, instructions="Be brief.", tools=TOOLS)
    # Shapes first: the SDK's own request types accept our messages/items and tools.
    if api == "chat":
        TypeAdapter(list[ChatCompletionMessageParam]).validate_python(payload["messages"])
        TypeAdapter(list[ChatCompletionToolParam]).validate_python(payload["tools"])
    else:
        TypeAdapter(ResponseInputParam).validate_python(payload["input"])
        TypeAdapter(list[FunctionToolParam]).validate_python(payload["tools"])
    captured: list[dict[str, Any]] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        captured.append(orjson.loads(request.content))
        return httpx2.Response(400, json={"error": {"message": "captured"}})

    async with openai.AsyncOpenAI(
        api_key="unused",
        base_url=BASE_URL,
        max_retries=0,
        http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)),
    ) as client:
        with pytest.raises(openai.BadRequestError):
            if api == "chat":
                await client.chat.completions.create(**payload)
            else:
                await client.responses.create(**payload)
    assert captured == [payload]
