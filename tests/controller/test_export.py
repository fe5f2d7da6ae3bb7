"""rollcage export: ATIF and NeMo Gym rollout JSONL from any run directory, validated; the run is only read.

The real run is exported in ``tests/controller/test_acceptance.py``; here the viewer's run
fixture (every outcome, a torn last line, hostile text) and odd trajectories.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.export import to_atif, to_nemo_gym_row
from rollcage.protocol import WorkerInput
from tests.environments.test_nemo_gym_conformance import GymVerifyResponse
from tests.helpers.formats import AtifTrajectory, NgTrajectoryRecord
from tests.helpers.viewer_fixtures import (
    XSS_SCRIPT,
    cancelled_result,
    completed_result,
    model_call,
    record,
    tool_call,
    trajectory_of,
    write_run,
)

SPEC = WorkerInput.model_validate(
    {
        "rollout_id": "calc-1-s0-t0",
        "task_id": "calc-1",
        "input": "What is 2+2?",
        "instructions": "Use tools.",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "scripted"},
        "tools": [{"type": "python"}],
    }
)


def _rollcage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rollcage", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_every_final_rollout_with_a_result_becomes_a_valid_atif_trajectory(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    log = (run.path / "rollouts.jsonl").read_bytes()
    done = _rollcage("export", str(run.path), "--format", "atif")
    assert done.returncode == 0, done.stderr
    # calc-3 has no result.json (infra_failure); the others' inputs are the fixture's.
    assert "wrote 5 rollout(s)" in done.stdout and "skipped 1 no valid result.json" in done.stdout
    exported = sorted((run.path / "export" / "atif").glob("*.json"))
    assert len(exported) == 5
    for path in exported:
        AtifTrajectory.model_validate(json.loads(path.read_text()))
    hostile = json.loads((run.path / "export" / "atif" / "calc-1-s1-t0.json").read_text())
    assert any(
        XSS_SCRIPT in (r["content"] or "")
        for s in hostile["steps"]
        for r in (s.get("observation") or {}).get("results", [])
    )
    # Export reads the run; it never repairs or rewrites it (a torn tail stays for the run to repair).
    assert (run.path / "rollouts.jsonl").read_bytes() == log


def test_nemo_gym_rows_hold_only_rewarded_rollouts_and_validate(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run")
    target = tmp_path / "out" / "rollouts.jsonl"
    done = _rollcage("export", str(run.path), "--format", "nemo-gym", "--out", str(target))
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert sorted(row["_ng_rollout_id"] for row in rows) == ["calc-1-s0-t0", "calc-1-s1-t0", "calc-5-s0-t0"]
    for row in rows:
        GymVerifyResponse.model_validate(row)
        NgTrajectoryRecord.model_validate(row["ng_trajectory"])


@pytest.mark.parametrize(
    "args", [("export", "/nonexistent", "--format", "atif"), ("export", ".", "--format", "x")]
)
def test_a_wrong_export_is_one_line_and_exit_2(args: tuple[str, ...]) -> None:
    done = _rollcage(*args)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "Traceback" not in done.stderr


def test_code_cells_odd_arguments_and_failed_calls_still_make_valid_documents() -> None:
    failed = model_call(2, status="failed", tokens=(None, None), start=3.0)
    calls = [
        model_call(0, text="```python\nprint(1)\n```", calls=[("call_x", "lookup", "not json")]),
        model_call(1, text="more", start=1.5),
        failed,
    ]
    tools = [
        tool_call(
            "call_x", "lookup", "not json", 0, output="error: arguments are not valid JSON", status="failed"
        ),
        tool_call("cell-1-0", "python", "print(2)", 1, output="2"),
    ]
    result = completed_result().model_copy(update={"trajectory": trajectory_of(calls, tools)})
    rec = record("calc-1-s0-t0", "calc-1", "completed", 1.0, rollout_dir="x")
    document = AtifTrajectory.model_validate(to_atif(rec, result, SPEC))
    agent = [step for step in document.steps if step.source == "agent"]
    assert [len(step.tool_calls or []) for step in agent] == [1, 1, 0]
    odd = (agent[0].tool_calls or [])[0]
    assert odd.arguments == {} and odd.extra is not None and odd.extra["raw_arguments"] == "not json"
    assert (agent[1].tool_calls or [])[0].arguments == {"code": "print(2)"}
    assert agent[2].metrics is not None and agent[2].metrics.completion_token_ids is None
    row = to_nemo_gym_row(rec, result, SPEC, task_index=0)
    trajectory = NgTrajectoryRecord.model_validate(row["ng_trajectory"])
    assert [c.response_metadata.response_status for c in trajectory.model_calls] == [
        "completed",
        "completed",
        "failed",
    ]
    assert trajectory.invocations[0].status == "completed"


def test_a_cancelled_rollout_exports_with_its_incomplete_invocation() -> None:
    result = cancelled_result()
    rec = record("calc-2-s0-t0", "calc-2", "cancelled", None, rollout_dir="x")
    row = to_nemo_gym_row(rec, result, SPEC, task_index=3)
    trajectory = NgTrajectoryRecord.model_validate(row["ng_trajectory"])
    assert trajectory.invocations[0].status == "incomplete"
    assert [t.status for t in trajectory.tool_calls] == ["incomplete"]
    AtifTrajectory.model_validate(to_atif(rec, result, SPEC))
