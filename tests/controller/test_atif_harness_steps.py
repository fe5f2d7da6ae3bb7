"""A harness's own tool calls (NOOA's prefill) are ATIF's deterministic dispatch, never the model's step."""

from __future__ import annotations

import json
from typing import Any

from rollcage.export import to_atif
from rollcage.protocol import WorkerInput
from tests.helpers.formats import AtifTrajectory
from tests.helpers.upstream import run_upstream
from tests.helpers.viewer_fixtures import completed_result, model_call, record, tool_call, trajectory_of

SPEC = WorkerInput.model_validate(
    {
        "rollout_id": "calc-1-s0-t0",
        "task_id": "calc-1",
        "input": "What is 2+2?",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "scripted"},
        "agent": {"harness": {"type": "nooa"}},
    }
)
HARBOR_CHECK = r"""
import json, sys
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
document = json.loads(sys.stdin.read())
Trajectory.model_validate(document)
print(json.dumps({"valid": TrajectoryValidator().validate(document)}))
"""


def _nooa_atif() -> dict[str, Any]:
    # NOOA's shape: its prefill cell runs before the first model call (origin harness, turn 0),
    # then the model asks for a cell and answers.
    calls = [
        model_call(0, calls=[("call_0_0", "execute_python", '{"code": "print(2+2)"}')], start=1.0),
        model_call(1, text="4", start=3.0),
    ]
    prefill = tool_call(
        "harness_0", "execute_python", '{"code": "print(inputs)"}', 0, output="2+2", start=0.2
    )
    prefill = prefill.model_copy(update={"origin": "harness", "reported_by": "harness"})
    asked = tool_call("call_0_0", "execute_python", '{"code": "print(2+2)"}', 0, output="4", start=2.0)
    result = completed_result().model_copy(update={"trajectory": trajectory_of(calls, [prefill, asked])})
    assert result.trajectory.turns[0].tool_calls == ["harness_0", "call_0_0"]  # the turn owns both
    rec = record("calc-1-s0-t0", "calc-1", "completed", 1.0, rollout_dir="x")
    return to_atif(rec, result, SPEC)


def test_nooas_prefill_is_a_dispatch_step_before_the_models_step() -> None:
    document = _nooa_atif()
    AtifTrajectory.model_validate(document)
    agent = [step for step in document["steps"] if step["source"] == "agent"]
    dispatch, first, last = agent
    assert dispatch["llm_call_count"] == 0 and "metrics" not in dispatch
    assert [call["tool_call_id"] for call in dispatch["tool_calls"]] == ["harness_0"]
    assert dispatch["observation"]["results"][0]["content"] == "2+2"
    assert dispatch["timestamp"] < first["timestamp"]  # it ran before the model call
    # The model's step holds only what the model asked for.
    assert [call["tool_call_id"] for call in first["tool_calls"]] == ["call_0_0"]
    assert first["llm_call_count"] == 1 and last["message"] == "4"


def test_harbors_own_models_and_validator_accept_the_dispatch_step() -> None:
    assert run_upstream("harbor", HARBOR_CHECK, stdin=json.dumps(_nooa_atif())) == {"valid": True}
