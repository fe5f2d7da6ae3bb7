"""The artifacts' contracts: schemas validate examples, controller-only state is rejected."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from rollcage.protocol import (
    SCHEMA_VERSION,
    BoundaryRecord,
    CallAttempt,
    CallTokens,
    CapturedBody,
    CapturedMessage,
    CaptureExchange,
    Checkpoint,
    ModelCall,
    ModelEndpoint,
    ResourceEndpoint,
    ResourceToolSpec,
    RolloutHealth,
    RolloutRecord,
    RunMetrics,
    RunnerError,
    SupervisorReceipt,
    ToolCall,
    Trajectory,
    Turn,
    WorkerInput,
    WorkerResult,
    artifact_models,
)


def _input(**extra: Any) -> dict[str, Any]:
    return {
        "rollout_id": "r-1",
        "task_id": "t-1",
        "input": "What is the weather?",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "m"},
        **extra,
    }


def _call(index: int = 0) -> ModelCall:
    return ModelCall(
        id=f"r-1:m{index}",
        index=index,
        turn=index,
        api="chat",
        request={"messages": [{"role": "user", "content": "hi"}]},
        input=[{"type": "message", "role": "user", "content": "hi"}],
        response={"id": "x"},
        status="completed",
        output=[{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
        tokens=CallTokens(prompt_token_ids=[1, 2], generation_token_ids=[3], generation_log_probs=[-0.1]),
        attempts=[
            CallAttempt(
                index=0,
                status="failed",
                http_status=503,
                error=RunnerError(kind="transient", type="TransientModelError", message="HTTP 503"),
                started_at=1.0,
                ended_at=1.2,
            ),
            CallAttempt(index=1, status="completed", http_status=200, started_at=1.5, ended_at=2.0),
        ],
        started_at=1.0,
        ended_at=2.0,
    )


def _receipt() -> SupervisorReceipt:
    return SupervisorReceipt(
        rollout_id="r-1",
        outcome="completed",
        outcome_reason="valid result, no error",
        sandbox="bwrap",
        exit_code=0,
        deadline_s=60,
        grace_s=5,
        deadline_fired=False,
        stop_requested=False,
        started_at=1.0,
        ended_at=2.0,
        duration_s=1.0,
        cleanup_confirmed=True,
        result_present=True,
        result_valid=True,
    )


EXAMPLES: dict[str, BaseModel] = {
    "WorkerInput": WorkerInput.model_validate(_input()),
    "WorkerResult": WorkerResult(
        rollout_id="r-1",
        task_id="t-1",
        response=None,
        trajectory=Trajectory(
            model_calls=[_call()],
            tool_calls=[
                ToolCall(call_id="c", name="python", arguments="{}", turn=0, status="pending", started_at=1)
            ],
            turns=[
                Turn(
                    index=0,
                    id="r-1:t0",
                    started_at=1.0,
                    ended_at=2.0,
                    input=[{"type": "message", "role": "user", "content": "hi"}],
                    model_calls=["r-1:m0"],
                    tool_calls=["c"],
                    tool_steps=1,
                    resolution="acted",
                )
            ],
        ),
        termination_reason="cancelled",
        error=RunnerError(kind="cancelled", type="Cancelled", message="SIGTERM"),
        started_at=1.0,
        ended_at=2.0,
    ),
    "BoundaryRecord": BoundaryRecord(kind="model_call", at=1.0, model_call=_call()),
    "Checkpoint": Checkpoint(seq=3),
    "SupervisorReceipt": _receipt(),
    "RolloutRecord": RolloutRecord(
        rollout_id="r-1",
        task_id="t-1",
        sample=0,
        try_index=0,
        outcome="completed",
        graded=True,
        reward=1.0,
        receipt=_receipt(),
        health=RolloutHealth(
            verdict="unhealthy", findings={"model_call_failed": 1}, successful_model_calls=2
        ),
        rollout_dir="runs/x/rollouts/r-1",
    ),
    "CaptureExchange": CaptureExchange(
        seq=1,
        rollout_id="r-1",
        route="model",
        name=None,
        method="POST",
        path="/model/v1/chat/completions",
        upstream_url="http://127.0.0.1:8000/v1/chat/completions",
        credential_added=True,
        request=CapturedMessage(
            headers=[("authorization", "[redacted]")], body=CapturedBody(size=2, json_value={})
        ),
        response=CapturedMessage(headers=[], body=CapturedBody(size=2, text="ok"), status=200),
        status=200,
        started_at=1.0,
        first_byte_at=1.5,
        ended_at=2.0,
        duration_s=1.0,
        error=None,
    ),
    "RunMetrics": RunMetrics(
        dataset="d.jsonl",
        tasks=1,
        rollouts=1,
        outcomes={"completed": 1, "agent_error": 0, "timeout": 0, "cancelled": 0, "infra_failure": 0},
        graded=1,
        mean_reward=1.0,
        pass_at_1=1.0,
        pass_at_k=1.0,
        k=1,
        retries=0,
    ),
}


def _validate_against_schema(schema: dict[str, Any], instance: Any) -> None:
    """A small JSON Schema check of the parts pydantic emits (types, required, properties, refs)."""
    defs = schema.get("$defs", {})

    def check(node: dict[str, Any], value: Any, where: str) -> None:
        if "$ref" in node:
            check(defs[node["$ref"].split("/")[-1]], value, where)
            return
        if "anyOf" in node:
            errors = []
            for option in node["anyOf"]:
                try:
                    check(option, value, where)
                    return
                except AssertionError as exc:
                    errors.append(str(exc))
            raise AssertionError(f"{where}: no anyOf branch matched: {errors}")
        if "oneOf" in node:
            matched = 0
            for option in node["oneOf"]:
                try:
                    check(option, value, where)
                    matched += 1
                except AssertionError:
                    pass
            assert matched == 1, f"{where}: {matched} oneOf branches matched"
            return
        if "const" in node:
            assert value == node["const"], f"{where}: {value!r} != const {node['const']!r}"
        if "enum" in node:
            assert value in node["enum"], f"{where}: {value!r} not in {node['enum']}"
        kind = node.get("type")
        types = {
            "object": dict,
            "array": list,
            "string": str,
            "integer": int,
            "number": (int, float),
            "boolean": bool,
            "null": type(None),
        }
        if kind is not None:
            assert isinstance(value, types[kind]), f"{where}: {value!r} is not {kind}"
        if kind == "object":
            for name in node.get("required", []):
                assert name in value, f"{where}: missing required {name!r}"
            props = node.get("properties", {})
            if node.get("additionalProperties") is False:
                extra = set(value) - set(props)
                assert not extra, f"{where}: unexpected {extra}"
            for name, sub in props.items():
                if name in value:
                    check(sub, value[name], f"{where}.{name}")
        if kind == "array" and "items" in node:
            for i, item in enumerate(value):
                check(node["items"], item, f"{where}[{i}]")

    check(schema, instance, "$")


@pytest.mark.parametrize("name", sorted(artifact_models()))
def test_schema_validates_an_example_instance(name: str) -> None:
    model = artifact_models()[name]
    example = EXAMPLES[name]
    schema = model.model_json_schema()
    _validate_against_schema(schema, json.loads(example.model_dump_json()))
    assert model.model_validate_json(example.model_dump_json()) == example


def test_every_artifact_has_an_example() -> None:
    assert set(EXAMPLES) == set(artifact_models())


def test_schema_checker_rejects_a_wrong_instance() -> None:
    """The checker above must be able to fail, or the round trip proves nothing."""
    schema = SupervisorReceipt.model_json_schema()
    bad = json.loads(_receipt().model_dump_json())
    bad["outcome"] = "graded"
    with pytest.raises(AssertionError):
        _validate_against_schema(schema, bad)


@pytest.mark.parametrize("field", ["expected_answer", "reward", "api_key"])
def test_worker_input_rejects_controller_only_field_by_name(field: str) -> None:
    with pytest.raises(ValidationError) as info:
        WorkerInput.model_validate(_input(**{field: "secret"}))
    assert field in str(info.value)
    assert "controller-only" in str(info.value)


def test_worker_input_rejects_controller_state_nested_in_settings() -> None:
    data = _input()
    data["model"]["api_key"] = "sk-123"
    with pytest.raises(ValidationError, match=r"model\.api_key"):
        WorkerInput.model_validate(data)


def test_worker_input_rejects_unknown_field() -> None:
    with pytest.raises(ValidationError) as info:
        WorkerInput.model_validate(_input(temprature=0.3))
    assert "temprature" in str(info.value)


def test_worker_input_allows_such_words_in_model_visible_text() -> None:
    spec = WorkerInput.model_validate(
        _input(input=[{"type": "message", "role": "user", "content": "reward?"}])
    )
    assert spec.input[0]["content"] == "reward?"  # type: ignore[index]


def test_resource_tool_must_name_a_known_resource() -> None:
    tool = ResourceToolSpec(name="get_weather", resource="weather")
    with pytest.raises(ValidationError, match="weather"):
        WorkerInput.model_validate(_input(tools=[tool.model_dump()]))
    ok = WorkerInput.model_validate(
        _input(
            tools=[tool.model_dump()],
            resources={"weather": ResourceEndpoint(base_url="http://x").model_dump()},
        )
    )
    assert ok.tools[0].name == "get_weather"


def test_bash_and_editor_tools_round_trip_and_are_refused_in_codeact() -> None:
    tools = [{"type": "bash"}, {"type": "editor", "name": "str_replace_editor"}]
    spec = WorkerInput.model_validate(_input(tools=tools))
    assert [(type(t).__name__, t.name) for t in spec.tools] == [
        ("BashToolSpec", "bash"),
        ("EditorToolSpec", "str_replace_editor"),
    ]
    assert WorkerInput.model_validate_json(spec.model_dump_json()) == spec
    with pytest.raises(ValidationError, match="str_replace_based_edit_tool"):
        WorkerInput.model_validate(_input(tools=[{"type": "editor", "name": "vim"}]))
    with pytest.raises(ValidationError, match="offered only as a function tool"):
        WorkerInput.model_validate(_input(tools=[{"type": "bash"}], agent={"mode": "codeact"}))


def test_model_endpoint_has_no_field_for_a_key() -> None:
    assert not any("key" in name for name in ModelEndpoint.model_fields)


def _property_names(schema: Any) -> set[str]:
    names: set[str] = set()
    if isinstance(schema, dict):
        names.update(k.lower() for k in schema.get("properties", {}))
        for value in schema.values():
            names |= _property_names(value)
    elif isinstance(schema, list):
        for value in schema:
            names |= _property_names(value)
    return names


def test_worker_artifacts_have_no_reward_or_grade_field() -> None:
    for model in (WorkerResult, Checkpoint, BoundaryRecord, SupervisorReceipt, WorkerInput):
        names = _property_names(model.model_json_schema())
        assert not {n for n in names if "reward" in n or "grade" in n or "score" in n}, model.__name__
    assert "reward" in _property_names(RolloutRecord.model_json_schema())  # the check can see one


def test_published_results_are_frozen() -> None:
    result = EXAMPLES["WorkerResult"]
    with pytest.raises(ValidationError):
        result.rollout_id = "other"  # type: ignore[misc]


def test_schema_command_prints_every_artifact_and_one() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollcage", "schema"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    schemas = json.loads(out)
    assert set(schemas) == set(artifact_models())
    assert {schema["x-rollcage-schema-version"] for schema in schemas.values()} == {SCHEMA_VERSION}
    one = subprocess.run(
        [sys.executable, "-m", "rollcage", "schema", "WorkerInput"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert json.loads(one)["title"] == "WorkerInput"
    bad = subprocess.run(
        [sys.executable, "-m", "rollcage", "schema", "Nope"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode != 0 and "unknown artifact" in bad.stderr


@pytest.mark.parametrize(
    "name", ["WorkerInput", "WorkerResult", "SupervisorReceipt", "RolloutRecord", "RunMetrics"]
)
@pytest.mark.parametrize("version", [1, SCHEMA_VERSION + 1])
def test_an_artifact_of_another_schema_version_is_refused_naming_both_versions(
    name: str, version: int
) -> None:
    model = artifact_models()[name]
    data = json.loads(EXAMPLES[name].model_dump_json())
    data["schema_version"] = version
    with pytest.raises(ValidationError) as raised:
        model.model_validate_json(json.dumps(data))
    message = str(raised.value)
    assert f"schema version {version}" in message and f"reads version {SCHEMA_VERSION} only" in message
    assert ("an older rollcage" if version < SCHEMA_VERSION else "a newer rollcage") in message


@pytest.mark.parametrize(
    ("extra_body", "problem"),
    [
        ({"return_token_ids": True, "prompt_logprobs": 0, "chat_template_kwargs": {"x": [1]}}, None),
        ({"messages": []}, "rollcage sets itself"),
        ({"logprobs": True}, "rollcage sets itself"),
        ({"n": 4}, "rollcage sets itself"),
        ({"bad key": 1}, "not a request field name"),
        ({"api_key": "sk-1"}, "controller-only"),
        ({f"k{i}": i for i in range(33)}, "at most 32"),
        ({"deep": json.loads("[" * 17 + "]" * 17)}, "nested more than 16"),
        ({"big": "x" * 70_000}, "at most 65536"),
    ],
)
def test_extra_body_is_a_validated_pass_through(extra_body: dict[str, Any], problem: str | None) -> None:
    data = _input(
        model={"base_url": "http://127.0.0.1:9/v1", "model": "m", "sampling": {"extra_body": extra_body}}
    )
    if problem is None:
        assert WorkerInput.model_validate(data).model.sampling.extra_body == extra_body
        return
    with pytest.raises(ValueError, match=problem):
        WorkerInput.model_validate(data)


def test_call_tokens_say_what_was_not_observed_whatever_the_writer_claims() -> None:
    assert (CallTokens().status, CallTokens().missing) == (
        "unobserved",
        ["prompt_token_ids", "generation_token_ids", "generation_log_probs"],
    )
    partial = CallTokens.model_validate({"generation_token_ids": [1], "status": "observed", "missing": []})
    assert (partial.status, partial.missing) == ("partial", ["prompt_token_ids", "generation_log_probs"])
    whole = CallTokens(prompt_token_ids=[], generation_token_ids=[1, 2], generation_log_probs=[-1.0, -2.0])
    assert (whole.status, whole.missing) == ("observed", [])
    with pytest.raises(ValidationError, match="2 tokens but generation_log_probs 1"):
        CallTokens(generation_token_ids=[1, 2], generation_log_probs=[-1.0])


def test_a_record_with_its_result_in_memory_equals_the_same_record_read_back() -> None:
    record = EXAMPLES["RolloutRecord"]
    assert isinstance(record, RolloutRecord)
    held = RolloutRecord.model_validate_json(record.model_dump_json()).with_result(EXAMPLES["WorkerResult"])  # type: ignore[arg-type]
    assert held == record and held.result() is EXAMPLES["WorkerResult"]
    assert "_result" not in held.model_dump_json()
