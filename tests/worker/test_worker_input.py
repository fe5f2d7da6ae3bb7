"""Worker input validation: any input.json runs, or is refused with exit 2 and a result naming the field.

Mostly in-process (``parse_input``, property-based), then a handful of hostile
files through the real ``rollcage worker`` command: a FIFO, a device, a
directory, nesting 1000 deep, a lone surrogate in an id, ``Infinity``, bytes
that are not UTF-8. Every one must end the same way: exit code 2, a ``fatal``
result that says what is wrong, one error line in the log and no traceback.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage.errors import ConfigError
from rollcage.protocol import MAX_JSON_DEPTH, RunnerError, WorkerInput, WorkerResult
from rollcage.worker import EXIT_INVALID_INPUT, parse_input

BASE: dict[str, Any] = {
    "rollout_id": "r-1",
    "task_id": "t-1",
    "input": "What is 40 + 2?",
    "instructions": "Use the tools.",
    "model": {
        "base_url": "http://127.0.0.1:9/v1",
        "model": "m",
        "sampling": {"temperature": 0.0, "seed": 7},
        "timeout_s": 5,
        "max_retries": 0,
    },
    "agent": {"max_policy_calls": 2, "tool_timeout_s": 5},
    "executor": {"interrupt_grace_s": 1},
    "tools": [{"type": "python"}],
    "resources": {"weather": {"base_url": "http://127.0.0.1:9/weather", "timeout_s": 3}},
    "model_cookies": {"session": "abc"},
}

# Numbers that break a timeout, a serialiser or a sandbox: drawn far more often than chance would.
_SPECIAL = st.sampled_from([math.inf, -math.inf, math.nan, 1e308, 1e-320, -1.0, 0, 2**64, -(2**63) - 1])
_NUMERIC_FIELDS = [
    ("model", "timeout_s"),
    ("model", "connect_timeout_s"),
    ("model", "retry_backoff_s"),
    ("model", "max_retries"),
    ("model", "sampling", "temperature"),
    ("model", "sampling", "seed"),
    ("agent", "tool_timeout_s"),
    ("agent", "max_policy_calls"),
    ("executor", "interrupt_grace_s"),
    ("resources", "weather", "timeout_s"),
    ("result_mode",),
]

_LEAF = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # inf and nan included
    | st.text(max_size=12)
    | st.sampled_from(["\udfff", "a\ud800b", "expected", "api_key", "0o777", ""])
)
_VALUES = _SPECIAL | st.recursive(
    _LEAF,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["x", "reward", "grader", "type", "name", "\udc80"]), children, max_size=3
        )
    ),
    max_leaves=10,
)


def _deep(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


def _paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    found = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            found += _paths(child, (*path, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += _paths(child, (*path, index))
    return found


@st.composite
def _inputs(draw: st.DrawFn) -> bytes:
    """The base input with a few places replaced (or new keys added) by arbitrary JSON-ish values."""
    data: Any = json.loads(json.dumps(BASE))
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        path = draw(st.sampled_from(_paths(data)) | st.sampled_from(_NUMERIC_FIELDS))
        if path in _NUMERIC_FIELDS and not isinstance(_at_or_none(data, path[:-1]), dict):
            continue
        new = draw(_VALUES | st.builds(_deep, st.integers(min_value=MAX_JSON_DEPTH - 3, max_value=300)))
        if draw(st.booleans()) and isinstance(_at_or_none(data, path), dict):
            _at(data, path)[draw(st.sampled_from(["extra", "api_key", "timeout_s", "\udfff"]))] = new
        elif not path:
            data = new
        else:
            _at(data, path[:-1])[path[-1]] = new
    # json writes Infinity/NaN and \\udfff escapes, as a careless (or hostile) producer would.
    return json.dumps(data, allow_nan=True, ensure_ascii=True).encode()


def _at_or_none(value: Any, path: tuple[str | int, ...]) -> Any:
    try:
        return _at(value, path)
    except (KeyError, IndexError, TypeError):
        return None


def _at(value: Any, path: tuple[str | int, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


@given(_inputs())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_input_is_accepted_and_writable_or_refused_naming_the_field(raw: bytes) -> None:
    try:
        spec = parse_input(raw)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message
        assert "field '" in message or "not valid JSON" in message, message
        # The fatal result carrying this message can always be published.
        error = RunnerError(kind="fatal", type="ConfigError", message=message)
        WorkerResult(
            rollout_id="",
            task_id="",
            response=None,
            termination_reason="error",
            error=error,
            started_at=0,
            ended_at=0,
        ).model_dump_json()
        return
    # Whatever was accepted can be written back (journal, result) and is finite everywhere.
    dumped = orjson.dumps(spec.model_dump(mode="json"))
    assert WorkerInput.model_validate_json(dumped) == spec
    for name in ("timeout_s", "connect_timeout_s", "retry_backoff_s"):
        assert math.isfinite(getattr(spec.model, name))
    assert math.isfinite(spec.agent.tool_timeout_s)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"model": {**BASE["model"], "timeout_s": math.inf}}, "model.timeout_s"),
        ({"agent": {"tool_timeout_s": math.nan}}, "agent.tool_timeout_s"),
        (
            {"resources": {"weather": {"base_url": "u", "timeout_s": -math.inf}}},
            "resources.weather.timeout_s",
        ),
        ({"model": {**BASE["model"], "timeout_s": 1e300}}, "model.timeout_s"),
        ({"model": {**BASE["model"], "sampling": {"seed": 2**80}}}, "model.sampling.seed"),
        ({"rollout_id": "\udfff"}, "rollout_id"),
        ({"input": [{"type": "message", "content": _deep(200)}]}, "input[0].content"),
        ({"metadata": {"reward": 1}}, "metadata"),
    ],
)
def test_each_unsafe_value_is_refused_naming_its_field(change: dict[str, Any], field: str) -> None:
    raw = json.dumps({**BASE, **change}, allow_nan=True).encode()
    with pytest.raises(ConfigError, match=r"field '" + field.replace("[", r"\[").replace("]", r"\]")):
        parse_input(raw)


# --------------------------------------------------------------------------- through the real command


def _hostile_inputs(base: Path) -> dict[str, tuple[Path, tuple[str, ...]]]:
    """Name -> (INPUT path, words of which the fatal message must contain one)."""
    made: dict[str, tuple[Path, tuple[str, ...]]] = {}

    def write(name: str, data: bytes, *expect: str) -> None:
        path = base / f"{name}.json"
        path.write_bytes(data)
        made[name] = (path, expect)

    fifo = base / "fifo.json"
    os.mkfifo(fifo)
    made["fifo"] = (fifo, ("not a regular file (a FIFO)",))
    made["device"] = (Path("/dev/zero"), ("not a regular file (a character device)",))
    made["directory"] = (base, ("not a regular file (a directory)",))
    good = json.dumps(BASE)
    # pydantic-core's parser refuses it on Python 3.11 (its recursion limit), and parses it on 3.12,
    # where rollcage's own depth check names the field.
    deep = good[:-1].encode() + b', "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    write("deep", deep, "not valid JSON", "field 'x[0][0]")
    write("surrogate", good.replace('"r-1"', '"\\udfff"').encode(), "field 'rollout_id'")
    write(
        "infinity",
        good.replace('"timeout_s": 5', '"timeout_s": Infinity').encode(),
        "field 'model.timeout_s'",
    )
    write("not-utf8", b'{"rollout_id": "\xff\xfe"}', "not valid JSON")
    write("not-an-object", b"[1, 2]", "field '(top level)'")
    return made


def test_hostile_input_files_exit_2_with_a_fatal_result_and_no_traceback(tmp_path: Path) -> None:
    cases = _hostile_inputs(tmp_path)
    started = {}
    for name, (path, _) in cases.items():
        out = tmp_path / f"out-{name}"
        out.mkdir()
        log = (out / "worker.log").open("wb")
        started[name] = (
            subprocess.Popen(
                [sys.executable, "-m", "rollcage", "worker", str(path), str(out / "result.json")],
                stdout=log,
                stderr=subprocess.STDOUT,
            ),
            out,
            log,
        )
    failures = []
    deadline = time.monotonic() + 60  # one bound for all: a worker blocked on a FIFO must not stack up
    for name, (proc, out, log) in started.items():
        try:
            code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        log.close()
        text = (out / "worker.log").read_text(errors="replace")
        expect = cases[name][1]
        if code != EXIT_INVALID_INPUT or "Traceback" in text or not (out / "result.json").exists():
            failures.append((name, code, text[-500:]))
            continue
        result = WorkerResult.model_validate_json((out / "result.json").read_bytes())
        assert result.error is not None and result.error.kind == "fatal", name
        assert any(words in result.error.message for words in expect), (name, result.error.message)
        assert [line for line in text.splitlines() if " ERROR " in line] != [], name
    assert failures == []
