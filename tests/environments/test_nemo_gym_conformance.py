"""Conformance with NeMo Gym's resource-server protocol, checked with NeMo Gym's own request/response models.

The models below restate, in our words, the pydantic models a NeMo Gym resource
server validates its bodies with (``nemo_gym.base_resources_server`` and
``nemo_gym.openai_utils`` in NVIDIA-NeMo/Gym): the run request (``BaseRunRequest``:
``responses_create_params``, which forbids unknown fields), the verify request
(``BaseVerifyRequest``: plus a ``NeMoGymResponse``, an OpenAI ``Response`` whose
output items need ids, statuses and annotations, and whose usage needs its detail
blocks) and the verify response. Like NeMo Gym's, they are built on the OpenAI SDK's
types. Every body rollcage sends a real environment is checked against them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
from openai.types.responses import Response
from openai.types.responses.response_create_params import (
    Reasoning,
    ResponseTextConfigParam,
    ToolChoice,
    ToolParam,
)
from openai.types.responses.response_output_text import Annotation, Logprob
from openai.types.responses.response_reasoning_item import Summary
from pydantic import BaseModel, ConfigDict, Field

from rollcage.controller import Controller, RunConfig
from rollcage.controller._nemo_gym import to_nemo_response
from rollcage.controller._servers import AppServer
from rollcage.environments import create_app
from rollcage.protocol import (
    CallAttempt,
    ModelCall,
    ResponseOutput,
    RolloutRecord,
    TokenUsage,
    Trajectory,
    WorkerResult,
)
from tests.helpers.paths import EXAMPLES

EXAMPLE = EXAMPLES / "nemo-counter"
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# --------------------------------------------------------------------------- NeMo Gym's models, restated


class GymOutputText(BaseModel):
    annotations: list[Annotation]
    text: str
    type: Literal["output_text"]
    logprobs: list[Logprob] | None = None


class GymRefusal(BaseModel):
    refusal: str
    type: Literal["refusal"]


class GymOutputMessage(BaseModel):
    id: str
    content: list[Annotated[GymOutputText | GymRefusal, Field(discriminator="type")]]
    role: Literal["assistant"]
    status: ItemStatus
    type: Literal["message"]


class GymFunctionCall(BaseModel):
    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"]
    id: str | None = None
    status: ItemStatus | None = None


class GymFunctionCallOutput(BaseModel):
    call_id: str
    output: str
    type: Literal["function_call_output"]
    id: str | None = None
    status: ItemStatus | None = None


class GymReasoning(BaseModel):
    id: str
    summary: list[Summary]
    type: Literal["reasoning"]
    encrypted_content: str | None = None


GymOutputItem = Annotated[
    GymOutputMessage | GymFunctionCall | GymFunctionCallOutput | GymReasoning, Field(discriminator="type")
]


class GymInputTokensDetails(BaseModel):
    cached_tokens: int | None


class GymOutputTokensDetails(BaseModel):
    reasoning_tokens: int | None


class GymUsage(BaseModel):
    # NeMo Gym pins openai<=2.7.2, whose usage details hold just these counts (later SDKs add more).
    input_tokens: int
    input_tokens_details: GymInputTokensDetails
    output_tokens: int
    output_tokens_details: GymOutputTokensDetails
    total_tokens: int


class GymResponse(Response):
    output: list[GymOutputItem]  # type: ignore[assignment]
    usage: GymUsage | None = None  # type: ignore[assignment]


class GymCreateParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    background: bool | None = None
    include: list[str] | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    model: str | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: Reasoning | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    store: bool | None = None
    temperature: float | None = None
    text: ResponseTextConfigParam | None = None
    tool_choice: ToolChoice = "auto"
    tools: list[ToolParam] = Field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    stream: Literal[False] | None = None


class GymRunRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    responses_create_params: GymCreateParams


class GymVerifyRequest(GymRunRequest):
    response: GymResponse


class GymVerifyResponse(GymVerifyRequest):
    reward: float


# --------------------------------------------------------------------------- a recording server


class Recorder:
    """ASGI wrapper around an environment: records each request's path, Cookie header and body."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.requests: list[tuple[str, str | None, Any]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = dict((k.decode(), v.decode()) for k, v in scope["headers"])
        self.requests.append((scope["path"], headers.get("cookie"), json.loads(body or b"null")))
        delivered = False

        async def replay() -> Any:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@pytest.fixture
def counter() -> Iterator[tuple[Recorder, str]]:
    recorder = Recorder(create_app("nemo-counter"))
    server = AppServer(recorder, name="nemo-counter-test")
    try:
        yield recorder, server.start()
    finally:
        server.stop()


