"""Health checks of one finished attempt, under NeMo Gym's names: missing evidence is never healthy."""

from __future__ import annotations

from typing import Any

import pytest

from rollcage.controller import HEALTH_ALIASES, HEALTH_CHECKS
from rollcage.controller._health import rollout_health, rollout_metrics
from rollcage.controller._ledger import RunLedger
from rollcage.protocol import (
    CallAttempt,
    CallTokens,
    ModelCall,
    Outcome,
    ResponseOutput,
    RolloutRecord,
    RunnerError,
    SupervisorReceipt,
    TokenUsage,
    WorkerResult,
)
from tests.helpers.viewer_fixtures import T0, completed_result, model_call, receipt, record, trajectory_of

NEMO_CHECKS = {
    "rollout_missing_agent_turns",
    "agent_turn_hollow",
    "trajectory_capture_mismatch",
    "model_call_failed",
    "model_call_missing_token_counts",
    "model_call_zero_completion_tokens",
    "model_call_runaway_generation",
    "rollout_token_count_mismatch",
    "task_consistently_unhealthy",
    "task_no_successful_model_calls",
}
FAILED = RunnerError(kind="transient", type="TransientModelError", message="HTTP 503")


def _receipt(outcome: Outcome = "completed", **fields: Any) -> SupervisorReceipt:
    return receipt("r", outcome, **{"model_calls_captured": 1, **fields})


def _result(*calls: ModelCall, usage: TokenUsage | None = None) -> WorkerResult:
    base = completed_result("r", "t")
    response = ResponseOutput(id="r", model="m", status="completed", output=[], usage=usage or _summed(calls))
    return base.model_copy(update={"trajectory": trajectory_of(calls, []), "response": response})


def _summed(calls: tuple[ModelCall, ...]) -> TokenUsage:
    answered = [c for c in calls if c.status != "failed"]
    return TokenUsage(
        input_tokens=sum(c.usage.input_tokens or 0 for c in answered),
        output_tokens=sum(c.usage.output_tokens or 0 for c in answered),
    )


def test_every_nemo_gym_check_is_computed_under_its_name_and_old_names_map_to_them() -> None:
    assert NEMO_CHECKS <= set(HEALTH_CHECKS)
    assert {info.nemo for name, info in HEALTH_CHECKS.items() if name in NEMO_CHECKS} == {
        f"H{n}" for n in range(4, 14)
    }
    assert set(HEALTH_ALIASES.values()) <= NEMO_CHECKS
    assert HEALTH_ALIASES["no_model_turn"] == "rollout_missing_agent_turns"


@pytest.mark.parametrize("valid", [False, True])
def test_a_missing_or_invalid_result_leaves_every_check_unobserved_never_healthy(valid: bool) -> None:
    bad_receipt = _receipt("infra_failure", result_valid=False, result_present=False)
    health = rollout_health(_result(model_call(0, text="x")) if valid else None, bad_receipt)
    assert health.verdict == "unobserved" and not health.findings
    rollout_checks = {
        name
        for name, info in HEALTH_CHECKS.items()
        if info.scope == "rollout"
        and name not in {"cancelled_by_run", "grader_error", "rollout_duplicate_identity"}
    }
    assert set(health.unobserved) == rollout_checks
    assert set(health.unobserved.values()) - {"no result.json"} == {"no valid result.json"}
    assert health.successful_model_calls is None


def test_a_result_json_present_but_invalid_is_an_unreadable_record() -> None:
    bad_receipt = _receipt("infra_failure", result_valid=False, result_present=True)
    health = rollout_health(None, bad_receipt)
    assert health.findings == {"record_unreadable": 1} and health.verdict == "unhealthy"


