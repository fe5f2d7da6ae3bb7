"""Dataset rows: validation with line numbers, resolution of environments, tools and graders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rollcage.controller import (
    Endpoints,
    EnvironmentEndpoint,
    InvalidRow,
    Task,
    iter_dataset,
    prepare_rollout,
    rollout_id,
)
from rollcage.controller._dataset import detect_format, validate_row
from rollcage.errors import ConfigError
from rollcage.protocol import (
    BashToolSpec,
    EditorToolSpec,
    ModelEndpoint,
    PythonToolSpec,
    ResourceToolSpec,
    WorkerInput,
)
from rollcage.wire import build_request, function_tools
from tests.helpers.paths import EXAMPLES

FULL_ROW: dict[str, Any] = {
    "id": "oslo-sum",
    "input": "Is it cold in Oslo? Also compute 40 + 2. Answer as <condition>;sum=<n>.",
    "instructions": "Use the tools.",
    "environment": "calc-weather",
    "tools": ["python", "get_weather"],
    "agent": {"mode": "function_calling", "max_policy_calls": 6},
    "model": {"sampling": {"temperature": 0}, "max_retries": 1},
    "expected": "cold;sum=42",
    "grader": {"type": "verify"},
    "metadata": {"split": "demo"},
}


def one(tmp_path: Path, value: Any) -> Task | InvalidRow:
    path = tmp_path / "d.jsonl"
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    (item,) = list(iter_dataset(path))
    return item


def invalid(tmp_path: Path, value: Any) -> str:
    item = one(tmp_path, value)
    assert isinstance(item, InvalidRow), item
    return item.reason


def test_full_row_resolves_environment_tools_and_grader(tmp_path: Path) -> None:
    task = one(tmp_path, FULL_ROW)
    assert isinstance(task, Task)
    assert task.environment is not None and task.environment.key == "calc-weather"
    assert task.tools[0] == PythonToolSpec()
    assert isinstance(task.tools[1], ResourceToolSpec)
    assert (task.tools[1].name, task.tools[1].resource) == ("get_weather", "calc-weather")
    assert task.grader is not None and task.grader.type == "verify"
    assert task.row.model.max_retries == 1


def test_defaults_environment_tools_and_verify_grader(tmp_path: Path) -> None:
    task = one(tmp_path, {"id": "x", "input": "hi", "environment": "calc-weather", "expected": "a"})
    assert isinstance(task, Task)
    assert [t.name for t in task.tools] == ["python", "get_weather", "set_units"]
    assert task.grader is not None and task.grader.type == "verify"


def test_a_row_asks_for_bash_and_the_editor_by_name(tmp_path: Path) -> None:
    task = one(
        tmp_path, {"id": "s", "input": "fix it", "tools": ["bash", "str_replace_based_edit_tool", "python"]}
    )
    assert isinstance(task, Task)
    assert task.tools == (BashToolSpec(), EditorToolSpec(), PythonToolSpec())
    alias = one(tmp_path, {"id": "s", "input": "fix it", "tools": ["str_replace_editor"]})
    assert isinstance(alias, Task) and alias.tools == (EditorToolSpec(name="str_replace_editor"),)
    spelled = one(
        tmp_path, {"id": "s", "input": "x", "tools": [{"type": "bash", "description": "Your shell."}]}
    )
    assert isinstance(spelled, Task) and spelled.tools == (BashToolSpec(description="Your shell."),)


def test_row_without_environment_gets_python_and_exact_grader(tmp_path: Path) -> None:
    task = one(tmp_path, {"id": 7, "input": "hi", "expected": "a"})
    assert isinstance(task, Task)
    assert task.id == "7"
    assert [t.name for t in task.tools] == ["python"]
    assert task.grader is not None and task.grader.type == "exact"
    ungraded = one(tmp_path, {"id": "u", "input": "hi"})
    assert isinstance(ungraded, Task) and ungraded.grader is None


def test_external_environment_is_an_url(tmp_path: Path) -> None:
    spec = {"type": "resource", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    task = one(tmp_path, {"id": "x", "input": "hi", "environment": "HTTP://10.0.0.5:8000/", "tools": [spec]})
    assert isinstance(task, Task)
    assert task.environment is not None and task.environment.url == "http://10.0.0.5:8000"
    key = task.environment.key
    assert key.startswith("env-10.0.0.5-8000-")
    assert isinstance(task.tools[0], ResourceToolSpec) and task.tools[0].resource == key


def test_each_external_url_gets_its_own_deterministic_key(tmp_path: Path) -> None:
    def key(url: str) -> str:
        task = one(tmp_path, {"id": "x", "input": "hi", "environment": url, "tools": ["python"]})
        assert isinstance(task, Task) and task.environment is not None
        return task.environment.key

    same = {key("http://127.0.0.1:8001"), key("http://127.0.0.1:8001/"), key("http://127.0.0.1:8001/")}
    assert len(same) == 1
    others = {key("http://127.0.0.1:8002"), key("http://127.0.0.1:8001/v2"), key("https://127.0.0.1:8001")}
    assert len(others | same) == 4


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("{oops", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"input": "hi"}, "field 'id': Field required"),
        ({"id": "", "input": "hi"}, "field 'id': must be 1 to 256 characters"),
        ({"id": "x"}, "field 'input': Field required"),
        ({"id": "x", "input": "hi", "answer": 1}, "field 'answer': unknown field"),
        ({"id": "x", "input": "hi", "environment": "nope"}, "unknown environment 'nope'"),
        ({"id": "x", "input": "hi", "environment": "calc-weather", "tools": ["fly"]}, "unknown tool 'fly'"),
        ({"id": "x", "input": "hi", "tools": ["python", "python"]}, "tool names must be unique"),
        (
            {"id": "x", "input": "hi", "tools": ["bash"], "agent": {"mode": "codeact"}},
            "tools ['bash'] are offered only as function tools",
        ),
        (
            {"id": "x", "input": "hi", "tools": ["sh"]},
            "known here are python, bash, str_replace_based_edit_tool",
        ),
        ({"id": "x", "input": "hi", "grader": {"type": "verify"}}, "needs an 'environment'"),
        ({"id": "x", "input": "hi", "grader": {"type": "numeric"}}, "needs 'expected'"),
        ({"id": "x", "input": "hi", "grader": {"type": "telepathy"}}, "grader"),
        ({"id": "x", "input": "hi", "agent": {"max_policy_calls": 0}}, "agent.max_policy_calls"),
    ],
)
def test_malformed_row_has_a_reason(tmp_path: Path, value: Any, reason: str) -> None:
    assert reason in invalid(tmp_path, value)


def test_lines_are_numbered_blank_lines_skipped_and_duplicates_rejected(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    rows = [json.dumps({"id": "a", "input": "x"}), "", "{bad", json.dumps({"id": "a", "input": "y"})]
    path.write_text("\n".join(rows) + "\n")
    items = list(iter_dataset(path))
    assert [(type(i).__name__, i.line) for i in items] == [("Task", 1), ("InvalidRow", 3), ("InvalidRow", 4)]
    assert isinstance(items[2], InvalidRow) and "duplicate id 'a' (first on line 1)" in items[2].reason


def test_dataset_is_streamed_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"id": "a", "input": "x"}) + "\n")
    rows = iter_dataset(path)
    assert isinstance(next(rows), Task)
    with path.open("a") as handle:  # rows appended after reading began are still seen
        handle.write(json.dumps({"id": "b", "input": "y"}) + "\n")
    assert [i.line for i in rows] == [2]


def test_missing_dataset_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read dataset"):
        list(iter_dataset(tmp_path / "missing.jsonl"))


def test_rollout_ids_are_deterministic_safe_and_distinct() -> None:
    assert rollout_id("oslo-sum", 0, 1) == "oslo-sum-s0-t1"
    odd = rollout_id("a b/c", 2, 0)
    assert odd == rollout_id("a b/c", 2, 0)
    assert odd.startswith("a_b_c~") and odd.endswith("-s2-t0") and "/" not in odd
    assert rollout_id("a_b_c", 0, 0) != rollout_id("a b/c", 0, 0).replace("-s2-", "-s0-")
    assert rollout_id("a b", 0, 0) != rollout_id("a/b", 0, 0)
    assert not rollout_id("..", 0, 0).startswith(".")
    assert len(rollout_id("x" * 250, 0, 0)) < 120


def test_bundled_example_datasets_are_valid() -> None:
    root = EXAMPLES
    for name in ("calc-weather", "code-fn"):
        items = list(iter_dataset(root / name / "dataset.jsonl"))
        assert items and all(isinstance(i, Task) for i in items), name
    counter = root / "nemo-counter" / "dataset.jsonl"
    assert detect_format(counter) == "nemo-gym"
    items = list(iter_dataset(counter, format="nemo-gym", environment="nemo-counter"))
    assert len(items) == 4 and all(isinstance(i, Task) for i in items)


# --------------------------------------------------------------------------- BOM, patterns, verifier fields


def test_a_bom_on_line_one_is_not_part_of_the_row(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"id": "a", "input": "x"}).encode() + b"\n")
    assert [type(i).__name__ for i in iter_dataset(path)] == ["Task"]
    path.write_bytes(b"\xef\xbb\xbf\n" + json.dumps({"id": "a", "input": "x"}).encode() + b"\n")
    assert [(type(i).__name__, i.line) for i in iter_dataset(path)] == [("Task", 2)]


@pytest.mark.parametrize(
    "grader",
    [{"type": "regex", "pattern": "(unclosed"}, {"type": "regex", "pattern": "a{2,1}"}, {"type": "regex"}],
)
def test_a_regex_that_does_not_compile_is_rejected_with_its_line(
    tmp_path: Path, grader: dict[str, Any]
) -> None:
    path = tmp_path / "d.jsonl"
    rows = [{"id": "ok", "input": "x"}, {"id": "bad", "input": "x", "expected": "[z-a]", "grader": grader}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = list(iter_dataset(path))
    assert isinstance(items[1], InvalidRow) and items[1].line == 2
    assert "grader 'regex': bad pattern" in items[1].reason


def test_verifier_fields_are_controller_only(tmp_path: Path) -> None:
    task = one(
        tmp_path, {"id": "v", "input": "x", "environment": "nemo-counter", "verifier": {"expected_count": 6}}
    )
    assert isinstance(task, Task) and task.verifier == {"expected_count": 6, "expected": None}


# --------------------------------------------------------------------------- other harnesses' rows

COUNTER_TOOL = {
    "type": "function",
    "name": "increment_counter",
    "parameters": {"type": "object", "properties": {"count": {"type": "integer"}}},
    "strict": True,
}
NEMO = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "add 1"}],
        "instructions": "be brief",
        "tools": [COUNTER_TOOL],
        "temperature": 0.2,
        "max_tool_calls": 5,
        "parallel_tool_calls": False,
    },
    "expected_count": 4,
    "agent_ref": {"name": "simple_agent"},
}


def rows_of(tmp_path: Path, rows: list[Any], **options: Any) -> list[Task | InvalidRow]:
    path = tmp_path / "d.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return list(iter_dataset(path, **options))


def test_nemo_gym_rows_map_to_model_side_and_controller_side(tmp_path: Path) -> None:
    (task,) = rows_of(tmp_path, [NEMO], format="nemo-gym", environment="http://127.0.0.1:8123")
    assert isinstance(task, Task) and task.id == "line-1"
    row = task.row
    assert row.input == [{"type": "message", "role": "user", "content": "add 1"}]
    assert row.instructions == "be brief" and row.agent.max_tool_calls == 5
    assert row.model.sampling is not None and row.model.sampling.temperature == 0.2
    assert row.model.sampling.parallel_tool_calls is False
    assert [(t.name, t.resource) for t in task.tools] == [("increment_counter", task.environment.key)]  # type: ignore[union-attr]
    assert [t.strict for t in task.tools] == [True]  # type: ignore[union-attr]
    assert task.grader is not None and task.grader.type == "verify"
    assert task.verifier == {"expected_count": 4, "agent_ref": {"name": "simple_agent"}}
    assert task.create_params == NEMO["responses_create_params"]
    assert row.expected is None and row.metadata == {}


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"responses_create_params": {"input": "x"}}, "pass --environment"),
        ({"responses_create_params": "x"}, "must be an object"),
        ({"responses_create_params": {"input": []}}, "non-empty list"),
        ({"responses_create_params": {"input": "x", "stream": True}}, "non-streaming"),
        ({"responses_create_params": {"input": "x", "seed": 1}}, "responses_create_params.seed: not a field"),
        (
            {"responses_create_params": {"input": "x", "tools": [{"type": "web_search"}]}},
            "only function tools",
        ),
        ({"responses_create_params": {"input": ["x"]}}, "input[0] must be an object"),
    ],
)
def test_unusable_nemo_gym_rows_say_which_field(tmp_path: Path, row: dict[str, Any], reason: str) -> None:
    env = None if reason == "pass --environment" else "http://127.0.0.1:8123"
    (item,) = rows_of(tmp_path, [row], format="nemo-gym", environment=env)
    assert isinstance(item, InvalidRow) and reason in item.reason and item.reason.startswith("nemo-gym row: ")


def test_every_request_field_of_a_nemo_gym_row_reaches_the_model(tmp_path: Path) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "default": None}}}
    params = {
        "input": "x",
        "tools": [COUNTER_TOOL],
        "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "name": "increment_counter"},
        "reasoning": {"effort": "medium", "summary": "detailed"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
        "top_logprobs": 2,
        "truncation": "disabled",
        "metadata": {
            "extra_body": '{"top_k": 5, "stop": ["</x>"]}',
            "chat_template_kwargs": '{"think": false}',
        },
    }
    (task,) = rows_of(
        tmp_path, [{"responses_create_params": params}], format="nemo-gym", environment="http://e"
    )
    assert isinstance(task, Task)
    endpoint = ModelEndpoint(base_url="http://m/v1", model="m", sampling=task.row.model.sampling)
    tools = function_tools(list(task.tools), codeact=False)
    chat = build_request(endpoint, "x", instructions=None, tools=tools)
    assert chat["parallel_tool_calls"] is False and chat["top_logprobs"] == 2 and chat["stop"] == ["</x>"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "increment_counter"}}
    assert chat["reasoning_effort"] == "medium" and chat["tools"][0]["function"]["strict"] is True
    schema_format = {k: v for k, v in params["text"]["format"].items() if k != "type"}  # type: ignore[index]
    assert chat["response_format"] == {"type": "json_schema", "json_schema": schema_format}
    assert (chat["top_k"], chat["chat_template_kwargs"]) == (5, {"think": False})
    responses_endpoint = endpoint.model_copy(update={"api": "responses"})
    responses = build_request(responses_endpoint, "x", instructions=None, tools=tools)
    for key in ("parallel_tool_calls", "tool_choice", "reasoning", "text", "top_logprobs"):
        assert responses[key] == params[key], key
    assert responses["tools"][0]["strict"] is True and "stop" not in responses


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("background", True),
        ("include", ["file_search_call.results"]),
        ("previous_response_id", "resp_1"),
        ("prompt", {"id": "p"}),
        ("service_tier", "flex"),
        ("truncation", "auto"),
        ("user", "u1"),
        ("metadata", {"audio_data": "data:audio/wav;base64,AA"}),
        ("tool_choice", {"type": "allowed_tools", "tools": []}),
        ("reasoning", {"effort": "medium", "generate_summary": "auto"}),
        ("text", {"format": {"type": "json_schema"}}),
    ],
)
def test_a_nemo_gym_request_field_rollcage_cannot_send_refuses_the_row(
    tmp_path: Path, field: str, value: Any
) -> None:
    row = {"responses_create_params": {"input": "x", field: value}}
    (item,) = rows_of(tmp_path, [row], format="nemo-gym", environment="http://e")
    assert isinstance(item, InvalidRow) and f"responses_create_params.{field}" in item.reason, item


def test_inspect_samples_map_target_to_expected_and_choices_to_the_prompt(tmp_path: Path) -> None:
    samples = [
        {"input": "2+2?", "target": "4", "id": 7, "metadata": {"src": "x"}},
        {
            "input": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "Pick"}]},
            ],
            "target": "B",
            "choices": ["red", "blue"],
        },
        {"input": "no target"},
        {"input": "x", "files": {"a.txt": "hi"}},
        {"input": [{"role": "tool", "content": "x"}], "target": "x"},
    ]
    first, second, third, files, tool = rows_of(tmp_path, samples, format="inspect")
    assert isinstance(first, Task) and first.id == "7" and first.row.expected == "4"
    assert first.grader is not None and first.grader.type == "match" and first.row.metadata == {"src": "x"}
    assert first.tools == ()  # generate() offers no tools
    assert isinstance(second, Task) and second.id == "line-2"
    prompt = second.row.input[-1]["content"]  # type: ignore[index]
    assert prompt.startswith("Answer the following multiple choice question.") and "one of A,B." in prompt
    assert prompt.endswith("Pick\n\nA) red\nB) blue")
    assert second.grader is not None and second.grader.type == "choice"
    assert isinstance(third, Task) and third.grader is None
    assert isinstance(files, InvalidRow) and "files" in files.reason
    assert isinstance(tool, InvalidRow) and "role: 'tool'" in tool.reason


def test_inspect_sandboxes_with_one_docker_image_map_to_the_task_image(tmp_path: Path) -> None:
    (tmp_path / "compose.yaml").write_text("services:\n  default:\n    image: localhost:5000/task:1\n")
    (tmp_path / "two.yaml").write_text("services:\n  a:\n    image: x\n  b:\n    image: y\n")
    (tmp_path / "built.yml").write_text("services:\n  default:\n    build: .\n")
    sample = {"input": "fix it", "target": "ok"}
    samples = [
        {**sample, "sandbox": ["docker", "compose.yaml"]},
        {**sample, "sandbox": {"type": "docker", "config": {"image": "python:3.12"}}},
        {**sample, "sandbox": "local"},
        {**sample, "sandbox": "docker"},
        {**sample, "sandbox": ["docker", "two.yaml"]},
        {**sample, "sandbox": ["docker", "built.yml"]},
        {**sample, "sandbox": ["docker", "Dockerfile"]},
        {**sample, "sandbox": ["k8s", "values.yaml"]},
        {**sample, "sandbox": ["docker", "missing.yaml"]},
        {**sample, "sandbox": {"type": "docker", "config": {"image": "Not A Ref"}}},
    ]
    compose, direct, local, bare, two, built, dockerfile, k8s, missing, bad = rows_of(
        tmp_path, samples, format="inspect"
    )
    assert isinstance(compose, Task) and compose.row.sandbox is not None
    assert compose.row.sandbox.image == "docker://localhost:5000/task:1"
    assert isinstance(direct, Task) and direct.row.sandbox is not None
    assert direct.row.sandbox.image == "docker://docker.io/library/python:3.12"
    assert isinstance(local, Task) and local.row.sandbox is None
    refused = {
        "bare": (bare, "names no image"),
        "two": (two, "2 services"),
        "built": (built, "has a build"),
        "dockerfile": (dockerfile, "not a compose file"),
        "k8s": (k8s, "type 'k8s' cannot be mapped"),
        "missing": (missing, "cannot read the compose file"),
        "bad": (bad, "repository component"),
    }
    for name, (item, reason) in refused.items():
        assert isinstance(item, InvalidRow), name
        assert reason in item.reason and "\n" not in item.reason, (name, item.reason)


def test_a_row_sandbox_image_is_checked_and_made_canonical(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "input": "x", "sandbox": {"image": "docker://localhost:5000/t:1"}},
        {"id": "b", "input": "x", "sandbox": {"image": "docker://debian"}},
        {"id": "c", "input": "x", "sandbox": {"image": "podman://x"}},
        {"id": "d", "input": "x", "sandbox": {"image": "dir:/x", "cpus": 2}},
    ]
    first, second, third, fourth = rows_of(tmp_path, rows)
    assert isinstance(first, Task) and first.row.sandbox is not None
    assert first.row.sandbox.image == "docker://localhost:5000/t:1"
    assert isinstance(second, Task) and second.row.sandbox is not None
    assert second.row.sandbox.image == "docker://docker.io/library/debian"
    assert isinstance(third, InvalidRow) and "unknown transport 'podman'" in third.reason
    assert isinstance(fourth, InvalidRow) and "cpus" in fourth.reason


def test_format_is_detected_from_the_first_rows(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    for rows, expected in [
        ([NEMO], "nemo-gym"),
        (["{bad", {"input": "q", "target": "a"}], "inspect"),
        ([FULL_ROW], "rollcage"),
        ([{"input": "q", "target": "a", "instructions": "x"}], "rollcage"),
        (["[1]"], "rollcage"),
    ]:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        assert detect_format(path) == expected, rows


# --------------------------------------------------------------------------- property: an error, or it runs

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
KEYS = [
    "id", "input", "instructions", "environment", "tools", "agent", "executor", "model", "expected", "grader",
    "metadata", "verifier", "responses_create_params", "target", "choices", "expected_count",
]  # fmt: skip
PLAUSIBLE = st.dictionaries(st.sampled_from(KEYS), JSON, max_size=6) | st.fixed_dictionaries(
    {"id": st.text(max_size=4) | st.integers(), "input": st.text(max_size=8) | st.lists(JSON, max_size=2)},
    optional={
        "grader": JSON,
        "tools": JSON,
        "environment": st.sampled_from(["calc-weather", "http://h:1/", "x"]),
    },
)
NEMO_PLAUSIBLE = st.fixed_dictionaries(
    {
        "responses_create_params": st.fixed_dictionaries(
            {
                "input": st.text(max_size=8)
                | st.lists(st.fixed_dictionaries({"role": st.text(max_size=9), "content": JSON}), max_size=2)
            },
            optional={
                "tools": st.lists(
                    st.fixed_dictionaries({"name": st.text(max_size=5)}, optional={"type": JSON}), max_size=2
                ),
                "temperature": JSON,
                "instructions": JSON,
                "max_tool_calls": JSON,
                "stream": JSON,
            },
        )
    },
    optional={"id": JSON, "task_id": JSON},
)
CANARY = "CANARY-7f3e"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    value=PLAUSIBLE | JSON,
    fmt=st.sampled_from(["rollcage", "nemo-gym", "inspect"]),
    line=st.integers(1, 10**6),
)
@example(value={"input": "x", "\n": 1}, fmt="inspect", line=1)  # an unknown key named by a newline
@example(value={"responses_create_params": {"\n": None}}, fmt="nemo-gym", line=1)  # a request field named so
def test_any_row_is_a_clear_error_on_its_line_or_a_task_that_runs(value: Any, fmt: Any, line: int) -> None:
    if isinstance(value, dict):
        value = {**value, "expected_count": CANARY}
    raw = json.dumps(value).encode()
    item = validate_row(line, raw, format=fmt, environment="http://127.0.0.1:9")
    if isinstance(item, InvalidRow):
        assert item.line == line and item.reason and "\n" not in item.reason
        return
    endpoints = Endpoints(
        model=ModelEndpoint(base_url="http://127.0.0.1:1/v1", model="m"),
        environments={item.environment.key: EnvironmentEndpoint(url="http://127.0.0.1:9")}
        if item.environment
        else {},
    )
    prepared = prepare_rollout(item, 0, 0, out_dir=Path("/nonexistent"), endpoints=endpoints)
    text = prepared.worker_input.model_dump_json()
    assert WorkerInput.model_validate_json(text) == prepared.worker_input  # input.json round-trips: it runs
    if fmt == "nemo-gym":
        assert CANARY not in text  # verifier fields stay on the controller's side
