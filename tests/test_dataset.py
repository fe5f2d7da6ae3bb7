"""Dataset rows: validation with line numbers, resolution of environments, tools and graders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import InvalidRow, Task, iter_dataset, rollout_id
from rollcage.errors import ConfigError
from rollcage.protocol import PythonToolSpec, ResourceToolSpec

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
        ({"input": "hi"}, "id: Field required"),
        ({"id": "", "input": "hi"}, "id: Value error"),
        ({"id": "x"}, "input: Field required"),
        ({"id": "x", "input": "hi", "answer": 1}, "answer: Extra inputs are not permitted"),
        ({"id": "x", "input": "hi", "environment": "nope"}, "unknown environment 'nope'"),
        ({"id": "x", "input": "hi", "environment": "calc-weather", "tools": ["fly"]}, "unknown tool 'fly'"),
        ({"id": "x", "input": "hi", "tools": ["python", "python"]}, "tool names must be unique"),
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
    root = Path(__file__).resolve().parent.parent / "examples"
    for name in ("calc-weather", "code-fn"):
        items = list(iter_dataset(root / name / "dataset.jsonl"))
        assert items and all(isinstance(i, Task) for i in items), name