def test_a_check_that_raises_is_unobserved_and_counted_as_a_check_execution_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollcage.controller import _health

    def broken(evidence: object) -> int:
        raise KeyError("boom")

    monkeypatch.setitem(_health._ROLLOUT_CHECKS, "agent_turn_hollow", broken)
    health = rollout_health(_result(model_call(0, text="x")), _receipt())
    assert health.findings == {"check_execution_error": 1}
    assert health.unobserved == {"agent_turn_hollow": "the check raised KeyError"}


def test_a_clean_rollout_is_healthy_with_every_check_evaluated() -> None:
    calls = (model_call(0, text="x", calls=[("c", "python", "{}")]), model_call(1, text="done", start=1.0))
    health = rollout_health(_result(*calls), _receipt(model_calls_captured=2))
    assert (health.verdict, health.findings, health.unobserved, health.successful_model_calls) == (
        "healthy",
        {},
        {},
        2,
    )


def test_a_rollout_whose_calls_all_failed_has_no_agent_turn_and_failed_calls() -> None:
    failed = {"status": "failed", "error": FAILED, "tokens": (None, None)}
    calls = (model_call(0, **failed), model_call(1, start=1.0, **failed))
    health = rollout_health(_result(*calls), _receipt(model_calls_captured=2))
    # NeMo Gym's rules: a turn that references a call is agent activity, a failed call's turn is hollow
    # and has no token counts; rollcage's own rule sees no answered turn.
    assert health.findings == {
        "rollout_missing_answered_turns": 1,
        "rollout_ended_on_failed_model_call": 1,
        "agent_turn_hollow": 2,
        "model_call_failed": 2,
        "model_call_missing_token_counts": 2,
    }
    assert health.verdict == "unhealthy" and health.successful_model_calls == 0
    # Checks of answered calls cannot run: unobserved, with the reason, not passed.
    assert health.unobserved["model_call_zero_completion_not_length_cut"] == "no answered model call"
    assert "no token counts" in health.unobserved["rollout_token_count_mismatch"]


def test_a_rollout_that_recovered_from_a_failed_call_did_not_end_on_one() -> None:
    failed, good = model_call(0, status="failed", error=FAILED), model_call(1, text="x", start=1.0)
    recovered = rollout_health(_result(failed, good), _receipt(model_calls_captured=2))
    assert "rollout_ended_on_failed_model_call" not in recovered.findings
    assert recovered.findings["model_call_failed"] == 1
    late = model_call(0, status="failed", error=FAILED).model_copy(update={"started_at": T0 + 5})
    ended = rollout_health(_result(late, good), _receipt(model_calls_captured=2))
    assert ended.findings["rollout_ended_on_failed_model_call"] == 1


def test_token_data_the_client_dropped_makes_the_rollout_unhealthy_and_is_counted_per_call() -> None:
    dropped = model_call(0, text="x", calls=[("c", "python", "{}")])
    note = "choices[0].token_ids[0] is 'seven', not an integer token id; choices[0].token_ids was dropped"
    dropped = dropped.model_copy(update={"tokens": CallTokens(generation_log_probs=[-0.5], note=note)})
    health = rollout_health(
        _result(dropped, model_call(1, text="done", start=1.0)), _receipt(model_calls_captured=2)
    )
    assert health.findings == {"model_call_token_data_dropped": 1}
    assert health.verdict == "unhealthy"


def test_a_rollout_the_run_cancelled_is_reported_apart_and_its_turns_unobserved() -> None:
    interrupted = model_call(0, status="incomplete", incomplete_reason="interrupted", tokens=(None, None))
    interrupted = interrupted.model_copy(update={"output": [], "response": None})
    health = rollout_health(_result(interrupted), _receipt("cancelled"))
    assert health.findings["cancelled_by_run"] == 1
    assert "rollout_missing_answered_turns" in health.unobserved
    # The call cut off has no token counts: the rollout's accounting is unobserved, not "evaluated, 0".
    assert health.findings["model_call_missing_token_counts"] == 1
    assert "cut off by a cancel or timeout" in health.unobserved["rollout_token_count_mismatch"]


