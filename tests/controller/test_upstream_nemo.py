"""NeMo Gym's own code reads what rollcage writes: the export, /verify's body, /close_session's body.

One real run (supervisor, bubblewrap, egress proxy, worker; the scripted policy for the
model; the calc-weather environment) covers both APIs, streaming and not, three parallel
tool calls one of which fails (HTTP 404), a call retried after an HTTP 503, a call cut
at the length limit, and plain tool-using and answer-only rollouts. Its
``export --format nemo-gym`` rows then go, unchanged, to the upstream packages in their
side environments (``tests/helpers/upstream.py``): NeMo Gym 0.7.0's own pydantic models
(``BaseVerifyResponse``, ``TrajectoryRecord`` strictly) and its ATIF converter
``gym_rollout_to_atif``, whose output Harbor 0.25.0's models and validator check. A row
NeMo Gym's strict converter cannot represent (a failed tool, a cut-off call) must be
refused for exactly that reason, never for the shape of what rollcage wrote.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import rollcage
from rollcage.controller._nemo_gym import close_request, run_request, to_nemo_response
from rollcage.export import export_run
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord
from tests.helpers.upstream import run_upstream, upstream_python

SANDBOX = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(600),
]

PARALLEL = {
    "reasoning": "Look up Oslo and Atlantis, and add with Python.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_weather", "arguments": {"city": "Atlantis"}},
        {"name": "python", "arguments": {"code": "print(sum([40, 2]))"}},
    ],
}
ONE_TOOL = {
    "reasoning": "Look it up.",
    "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
}
SCRIPT = {
    "model": "scripted-policy",
    "tasks": {
        "matrix": [
            PARALLEL,
            {"text": "cold;sum=42 — and a long explanation of why"},
            {"text": "cold;sum=42"},
        ],
        "matrix-r": [
            PARALLEL,
            {"text": "cold;sum=42 — and a long explanation of why"},
            {"text": "cold;sum=42"},
        ],
        "tooled": [ONE_TOOL, {"text": "cold"}],
        "tooled-r": [ONE_TOOL, {"text": "cold"}],
        "cut": [{"text": "cold — and a long explanation of why"}, {"text": "cold"}],
        "plain": [{"text": "cold"}],
        "slow": [ONE_TOOL, {"text": "cold"}],
        "codeact": [{"text": "Let me look:", "code": "print(get_weather(city='Oslo'))"}, {"text": "cold"}],
        "plain-r": [{"reasoning": "Oslo is cold.", "text": "cold"}],
    },
}
FAULTS = [
    # A call retried after an HTTP 503 (in rows NeMo Gym can represent too), a call cut at the length limit.
    *(f"rollout={task}-s0-t0:call=1:status=503" for task in ("matrix", "matrix-r", "tooled", "tooled-r")),
    *(f"rollout={task}-s0-t0:call=3:kind=length" for task in ("matrix", "matrix-r")),
    "rollout=cut-s0-t0:call=1:kind=length",
    "rollout=slow-s0-t0:call=2-9:kind=hang",  # the deadline passes while its second call is in flight
]
# Why NeMo Gym's strict converter refuses a row it cannot represent (its own words): the first thing it meets.
REFUSED_FOR = {
    "matrix": "tool execution 'call_0_1' is 'failed', not completed",  # the HTTP 404 of Atlantis
    "matrix-r": "tool execution 'call_0_1' is 'failed', not completed",
    "cut": "model call is 'incomplete', not completed",
    # The model saw its cell's output as a message (a later user turn), which NeMo Gym's ATIF cannot hold.
    "codeact": "later system or user turns are not supported",
    "slow": "invocations[0].status: expected completed, got 'incomplete'",
}

NEMO_SCRIPT = r"""
import json, sys
from nemo_gym.atif_export import AtifExportError, gym_rollout_to_atif
from nemo_gym.base_resources_server import (
    BaseVerifyRequest,
    BaseVerifyResponse,
    ResourcesCloseSessionRequest,
)
from nemo_gym.rollout_observability import TrajectoryRecord

data = json.load(sys.stdin)
out = {"rows": {}, "close": []}
for row in data["rows"]:
    BaseVerifyResponse.model_validate(row)
    TrajectoryRecord.model_validate(row["ng_trajectory"], strict=True)
    try:
        atif = gym_rollout_to_atif(row, session_id="rollcage-test", agent_version="1")
    except AtifExportError as exc:
        out["rows"][row["task_id"]] = {"refused": str(exc)}
    else:
        out["rows"][row["task_id"]] = {"atif": atif.model_dump(mode="json", exclude_none=True)}
