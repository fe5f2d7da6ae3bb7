"""Hostile rewards and graders: metrics never crash a run, a grader's failure is that row's grader_error.

A reward that is not a sensible number (not finite, beyond ``REWARD_LIMIT``) is a
``grader_error`` naming the value; a grader that raises is that row's
``grader_error``; every aggregate (mean reward, pass@k, tokens, durations) is
computed without overflow, from fresh grades and from an existing ``rollouts.jsonl``
a resumed run reads back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage.controller import Collection, LocalBackend, ModelEndpointConfig, RunConfig
from rollcage.controller._graders import REWARD_LIMIT, GradeResult, checked_grade, parse_verify_answer
from rollcage.controller._ledger import RunLedger, percentiles
from rollcage.controller.testing import FakeSupervisor
from rollcage.durable import publish_json
from rollcage.protocol import RolloutRecord, RunMetrics
from tests.helpers.viewer_fixtures import record

REWARDS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from(
        [1e308, -1e308, REWARD_LIMIT, -REWARD_LIMIT, math.nextafter(REWARD_LIMIT, math.inf), 0.5]
    ),
)


@pytest.mark.parametrize("value", [1e308, -1e308, 1e10, 2**70])
def test_a_verify_reward_beyond_the_bound_is_a_grader_error_naming_the_value(value: float) -> None:
    grade = checked_grade(parse_verify_answer(200, json.dumps({"reward": value}).encode()))
    assert grade.reward is None and grade.error is not None
    assert "outside the accepted range" in grade.error and repr(float(value)) in grade.error


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_reward_is_a_grader_error(value: float) -> None:
    grade = checked_grade(GradeResult(value, {"name": "verify"}))
    assert grade.reward is None and grade.error is not None and "not a finite number" in grade.error


def test_two_rewards_of_1e308_read_back_from_rollouts_jsonl_do_not_crash_the_metrics(tmp_path: Path) -> None:
    ledger = RunLedger(dataset="d", k=1, max_infra_retries=1)
    for n in range(2):
        ledger.add(record(f"r{n}", f"t{n}", "completed", 1e308, rollout_dir=str(tmp_path)))
    ledger.add(record("r2", "t2", "completed", 1.0, rollout_dir=str(tmp_path), duration=1e308))
    ledger.add(record("r3", "t3", "completed", 0.0, rollout_dir=str(tmp_path), duration=1e308))
    metrics = ledger.snapshot(1.0)
    assert metrics.mean_reward == 0.5 and metrics.graded == 2
    assert metrics.health["grader_error"].count == 2  # the two old rewards, read as the grader's failure
    assert metrics.duration_s.mean is not None and math.isfinite(metrics.duration_s.mean)
    publish_json(tmp_path / "metrics.json", metrics)


def test_percentiles_of_huge_values_do_not_overflow() -> None:
    assert percentiles([1e308, 1e308, 1e308]).mean == 1e308


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rewards=st.lists(REWARDS, min_size=1, max_size=6),
    tokens=st.lists(st.one_of(st.none(), st.integers(0, 2**70)), min_size=6, max_size=6),
    durations=st.lists(st.floats(min_value=0, max_value=1.7e308), min_size=6, max_size=6),
)
def test_any_rewards_become_classified_records_and_metrics_that_publish(
    rewards: list[Any], tokens: list[int | None], durations: list[float], tmp_path: Path
) -> None:
    ledger = RunLedger(dataset="d", k=2, max_infra_retries=1)
    written: list[RolloutRecord] = []
    for n, value in enumerate(rewards):
        grade = checked_grade(GradeResult(value, {"name": "verify"}))
        made = record(
            f"r{n}", f"t{n % 2}", "completed", None, rollout_dir=str(tmp_path), sample=n, tokens=tokens[n]
        )
        made = made.model_copy(
            update={
                "graded": grade.reward is not None,
                "reward": grade.reward,
                "grader": grade.as_record(),
                "receipt": made.receipt.model_copy(update={"duration_s": durations[n]}),
            }
        )
        # Every value ends as a record: graded with a sensible reward, or a grader_error naming it.
        assert (grade.reward is not None and abs(grade.reward) <= REWARD_LIMIT) or grade.error is not None
        line = made.model_dump_json()
        written.append(RolloutRecord.model_validate_json(line))
        ledger.add(written[-1])
    metrics = ledger.snapshot(1.0)
    assert metrics.rollouts == len(rewards)
    assert metrics.mean_reward is None or math.isfinite(metrics.mean_reward)
    RunMetrics.model_validate_json(metrics.model_dump_json())
    # A resumed run reads the same records back into the same metrics.
    again = RunLedger(dataset="d", k=2, max_infra_retries=1)
    for line in written:
        again.add(line)
    assert again.snapshot(1.0).model_copy(update={"wall_s": 1.0}) == metrics


# ----------------------------------------------------------------------------- graders that raise


def _collection(tmp_path: Path, rows: list[dict[str, Any]], fake: FakeSupervisor) -> Collection:
    config = RunConfig(
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        sandbox="none",
        retry_backoff_s=0.0,
        concurrency=3,
        deadline_s=30.0,
        grace_s=1.0,
    )
    return Collection(config, tasks=rows, backend=LocalBackend(config.rollout_settings(), supervise=fake))


async def test_a_grader_that_raises_is_that_rows_grader_error_and_no_neighbour_loses_its_record(
    tmp_path: Path,
) -> None:
    rows = [
        {"id": "fine", "input": "q", "expected": "42"},
        {"id": "overflow", "input": "q", "expected": 10**400, "grader": {"type": "numeric"}},
        {"id": "huge-exact", "input": "q", "expected": 10**5000, "grader": {"type": "exact"}},
    ]
    fake = FakeSupervisor({"fine": "42", "overflow": "42", "huge-exact": "42"})
    async with _collection(tmp_path, rows, fake) as rollouts:
        got = {r.task_id: r async for r in rollouts}
    assert set(got) == {"fine", "overflow", "huge-exact"}
    assert got["fine"].reward == 1.0
    for name in ("overflow", "huge-exact"):
        assert got[name].outcome == "completed" and got[name].reward is None and not got[name].graded
        assert got[name].grader is not None and got[name].grader["error"], got[name].grader
        assert got[name].health.findings.get("grader_error") == 1
    on_disk = (tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines()
    assert len(on_disk) == 3