def test_a_call_cut_off_beside_answered_ones_leaves_token_accounting_unobserved() -> None:
    answered = model_call(0, text="x", calls=[("c", "python", "{}")])
    interrupted = model_call(
        1, status="incomplete", incomplete_reason="interrupted", tokens=(None, None), start=1
    )
    interrupted = interrupted.model_copy(update={"output": [], "response": None})
    # The result's totals are the answered call's: summing only answered calls would call this
    # accounting checked and right.
    health = rollout_health(_result(answered, interrupted, usage=answered.usage), _receipt("timeout"))
    assert "rollout_token_count_mismatch" not in health.findings
    assert "cut off by a cancel or timeout" in health.unobserved["rollout_token_count_mismatch"]
    metrics = rollout_metrics(_result(answered, interrupted), _receipt("timeout"))
    assert metrics.token_counts == "partial"


@pytest.mark.parametrize(("captured", "mismatch"), [(0, True), (1, False), (2, False), (3, True)])
def test_capture_must_account_for_every_attempt_that_got_an_answer(captured: int, mismatch: bool) -> None:
    # Two attempts: a 503 answered, then one cut off in flight (it may or may not have reached the proxy).
    call = model_call(0, text="x").model_copy(
        update={
            "attempts": [
                CallAttempt(
                    index=0, status="failed", http_status=503, error=FAILED, started_at=1, ended_at=2
                ),
                CallAttempt(index=1, status="incomplete", started_at=3, ended_at=4),
            ]
        }
    )
    health = rollout_health(_result(call), _receipt(model_calls_captured=captured))
    assert ("trajectory_capture_accounting" in health.findings) is mismatch
    assert "trajectory_capture_mismatch" not in health.findings  # NeMo Gym's rule reads references only


def test_without_an_egress_capture_the_capture_check_is_unobserved() -> None:
    health = rollout_health(_result(model_call(0, text="x")), _receipt(model_calls_captured=None))
    assert "egress capture" in health.unobserved["trajectory_capture_accounting"]


@pytest.mark.parametrize(
    "breaks",
    [
        lambda t: t.model_copy(update={"turns": [t.turns[0].model_copy(update={"model_calls": ["r:m9"]})]}),
        lambda t: t.model_copy(update={"turns": [t.turns[0].model_copy(update={"model_calls": []})]}),
        lambda t: t.model_copy(update={"turns": [t.turns[0], t.turns[0].model_copy(update={"index": 1})]}),
        lambda t: t.model_copy(update={"model_calls": [t.model_calls[0].model_copy(update={"turn": 3})]}),
    ],
    ids=["unknown-call", "unowned-call", "owned-twice", "owner-disagrees"],
)
def test_model_call_ownership_that_does_not_add_up_is_a_capture_mismatch(breaks: Any) -> None:
    result = _result(model_call(0, text="x"))
    broken = result.model_copy(update={"trajectory": breaks(result.trajectory)})
    assert rollout_health(broken, _receipt()).findings.get("trajectory_capture_accounting") == 1


def test_a_length_limited_call_is_exempt_from_zero_tokens_and_runaway_only_without_content() -> None:
    cut_empty = model_call(0, text="", status="incomplete", incomplete_reason="length", tokens=(50, 0))
    cut_text = model_call(1, text="half an ans", status="incomplete", incomplete_reason="length", start=1)
    zero = model_call(2, text="x", tokens=(50, 0), start=2)
    health = rollout_health(_result(cut_empty, cut_text, zero), _receipt(model_calls_captured=3))
    assert health.findings["model_call_runaway_generation"] == 1  # the empty one only (NeMo Gym's rule)
    assert health.findings["model_call_zero_completion_tokens"] == 2  # NeMo Gym's code: every 0
    assert health.findings["model_call_zero_completion_not_length_cut"] == 1  # its acceptance text
    assert health.findings["agent_turn_hollow"] == 1
    # A call cut at the limit with only a (cut) tool call holds no text: a runaway, as NeMo Gym counts.
    cut_call = model_call(0, calls=[("c", "python", '{"co')], status="incomplete", incomplete_reason="length")
    assert rollout_health(_result(cut_call), _receipt()).findings["model_call_runaway_generation"] == 1


