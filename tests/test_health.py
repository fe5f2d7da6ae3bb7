"""Health checks of one finished attempt: missing evidence is never healthy, the run's own stops apart."""

from __future__ import annotations

from typing import Any

from rollcage.controller._health import HEALTH_CHECKS, inspect_rollout
from rollcage.protocol import Outcome, RolloutRecord, RunnerError, WorkerResult
from tests.helpers.viewer_fixtures import completed_result, model_call, receipt, record


def _record(outcome: Outcome, **receipt_fields: Any) -> RolloutRecord:
    base = record("r", "t", outcome, None, rollout_dir="rollouts/r")
    return base.model_copy(update={"receipt": receipt("r", outcome, **receipt_fields)})


def _result(*calls: Any, error: RunnerError | None = None) -> dict[str, Any]:
    result = completed_result("r", "t")
    trajectory = result.trajectory.model_copy(update={"model_calls": list(calls), "tool_calls": []})
    updated: WorkerResult = result.model_copy(update={"trajectory": trajectory, "error": error})
    return updated.model_dump(mode="json")


def test_every_check_has_a_stable_name_including_the_unobserved_and_the_runs_own_stops() -> None:
    assert {"unobserved_result", "cancelled_by_run", "no_model_turn", "capture_mismatch"} <= set(
        HEALTH_CHECKS
    )


def test_a_missing_result_is_unobserved_never_healthy() -> None:
    found = inspect_rollout(_record("infra_failure"), None)
    assert found == {"unobserved_result": 1}


def test_a_result_the_receipt_calls_invalid_is_unobserved() -> None:
    found = inspect_rollout(_record("infra_failure", result_valid=False, result_present=True), _result())
    assert found == {"unobserved_result": 1}


def test_a_rollout_whose_calls_all_failed_has_no_model_turn() -> None:
    failed = RunnerError(kind="transient", type="TransientModelError", message="503")
    calls = [model_call(0, status="failed", error=failed), model_call(1, status="failed", error=failed)]
    found = inspect_rollout(_record("completed", model_calls_captured=2), _result(*calls))
    assert found["no_model_turn"] == 1 and found["failed_model_call"] == 2


def test_a_rollout_the_run_cancelled_is_reported_apart_not_as_model_findings() -> None:
    # Stopped before its first answer, with the first exchange in flight (captured, never recorded).
    found = inspect_rollout(_record("cancelled", model_calls_captured=1), _result())
    assert found == {"cancelled_by_run": 1}


def test_a_stopped_rollout_may_have_one_exchange_in_flight_but_not_two() -> None:
    call = model_call(0, text="hi")
    assert "capture_mismatch" not in inspect_rollout(
        _record("timeout", model_calls_captured=2), _result(call)
    )
    assert "capture_mismatch" in inspect_rollout(_record("timeout", model_calls_captured=3), _result(call))
    assert "capture_mismatch" in inspect_rollout(_record("completed", model_calls_captured=2), _result(call))


def test_a_length_limited_call_is_runaway_generation_not_zero_completion() -> None:
    call = model_call(0, text="", status="incomplete", incomplete_reason="length", tokens=(50, 0))
    found = inspect_rollout(_record("completed", model_calls_captured=1), _result(call))
    assert found.get("runaway_generation") == 1 and "zero_completion_tokens" not in found
    zero = model_call(0, text="x", tokens=(50, 0))
    assert (
        inspect_rollout(_record("completed", model_calls_captured=1), _result(zero))["zero_completion_tokens"]
        == 1
    )
