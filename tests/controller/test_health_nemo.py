"""Health checks under NeMo Gym's names agree with NeMo Gym's own code, rollout by rollout.

The same rollouts are checked twice: by rollcage (``rollout_health`` on the trajectory,
folded by the run ledger as a run folds them) and by NeMo Gym 0.7.0's
``run_health_checks`` in its side environment, on the rows ``export --format
nemo-gym`` writes of them. Every check the two share must find the same count and be
unobserved on the same rollouts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollcage.controller import HEALTH_CHECKS
from rollcage.controller._health import rollout_health
from rollcage.controller._ledger import RunLedger
from rollcage.export import to_nemo_gym_row
from rollcage.protocol import (
    ModelCall,
    ResponseOutput,
    RolloutHealth,
    RolloutRecord,
    RunnerError,
    TokenUsage,
    WorkerInput,
    WorkerResult,
)
from tests.helpers.upstream import run_upstream
from tests.helpers.viewer_fixtures import completed_result, model_call, receipt, record, trajectory_of

SPEC = WorkerInput.model_validate(
    {
        "rollout_id": "t-s0-t0",
        "task_id": "t",
        "input": "What is 2+2?",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "scripted"},
        "tools": [{"type": "python"}],
    }
)
FAILED = RunnerError(kind="transient", type="TransientModelError", message="HTTP 503")

NEMO_SCRIPT = r"""
import json, sys, tempfile
from collections import Counter
from pathlib import Path
from nemo_gym.rollout_health import run_health_checks

with tempfile.TemporaryDirectory() as out:
    result = run_health_checks(Path(sys.argv[1]), output_dir=Path(out), workers=1)
rollouts = [
    {
        "task": d.task_index,
        "sample": d.rollout_index,
        "rollout_id": d.rollout_id,
        "findings": dict(Counter(f.check for f in d.findings)),
        "unobserved": sorted(d.unobserved),
    }
    for d in result.rollouts
]
print(json.dumps({"rollouts": rollouts, "issues": result.summary["run"]["issues"],
                  "coverage": result.summary["run"]["artifacts"]["coverage"]}))
"""

SHARED = sorted(name for name, info in HEALTH_CHECKS.items() if info.nemo is not None)
ROLLOUT_SHARED = [name for name in SHARED if HEALTH_CHECKS[name].scope == "rollout"]
TASK_SHARED = [name for name in SHARED if HEALTH_CHECKS[name].scope == "task"]


def _call(rng: random.Random, index: int) -> ModelCall:
    """One model call of a kind drawn at random: the shapes NeMo Gym's rules tell apart."""
    kind = rng.choice(
        [
            "text",
            "tool",
            "reasoning",
            "empty",
            "failed",
            "cut",
            "cut-empty",
            "cut-tool",
            "zero",
            "silent",
            "chat",
        ]
    )
    start = float(index)
    if kind == "text":
        return model_call(index, text="four", start=start)
    if kind == "tool":
        return model_call(index, calls=[(f"c{index}", "python", "{}")], start=start)
    if kind == "reasoning":
        return model_call(index, reasoning="thinking", start=start)
    if kind == "empty":
        return model_call(index, text="  ", start=start)
    if kind == "failed":
        return model_call(index, status="failed", error=FAILED, tokens=(None, None), start=start)
    if kind == "cut":
        return model_call(index, text="half", status="incomplete", incomplete_reason="length", start=start)
    if kind == "cut-empty":
        cut = model_call(index, text="", status="incomplete", incomplete_reason="length", start=start)
        return cut.model_copy(update={"usage": TokenUsage(input_tokens=50, output_tokens=0, total_tokens=50)})
    if kind == "cut-tool":
        return model_call(
            index,
            calls=[(f"c{index}", "python", '{"co')],
            status="incomplete",
            incomplete_reason="max_output_tokens",
            start=start,
        )
    if kind == "zero":
        return model_call(index, text="x", tokens=(40, 0), start=start)
    if kind == "silent":
        return model_call(index, text="x", tokens=(None, None), start=start)
    # A chat call: its raw response is a chat completion, read by NeMo Gym's choices rule.
    chat = model_call(index, text=rng.choice(["", "four"]), status="incomplete", incomplete_reason="length")
    content = chat.output[0]["content"][0]["text"]
    response = {"id": f"chat_{index}", "choices": [{"message": {"role": "assistant", "content": content}}]}
    return chat.model_copy(
        update={"api": "chat", "response": response, "started_at": chat.started_at + start}
    )


def _interrupted(index: int) -> ModelCall:
    cut = model_call(
        index, status="incomplete", incomplete_reason="interrupted", tokens=(None, None), start=index
    )
    return cut.model_copy(update={"output": [], "response": None, "http_status": None})