def session_of(cookie: str | None) -> str | None:
    for part in (cookie or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == "nemo_counter_session":
            return value
    return None


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
async def test_nemo_gym_dataset_runs_unchanged_and_every_body_conforms(
    tmp_path: Path, counter: tuple[Recorder, str]
) -> None:
    recorder, url = counter
    config = RunConfig(
        dataset=EXAMPLE / "dataset.jsonl", out=tmp_path / "out", environment=url, deadline_s=60, concurrency=2
    )
    summary = await Controller(config).run()
    records = {
        r.task_id: r
        for r in (
            RolloutRecord.model_validate_json(x)
            for x in (config.out / "rollouts.jsonl").read_bytes().splitlines()
        )
    }
    assert {t: (r.outcome, r.reward, r.masked, r.failure_kind) for t, r in records.items()} == {
        "line-1": ("completed", 1.0, False, None),
        "line-2": ("completed", 1.0, False, None),
        "line-3": ("completed", 0.0, False, "wrong_count"),
        "line-4": ("completed", 1.0, True, "never_read"),
    }
    m = summary.metrics
    assert (m.graded, m.masked, m.failure_kinds) == (3, 1, {"wrong_count": 1, "never_read": 1})
    assert m.mean_reward == pytest.approx(2 / 3) and m.pass_at_1 == pytest.approx(2 / 3)
    assert json.loads((config.out / "metrics.json").read_text())["masked"] == 1

    rows = [json.loads(line) for line in (EXAMPLE / "dataset.jsonl").read_text().splitlines()]
    by_session: dict[str | None, list[tuple[str, Any]]] = {}
    seeded: dict[str, dict[str, Any]] = {}
    for path, cookie, body in recorder.requests:
        if path == "/seed_session":
            assert cookie is None  # a fresh session per rollout
            request = GymRunRequest.model_validate(body)
            assert request.model_extra is not None and {"expected_count", "initial_count"} <= set(
                request.model_extra
            )
            assert body in rows  # the row itself, as NeMo Gym's agent sends it
            continue
        session = session_of(cookie)
        assert session is not None, f"{path} came without the session cookie"
        by_session.setdefault(session, []).append((path, body))
        if path == "/verify":
            verify = GymVerifyRequest.model_validate(body)
            assert verify.response.created_at == int(verify.response.created_at)
            assert isinstance(body["response"]["created_at"], int)
            assert verify.response.usage is not None and verify.response.usage.input_tokens > 0
            assert body["responses_create_params"] in [r["responses_create_params"] for r in rows]
            seeded[session] = body
    # Per session: seeded value in, tools, then verify, then close (seed came before, without a cookie).
    assert len(by_session) == 4
    for calls in by_session.values():
        paths = [p for p, _ in calls]
        assert paths[-2:] == ["/verify", "/close_session"], paths
        assert set(paths[:-2]) <= {"/increment_counter", "/get_counter_value"} and paths[:-2]
    # The verifier fields never entered the sandbox.
    for record in records.values():
        text = (Path(record.rollout_dir) / "input.json").read_text()
        assert "expected_count" not in text and "initial_count" not in text
        assert json.loads(text)["resource_cookies"].keys() == {"nemo_counter_session"}


# --------------------------------------------------------------------------- the response object


def result_with(output: list[dict[str, Any]], usage: TokenUsage) -> WorkerResult:
    now = time.time()
    call = ModelCall(
        id="r:m0",
        index=0,
        turn=0,
        api="chat",
        request={},
        status="completed",
        attempts=[CallAttempt(index=0, status="completed", started_at=now, ended_at=now)],
        started_at=now,
        ended_at=now,
    )
    return WorkerResult(
        rollout_id="r",
        task_id="t",
        response=ResponseOutput(
            id="r", model="m", status="completed", output=output, output_text="x", usage=usage
        ),
        trajectory=Trajectory(model_calls=[call]),
        termination_reason="completed",
        started_at=now + 0.75,
        ended_at=now,
    )


PARAMS = {
    "input": "hi",
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
}


@pytest.mark.parametrize(
    "usage",
    [
        TokenUsage(input_tokens=3, output_tokens=4, total_tokens=7, cached_tokens=1, reasoning_tokens=2),
        TokenUsage(input_tokens=3, output_tokens=4),
        TokenUsage(),
    ],
)
def test_every_output_shape_the_worker_produces_is_a_valid_nemo_gym_response(usage: TokenUsage) -> None:
    output = [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": "plain string content"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok", "status": "completed"},
        {"type": "function_call_output", "call_id": "c2", "output": "[cancelled]", "status": "incomplete"},
        {"type": "message", "id": "msg_server", "status": "completed", "role": "assistant", "content": []},
    ]
    body = to_nemo_response(result_with(output, usage), PARAMS)
    response = GymResponse.model_validate(body)
    assert isinstance(body["created_at"], int)
    assert (response.parallel_tool_calls, response.tool_choice) == (False, "auto")
    assert [t.name for t in response.tools] == ["f"]  # type: ignore[union-attr]
    assert all(item.id for item in response.output)  # type: ignore[union-attr]
    assert response.output[-1].id == "msg_server"  # a server's own id is kept
    assert [i.type for i in response.output] == [str(i["type"]) for i in output]
    if usage.input_tokens is None:
        assert response.usage is None  # unreported is not zero
    else:
        assert response.usage is not None and response.usage.total_tokens == 7
    GymVerifyResponse.model_validate({"responses_create_params": PARAMS, "response": body, "reward": 1.0})