def test_token_counts_missing_or_mismatched_are_findings_and_totals_missing_are_unobserved() -> None:
    silent = model_call(0, text="x", tokens=(None, None))
    health = rollout_health(_result(silent), _receipt())
    assert health.findings["model_call_missing_token_counts"] == 1
    assert "no token counts" in health.unobserved["rollout_token_count_mismatch"]
    call = model_call(0, text="x")
    wrong = rollout_health(_result(call, usage=TokenUsage(input_tokens=1, output_tokens=1)), _receipt())
    assert wrong.findings["rollout_token_count_mismatch"] == 1
    off = call.model_copy(update={"usage": TokenUsage(input_tokens=3, output_tokens=4, total_tokens=99)})
    assert rollout_health(_result(off), _receipt()).findings["model_call_total_tokens_mismatch"] == 1


def test_metrics_say_when_token_sums_are_partial_and_whether_token_ids_are_complete() -> None:
    reported = model_call(0, text="x").model_copy(
        update={
            "tokens": CallTokens(prompt_token_ids=[1], generation_token_ids=[2], generation_log_probs=[-1.0])
        }
    )
    silent = model_call(1, text="y", tokens=(None, None), start=1)
    metrics = rollout_metrics(_result(reported, silent), _receipt())
    assert (metrics.input_tokens, metrics.token_counts, metrics.token_ids) == (120, "partial", "partial")
    whole = rollout_metrics(_result(reported), _receipt())
    assert (whole.token_counts, whole.token_ids) == ("complete", "complete")
    none = rollout_metrics(None, _receipt("infra_failure", result_valid=False))
    assert (none.input_tokens, none.token_counts, none.token_ids) == (None, "unobserved", "unobserved")


def _record_of(
    task: str, sample: int, health_of: WorkerResult | None, outcome: Outcome = "completed"
) -> RolloutRecord:
    rid = f"{task}-s{sample}-t0"
    got = receipt(
        rid, outcome, model_calls_captured=len(health_of.trajectory.model_calls) if health_of else None
    )
    if health_of is None:
        got = got.model_copy(update={"result_valid": False, "result_present": False})
    base = record(rid, task, outcome, None, rollout_dir=f"rollouts/{rid}", sample=sample)
    return base.model_copy(update={"receipt": got, "health": rollout_health(health_of, got)})


def test_task_checks_need_every_repeat_observed_and_two_computable_verdicts() -> None:
    failed = _result(model_call(0, status="failed", error=FAILED))
    good = _result(model_call(0, text="x"))
    ledger = RunLedger(dataset="d", k=2, max_infra_retries=0)
    for rec in (
        _record_of("doomed", 0, failed),
        _record_of("doomed", 1, failed),
        _record_of("mixed", 0, failed),
        _record_of("mixed", 1, good),
        _record_of("blind", 0, failed),
        _record_of("blind", 1, None, "infra_failure"),
    ):
        ledger.add(rec)
    health = ledger.snapshot(1.0).health
    none = health["task_no_successful_model_calls"]
    assert (none.count, none.rollouts, none.evaluated, none.unobserved) == (1, ["doomed"], 2, 1)
    consistently = health["task_consistently_unhealthy"]
    assert (consistently.count, consistently.rollouts, consistently.evaluated) == (1, ["doomed"], 2)
    assert consistently.missing == {"fewer than two repeats with a computable verdict": 1}
    failed_calls = health["model_call_failed"]
    assert (failed_calls.count, failed_calls.evaluated, failed_calls.unobserved) == (4, 5, 1)
    assert ledger.snapshot(1.0).health_verdicts == {"healthy": 1, "unhealthy": 4, "unobserved": 1}
