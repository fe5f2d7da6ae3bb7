"""Rows that validate must be able to run; datasets that are pipes are read once; nothing hangs.

A row that could never run (an id no header can carry, an input item no model client can
send, a controller-only key the worker would refuse, an input over the worker's bound, a NeMo
Gym setting that means nothing) is an invalid row with its line number and field, never an
attempt retried as ``infra_failure`` for ever.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollcage.controller._dataset as dataset_module
from rollcage.controller._dataset import InvalidRow, Task, iter_dataset, open_dataset, validate_value
from rollcage.errors import ConfigError
from rollcage.protocol import MAX_INPUT_BYTES, RolloutRecord

ENV = "http://127.0.0.1:9/"


@pytest.mark.parametrize("task_id", ["café", "日本-1", "a b", "emoji 👨\u200d👩\u200d👧", "50%-off", "Ωmega"])
def test_printable_unicode_ids_are_valid_rows(task_id: str) -> None:
    row = validate_value(4, {"id": task_id, "input": "hi"})
    assert isinstance(row, Task) and row.id == task_id


@pytest.mark.parametrize(
    ("task_id", "named"),
    [
        ("a\x00b", "U+0000"),
        ("a\u2028b", "U+2028"),
        ("a\u2029b", "U+2029"),
        ("line\nbreak", "U+000A"),
        ("tab\there", "U+0009"),
        ("del\x7f", "U+007F"),
        ("c1\x85", "U+0085"),
        ("lone\udfff", "surrogate"),
        ("evil\u202etxt", "U+202E"),
    ],
)
def test_ids_no_header_or_terminal_can_carry_are_refused_per_row(task_id: str, named: str) -> None:
    row = validate_value(9, {"id": task_id, "input": "hi"})
    assert isinstance(row, InvalidRow) and row.line == 9
    assert "id" in row.reason and named in row.reason


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [7]}]}, "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "audio"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 3}]}]}, "content[0].text"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "arguments"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        (
            {
                "input": "hi",
                "model": {"sampling": {"extra_body": {"chat_template_kwargs": {"api_key": "k"}}}},
            },
            "extra_body.chat_template_kwargs.api_key",
        ),
        (
            {"input": "hi", "model": {"sampling": {"extra_body": {"x": [{"grader": 1}]}}}},
            "extra_body.x[0].grader",
        ),
        ({"input": "hi", "model": {"sampling": {"temperature": -1}}}, "temperature"),
        ({"input": "hi", "model": {"sampling": {"top_p": 5}}}, "top_p"),
        ({"input": "hi", "tools": [{"type": "python", "name": "../../etc/passwd"}]}, "tool name"),
    ],
)
def test_rows_that_could_never_run_are_refused_with_their_line(row: dict[str, Any], says: str) -> None:
    result = validate_value(12, {"id": "t", **row})
    assert isinstance(result, InvalidRow) and result.line == 12, result
    assert says in result.reason


def test_an_input_over_the_workers_bound_is_refused_per_row() -> None:
    result = validate_value(3, {"id": "big", "input": "x" * MAX_INPUT_BYTES})
    assert isinstance(result, InvalidRow) and result.line == 3
    assert "MiB" in result.reason and "input" in result.reason


def _nemo(**params: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": "count", **params}, "id": "n"}


@pytest.mark.parametrize(
    ("row", "says"),
    [
        (_nemo(max_tool_calls=True), "responses_create_params.max_tool_calls"),
        (_nemo(max_tool_calls=-3), "responses_create_params.max_tool_calls"),
        (_nemo(max_tool_calls="5"), "responses_create_params.max_tool_calls"),
        (_nemo(temperature=-1), "responses_create_params.temperature"),
        (_nemo(temperature=True), "responses_create_params.temperature"),
        (_nemo(top_p=5), "responses_create_params.top_p"),
        (_nemo(input=[{"role": "wizard", "content": "x"}]), "input[0].role"),
        (_nemo(tools=[{"type": "function", "name": "../../etc/passwd"}]), "tool name '../../etc/passwd'"),
        (_nemo(tools=[{"type": "function", "name": "verify"}]), "tool name 'verify' is reserved"),
        (_nemo(tools=[{"type": "function", "name": "seed_session"}]), "reserved"),
        (_nemo(tools=[{"type": "function", "name": "submit"}]), "reserved"),
        ({**_nemo(), "id": "a\x00"}, "U+0000"),
    ],
)
def test_nemo_gym_rows_with_nonsense_settings_are_refused_naming_row_and_field(
    row: dict[str, Any], says: str
) -> None:
    result = validate_value(5, row, format="nemo-gym", environment=ENV)
    assert isinstance(result, InvalidRow) and result.line == 5, result
    assert says in result.reason


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ({"input": [{"role": "wizard", "content": "x"}], "target": "A"}, "role"),
        ({"input": "q", "target": "A", "id": "x\u2028y"}, "U+2028"),
    ],
)
def test_inspect_rows_with_nonsense_are_refused_naming_row_and_field(row: dict[str, Any], says: str) -> None:
    result = validate_value(6, row, format="inspect")
    assert isinstance(result, InvalidRow) and result.line == 6 and says in result.reason


def test_a_line_over_the_bound_is_an_invalid_row_and_the_next_one_still_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dataset_module, "MAX_LINE_BYTES", 64 * 1024)
    path = tmp_path / "d.jsonl"
    huge = json.dumps({"id": "huge", "input": "x" * 300_000})
    path.write_text(
        json.dumps({"id": "a", "input": "hi"})
        + "\n"
        + huge
        + "\n"
        + json.dumps({"id": "b", "input": "hi"})
        + "\n"
    )
    items = list(iter_dataset(path))
    assert [type(i).__name__ for i in items] == ["Task", "InvalidRow", "Task"]
    bad = items[1]
    assert isinstance(bad, InvalidRow) and bad.line == 2 and "over" in bad.reason
    assert isinstance(items[2], Task) and items[2].line == 3


def test_a_fifo_whose_writer_never_comes_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "rows"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"no program opened for writing within 0\.3 s"):
        open_dataset(fifo, writer_wait_s=0.3)


def test_a_fifo_is_read_once_into_a_copy_every_pass_reads(tmp_path: Path) -> None:
    fifo = tmp_path / "rows"
    os.mkfifo(fifo)
    rows = "".join(json.dumps({"id": f"t{i}", "input": "hi"}) + "\n" for i in range(3))

    def write() -> None:
        with open(fifo, "w") as out:  # blocks until the dataset is opened for reading
            out.write(rows)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    source = open_dataset(fifo, writer_wait_s=60)
    writer.join(timeout=60)
    try:
        assert source.path != fifo and source.path.read_text() == rows
        for _ in range(2):
            assert [t.id for t in iter_dataset(source.path) if isinstance(t, Task)] == ["t0", "t1", "t2"]
    finally:
        source.close()
    assert not source.path.exists()


@pytest.mark.parametrize("what", ["directory", "device"])
def test_a_dataset_that_is_no_file_or_pipe_is_refused(tmp_path: Path, what: str) -> None:
    path = tmp_path if what == "directory" else Path("/dev/null")
    with pytest.raises(ConfigError, match="give a JSONL file"):
        open_dataset(path)


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
@pytest.mark.timeout(300)
def test_rollcage_run_reads_a_piped_dataset_and_runs_every_row(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_text('tasks:\n  "*":\n    - text: "42"\n')
    rows = "".join(json.dumps({"id": f"t{i}", "input": "q", "expected": "42"}) + "\n" for i in range(3))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollcage",
            "run",
            "/dev/stdin",
            "--out",
            str(tmp_path / "out"),
            "--policy",
            str(tmp_path / "policy.yaml"),
            "--quiet",
            "--sandbox",
            os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap"),
        ],
        input=rows,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()
    records = [RolloutRecord.model_validate_json(line) for line in lines]
    assert sorted((r.task_id, r.outcome, r.reward) for r in records) == [
        (f"t{i}", "completed", 1.0) for i in range(3)
    ]


@pytest.mark.timeout(300)
def test_rollcage_run_on_a_fifo_without_a_writer_exits_2_with_a_reason(tmp_path: Path) -> None:
    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    (tmp_path / "policy.yaml").write_text('tasks:\n  "*":\n    - text: "42"\n')
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollcage",
            "run",
            str(fifo),
            "--out",
            str(tmp_path / "out"),
            "--policy",
            str(tmp_path / "policy.yaml"),
            "--quiet",
            "--sandbox",
            "none",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "no program opened for writing" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr


@settings(max_examples=50, deadline=None)
@given(
    name=st.text(max_size=70)
    | st.sampled_from(["../../etc/passwd", "verify", "close_session", "a/b", "get weather", "ok_name-1"]),
    format=st.sampled_from(["rollcage", "nemo-gym"]),
)
def test_a_tool_name_is_refused_per_row_or_is_safe_as_an_endpoint_path(name: str, format: str) -> None:
    if format == "nemo-gym":
        row: dict[str, Any] = _nemo(tools=[{"type": "function", "name": name}])
    else:
        row = {"id": "t", "input": "hi", "environment": ENV, "tools": [{"type": "resource", "name": name}]}
    result = validate_value(8, row, format=format, environment=ENV)  # type: ignore[arg-type]
    if isinstance(result, InvalidRow):
        assert result.line == 8 and ("tool" in result.reason or "name" in result.reason)
        return
    (tool,) = result.tools
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,64}", tool.name) and tool.name not in ("verify", "seed_session")