def _rollouts(seed: int, count: int) -> Iterator[tuple[WorkerResult, str]]:
    """Results (and outcomes) of ``count`` rollouts: drawn call mixes, some cut off, some mis-totalled."""
    rng = random.Random(seed)
    for n in range(count):
        calls = [_call(rng, i) for i in range(rng.randint(1, 4))]
        outcome = "completed"
        if n >= count - 4:
            # The last two tasks never get an answer: every call fails, and in one repeat of the
            # second a call is then cut off in flight (NeMo Gym counts that call not failed).
            calls = [model_call(0, status="failed", error=FAILED, tokens=(None, None))]
        if (n < count - 4 and rng.random() < 0.15) or n == count - 2:
            calls.append(_interrupted(len(calls)))
            outcome = rng.choice(["cancelled", "timeout"])
        answered = [c for c in calls if c.status != "failed" and c.incomplete_reason != "interrupted"]
        usage = TokenUsage(
            input_tokens=sum(c.usage.input_tokens or 0 for c in answered),
            output_tokens=sum(c.usage.output_tokens or 0 for c in answered) + (rng.random() < 0.15),
        )
        base = completed_result(f"t{n // 2}-s{n % 2}-t0", f"t{n // 2}")
        response = ResponseOutput(id=f"r{n}", model="scripted", status="completed", output=[], usage=usage)
        yield base.model_copy(update={"trajectory": trajectory_of(calls, []), "response": response}), outcome


def shared_disagreements(health: RolloutHealth, theirs: dict[str, Any]) -> dict[str, Any] | None:
    """How rollcage's checks under NeMo Gym's names differ from NeMo Gym's on one rollout (None: agree)."""
    ours_found = {n: c for n, c in health.findings.items() if n in ROLLOUT_SHARED}
    theirs_found = {n: c for n, c in theirs["findings"].items() if n != "rollout_duplicate_identity"}
    ours_unobserved = sorted(n for n in health.unobserved if n in ROLLOUT_SHARED)
    if (ours_found, ours_unobserved) == (theirs_found, theirs["unobserved"]):
        return None
    return {"ours": [ours_found, ours_unobserved], "theirs": [theirs_found, theirs["unobserved"]]}


def _checked_by_both(tmp_path: Path, seed: int) -> tuple[list[RolloutRecord], dict[str, Any], RunLedger]:
    records: list[RolloutRecord] = []
    ledger = RunLedger(dataset="d", k=2, max_infra_retries=0)
    rows = tmp_path / "rollouts.jsonl"
    with rows.open("wb") as out:
        for index, (result, outcome) in enumerate(_rollouts(seed, 40)):
            got = receipt(result.rollout_id, outcome, model_calls_captured=len(result.trajectory.model_calls))
            rec = record(result.rollout_id, result.task_id, outcome, 1.0, rollout_dir="x", sample=index % 2)
            rec = rec.model_copy(update={"receipt": got, "health": rollout_health(result, got)})
            records.append(rec)
            ledger.add(rec)
            row = orjson.dumps(to_nemo_gym_row(rec, result, SPEC, task_index=index // 2)) + b"\n"
            out.write(row)
            if index == 7:  # the same attempt logged twice: both copies claim one identity
                ledger.add(rec)
                out.write(row)
    return records, run_upstream("nemo-gym", NEMO_SCRIPT, str(rows)), ledger


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2])
def test_every_shared_check_counts_what_nemo_gyms_own_code_counts(tmp_path: Path, seed: int) -> None:
    records, nemo, ledger = _checked_by_both(tmp_path, seed)
    by_rollout = {}
    for got in nemo["rollouts"]:
        by_rollout.setdefault((got["task"], got["sample"]), got)  # the duplicate's copies agree
    disagreements = {
        rec.rollout_id: differ
        for index, rec in enumerate(records)
        if (differ := shared_disagreements(rec.health, by_rollout[(index // 2, index % 2)])) is not None
    }
    assert not disagreements, json.dumps(disagreements, indent=1)
    # Folded over the run as a run folds them, the counts per shared name are NeMo Gym's.
    health = ledger.snapshot(1.0).health
    for name in ROLLOUT_SHARED:
        coverage = nemo["coverage"][name]
        assert (name, health[name].count, health[name].unobserved) == (
            name,
            nemo["issues"][name],
            coverage["unobserved"],
        )
    assert nemo["issues"]["rollout_duplicate_identity"] == health["rollout_duplicate_identity"].count == 2
    for name in TASK_SHARED:
        coverage = nemo["coverage"][name]
        assert (name, health[name].count, health[name].evaluated, health[name].unobserved) == (
            name,
            nemo["issues"][name],
            coverage["evaluated"],
            coverage["unobserved"],
        )
    # The rows exercise every shared rollout check, so agreement is not agreement on zeros.
    found = {name for name in ROLLOUT_SHARED if nemo["issues"][name]}
    assert health["task_no_successful_model_calls"].count == 1  # the cut-off call is not failed
    assert health["task_no_answered_model_calls"].count == 2  # rollcage's own rule: neither was answered
    assert found >= set(ROLLOUT_SHARED) - {
        "check_execution_error",
        "record_unreadable",
        "rollout_missing_agent_turns",
        "trajectory_capture_mismatch",
    }