for body in data["verify"]:
    BaseVerifyRequest.model_validate(body)
for body in data["close"]:
    ResourcesCloseSessionRequest.model_validate(body)
    out["close"].append("ok")
print(json.dumps(out))
"""

HARBOR_SCRIPT = r"""
import json, sys
from harbor.models.trajectories.trajectory import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator

out = {}
for name, document in json.load(sys.stdin).items():
    Trajectory.model_validate(document)
    validator = TrajectoryValidator()
    out[name] = [] if validator.validate(document) else validator.get_errors()
print(json.dumps(out))
"""


def _row(task_id: str, **model: Any) -> dict[str, Any]:
    return {
        "id": task_id,
        "environment": "calc-weather",
        "input": "Is it cold in Oslo, and in Atlantis? Compute sum([40, 2]). Answer <condition>;sum=<n>.",
        "instructions": "Use the tools. Reply with the answer only.",
        "tools": ["python", "get_weather"],
        "agent": {"max_policy_calls": 5},
        "model": {"max_retries": 1, **model},
        "expected": "cold;sum=42",
    }


# Every request field a NeMo Gym row may carry, as rollcage's sampling says it (NeMo rows map to it).
ASKED = {
    "parallel_tool_calls": False,
    "tool_choice": "auto",
    "reasoning": {"effort": "low", "summary": "auto"},
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "top_logprobs": 0,
}
NO_TOOLS = {**ASKED, "tool_choice": "none"}
ROWS = [
    _row("matrix"),
    _row("matrix-r", api="responses", stream=True),
    _row("tooled", stream=True, sampling=ASKED),
    _row("tooled-r", api="responses", sampling=ASKED),
    _row("cut", api="responses"),
    _row("plain", sampling=NO_TOOLS),
    _row("plain-r", api="responses", stream=True, sampling=NO_TOOLS),
    {**_row("codeact", api="responses"), "tools": ["get_weather"], "agent": {"mode": "codeact"}},
]


@dataclass
class Exported:
    rows: dict[str, dict[str, Any]]
    records: dict[str, RolloutRecord]


async def _collect(url: str, out: Path, rows: list[dict[str, Any]], **options: Any) -> None:
    async with rollcage.collect(
        rows,
        model=url,
        model_name="scripted-policy",
        attempts=1,
        concurrency=3,
        out=out,
        sandbox=SANDBOX,
        max_infra_retries=0,
        **options,
    ) as rollouts:
        async for _ in rollouts:
            pass


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exported]:
    upstream_python("nemo-gym")  # skip or fail before the run when the side environment is not there
    base = tmp_path_factory.mktemp("upstream-nemo")
    rows: list[dict[str, Any]] = []
    records: list[RolloutRecord] = []
    with PolicyServer(SCRIPT, faults=FAULTS) as server:
        # A timed-out rollout graded all the same (--grade-timeouts): NeMo Gym gets its row and /verify.
        runs: list[tuple[str, list[dict[str, Any]], dict[str, Any]]] = [
            ("run", ROWS, {"deadline_s": 120}),
            ("timeouts", [_row("slow", timeout_s=60)], {"deadline_s": 8, "grade_timeouts": True}),
        ]
        for name, dataset, options in runs:
            out = base / name
            asyncio.run(_collect(server.base_url, out, dataset, **options))
            report = export_run(out, "nemo-gym", base / f"{name}.jsonl")
            assert report.exported == len(dataset), dict(report.skipped)
            rows += [json.loads(line) for line in (base / f"{name}.jsonl").read_text().splitlines()]
            lines = (out / "rollouts.jsonl").read_bytes().splitlines()
            records += [RolloutRecord.model_validate_json(x) for x in lines]
    yield Exported({row["task_id"]: row for row in rows}, {r.task_id: r for r in records})


def test_rows_number_tasks_by_dataset_row_and_name_the_agent(exported: Exported) -> None:
    for index, row in enumerate(ROWS):  # (the timeouts run is a dataset of its own)
        got = exported.rows[row["id"]]
        assert got["_ng_task_index"] == index  # the dataset's order, whatever order rollouts finished in
        assert got["agent_ref"] == {"type": "responses_api_agents", "name": "rollcage"}


def test_nemo_gym_models_and_atif_converter_accept_every_representable_row(exported: Exported) -> None:
    records = exported.records.values()
    closes = [
        close_request(rollout_id=r.rollout_id, task_id=r.task_id, sample=r.sample, attempt=r.try_index)
        for r in records
    ]
    # Task ids NeMo Gym's EpisodeId would refuse as they are: spelled as it allows.
    closes += [
        close_request(rollout_id=rid, task_id=tid, sample=0, attempt=1)
        for rid, tid in (("x", "_odd id/with~stuff"), ("y", "-a1"), ("z", "é" * 200))
    ]
    # /verify's body, built as the controller builds it (rollcage.controller._unit._verify's parts).
    verify = []
    for record in records:
        result = record.result()
        assert result is not None
        params = exported.rows[record.task_id]["responses_create_params"]
        verify.append({**run_request(params, {}), "response": to_nemo_response(result, params)})
    answer = run_upstream(
        "nemo-gym",
        NEMO_SCRIPT,
        stdin=json.dumps({"rows": list(exported.rows.values()), "close": closes, "verify": verify}),
    )
    assert answer["close"] == ["ok"] * len(closes)
    converted: dict[str, Any] = {}
    for task_id, outcome in answer["rows"].items():
        if task_id in REFUSED_FOR:
            assert "refused" in outcome, f"{task_id} holds what NeMo Gym cannot represent, yet converted"
            assert REFUSED_FOR[task_id] in outcome["refused"], outcome["refused"]
        else:
            assert "atif" in outcome, f"{task_id}: NeMo Gym's converter refused the row: {outcome}"
            converted[task_id] = outcome["atif"]
    assert sorted(converted) == ["plain", "plain-r", "tooled", "tooled-r"]
    harbor = run_upstream("harbor", HARBOR_SCRIPT, stdin=json.dumps(converted))
    assert harbor == {name: [] for name in converted}
    tooled = converted["tooled"]["steps"]
    assert [step["source"] for step in tooled] == ["user", "agent", "agent"]
    assert tooled[1]["tool_calls"][0]["function_name"] == "get_weather"
    assert tooled[1]["observation"]["results"][0]["content"]


def test_the_run_went_as_scripted(exported: Exported) -> None:
    def calls(task_id: str) -> list[Any]:
        result = exported.records[task_id].result()
        assert result is not None
        return result.trajectory.model_calls

    for task_id in ("matrix", "matrix-r", "tooled", "tooled-r"):
        assert [a.http_status for a in calls(task_id)[0].attempts] == [503, 200]
    assert [c.status for c in calls("cut")] == ["incomplete", "completed"]
    assert [c.status for c in calls("matrix")] == ["completed", "incomplete", "completed"]
    assert exported.records["slow"].outcome == "timeout" and exported.records["slow"].graded


def test_codeact_rows_hold_what_the_model_saw_and_wrote_and_no_call_it_never_made(exported: Exported) -> None:
    row = exported.rows["codeact"]
    result = exported.records["codeact"].result()
    assert result is not None
    assert {t.call_id.split("-")[0] for t in result.trajectory.tool_calls} == {"cell", "bridge"}  # both ran
    output_types = [item["type"] for item in row["response"]["output"]]
    assert output_types == ["message", "message"], output_types  # the model's two answers, nothing else
    conversation = row["ng_trajectory"]["invocations"][0]["conversation"]
    assert [(i["type"], i["role"]) for i in conversation] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),  # the cell's output, as the model saw it
        ("message", "assistant"),
    ]
    assert "cold" in json.dumps(conversation[2]["content"])  # Oslo's weather, printed by the cell
    turns = row["ng_trajectory"]["turns"]
    assert turns[1]["question"] == conversation[:3] and turns[1]["answer"] == conversation[3:]
    # The executed cell is the step's tool record; the tool its code called is part of the cell.
    assert [t["tool_name"] for t in row["ng_trajectory"]["tool_calls"]] == ["python"]


def test_every_request_field_reaches_the_model_in_its_api_s_terms(exported: Exported) -> None:
    def sent(task_id: str) -> dict[str, Any]:
        result = exported.records[task_id].result()
        assert result is not None
        return result.trajectory.model_calls[0].request

    chat, responses = sent("tooled"), sent("tooled-r")
    for key in ("parallel_tool_calls", "tool_choice", "top_logprobs"):
        assert chat[key] == responses[key] == ASKED[key], key
    assert (responses["reasoning"], responses["text"]) == (ASKED["reasoning"], ASKED["text"])
    assert (chat["reasoning_effort"], chat["verbosity"]) == ("low", "low")
    assert chat["response_format"] == {"type": "text"}
    assert sent("plain")["tool_choice"] == sent("plain-r")["tool_choice"] == "none"
    # ... and the export says what the model was asked, in NeMo Gym's (Responses) terms.
    params = exported.rows["tooled"]["responses_create_params"]
    assert {key: params[key] for key in ASKED} == ASKED
