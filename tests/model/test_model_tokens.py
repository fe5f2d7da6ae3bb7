"""Token-level data: prompt and generation token ids and logprobs, kept whenever the server sends them.

The scripted policy answers the way vLLM does when asked (its tokenizer is the
documented 4-bytes-a-token rule, so every expected id is computed, not copied);
hostile variants come over ``httpx.MockTransport``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from rollcage.model import ModelClient
from rollcage.policy import PolicyServer
from rollcage.policy._render import generation_token_ids, prompt_token_ids, reply_for, token_log_prob
from rollcage.policy._script import PolicyScript
from rollcage.protocol import ModelEndpoint, SamplingParams
from rollcage.wire import build_request

SCRIPT: dict[str, Any] = {
    "model": "scripted-policy",
    "tasks": {
        "act": [
            {
                "reasoning": "Weather first, then a sum — naïvely.",
                "tool_calls": [
                    {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    {"name": "python", "arguments": {"code": "print(40 + 2)"}},
                ],
            }
        ],
        "*": [{"text": "I don't know, said the model: ünïcödé."}],
    },
}
USER = [{"type": "message", "role": "user", "content": "What is the weather in Oslo, and 40+2?"}]
ASK_ALL = SamplingParams(
    logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True, "prompt_logprobs": 0}
)
MODES = [
    pytest.param(api, stream, id=f"{api}-{'stream' if stream else 'plain'}")
    for api in ("chat", "responses")
    for stream in (False, True)
]


@pytest.fixture(scope="module")
def server() -> Iterator[PolicyServer]:
    with PolicyServer(SCRIPT, keep_bodies=True) as srv:
        yield srv


def _endpoint(server: PolicyServer, api: str, stream: bool, sampling: SamplingParams) -> ModelEndpoint:
    return server.endpoint(api=api, stream=stream, max_retries=0, timeout_s=10.0).model_copy(
        update={"sampling": sampling}
    )


def _expected_generation(task: str) -> list[int]:
    turn = PolicyScript.model_validate(SCRIPT).turn(task, 0)
    assert turn is not None
    return generation_token_ids(reply_for(turn, 0))


@pytest.mark.parametrize(("api", "stream"), MODES)
async def test_prompt_and_generation_ids_and_logprobs_are_kept_exactly(
    server: PolicyServer, api: str, stream: bool
) -> None:
    rollout = f"all-{api}-{stream}"
    async with ModelClient(
        _endpoint(server, api, stream, ASK_ALL), rollout_id=rollout, task_id="act"
    ) as client:
        call = await client.call(USER, instructions="Be brief.", index=0)
    sent = next(r.body for r in server.state.requests if r.rollout_id == rollout)
    assert sent is not None
    tokens = call.tokens
    assert (tokens.status, tokens.missing, tokens.scope, tokens.note) == ("observed", [], "generation", None)
    assert tokens.prompt_token_ids == prompt_token_ids(sent)
    assert tokens.generation_token_ids == _expected_generation("act")
    assert tokens.generation_log_probs == [
        token_log_prob(token, position) for position, token in enumerate(tokens.generation_token_ids)
    ]
    # They agree with the counts the server reported, and what the model sampled is all there.
    assert (len(tokens.prompt_token_ids), len(tokens.generation_token_ids)) == (
        call.usage.input_tokens,
        call.usage.output_tokens,
    )
    if api == "chat":  # vLLM's prompt_logprobs: a log probability per prompt token, none for the first
        assert tokens.prompt_log_probs is not None and len(tokens.prompt_log_probs) == len(
            tokens.prompt_token_ids
        )
        assert tokens.prompt_log_probs[0] is None and None not in tokens.prompt_log_probs[1:]
    # The prompt-long arrays are kept once, in tokens, not again in the raw response.
    assert b"prompt_token_ids" not in orjson.dumps(call.response)
    assert b"prompt_logprobs" not in orjson.dumps(call.response)


@pytest.mark.parametrize(("api", "stream"), MODES)
async def test_without_asking_the_token_data_is_unobserved_not_empty(
    server: PolicyServer, api: str, stream: bool
) -> None:
    endpoint = _endpoint(server, api, stream, SamplingParams())
    async with ModelClient(endpoint, rollout_id=f"none-{api}-{stream}", task_id="act") as client:
        call = await client.call(USER, index=0)
    assert call.tokens.status == "unobserved"
    assert call.tokens.missing == ["prompt_token_ids", "generation_token_ids", "generation_log_probs"]
    assert call.tokens.generation_token_ids is None and call.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_output_text_logprobs_are_kept_and_said_to_cover_the_text_only(
    server: PolicyServer, stream: bool
) -> None:
    endpoint = _endpoint(server, "responses", stream, SamplingParams(logprobs=True, top_logprobs=1))
    async with ModelClient(endpoint, rollout_id=f"text-{stream}", task_id="plain") as client:
        call = await client.call(USER, index=0)
    tokens = call.tokens
    assert (tokens.status, tokens.scope) == ("partial", "message_text")
    assert tokens.missing == ["prompt_token_ids", "generation_token_ids"]
    assert (
        tokens.generation_log_probs is not None
        and len(tokens.generation_log_probs) == call.usage.output_tokens
    )


async def test_vllm_token_id_strings_give_the_generation_ids(server: PolicyServer) -> None:
    sampling = SamplingParams(logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    async with ModelClient(
        _endpoint(server, "chat", True, sampling), rollout_id="ids", task_id="act"
    ) as client:
        call = await client.call(USER, index=0)
    assert call.tokens.generation_token_ids == _expected_generation("act")
    assert (call.tokens.status, call.tokens.missing) == ("partial", ["prompt_token_ids"])


def test_logprobs_and_the_pass_through_fields_are_sent_in_each_api_dialect() -> None:
    sampling = SamplingParams(
        logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True, "top_k": 5}
    )
    endpoint = ModelEndpoint(base_url="http://x/v1", model="m", sampling=sampling)
    chat = build_request(endpoint, USER, instructions=None, tools=None)
    assert (chat["logprobs"], chat["top_logprobs"], chat["return_token_ids"], chat["top_k"]) == (
        True,
        3,
        True,
        5,
    )
    responses = build_request(
        endpoint.model_copy(update={"api": "responses"}), USER, instructions=None, tools=None
    )
    assert responses["include"] == ["message.output_text.logprobs"] and responses["top_logprobs"] == 3
    assert "logprobs" not in responses and responses["return_token_ids"] is True


def _chat_answer(**choice: Any) -> dict[str, Any]:
    return {
        "id": "c",
        "object": "chat.completion",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop", **choice}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def _call_with(answer: dict[str, Any]) -> Any:
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=answer))
    endpoint = ModelEndpoint(base_url="http://model/v1", model="m", max_retries=0)
    async with ModelClient(endpoint, rollout_id="r", task_id="t", transport=transport) as client:
        return await client.call(USER, index=0)


async def test_arrays_that_contradict_each_other_are_dropped_with_a_note_not_trusted() -> None:
    logprobs = {"content": [{"token": "h", "logprob": -0.1}]}  # one log probability for two token ids
    call = await _call_with(_chat_answer(token_ids=[7, 8], logprobs=logprobs))
    assert call.status == "completed" and call.tokens.generation_token_ids == [7, 8]
    assert call.tokens.generation_log_probs is None and call.tokens.status == "partial"
    assert (
        call.tokens.note is not None and "2 generation token ids and 1 log probabilities" in call.tokens.note
    )


@pytest.mark.parametrize(
    ("choice", "field"),
    [
        ({"token_ids": ["seven"]}, "choices[0].token_ids[0]"),
        (
            {"logprobs": {"content": [{"token": "h", "logprob": "high"}]}},
            "choices[0].logprobs.content[0].logprob",
        ),
        ({"token_ids": {}}, "choices[0].token_ids"),
    ],
    ids=["ids-of-strings", "logprob-of-string", "ids-not-a-list"],
)
async def test_token_fields_of_the_wrong_type_are_dropped_with_a_note_and_the_call_stands(
    choice: dict[str, Any], field: str
) -> None:
    call = await _call_with(_chat_answer(**choice))
    assert call.status == "completed" and call.tokens.status != "observed"
    assert call.tokens.note is not None and field in call.tokens.note
