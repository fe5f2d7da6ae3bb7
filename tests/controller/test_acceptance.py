"""The acceptance matrix: NeMo Gym's trajectory criteria C1-C11 and health checks H4-H13, on real rollouts.

One run, collected with ``rollcage.collect`` through the real supervisor, sandbox,
egress proxy and worker, against the scripted policy and the calc-weather
environment, with everything the matrix needs (NeMo Gym's ``ACCEPTANCE.md`` in
``responses_api_agents/nooa_agent``): several turns; reasoning; three parallel tool
calls, one of them failing (HTTP 404 from the environment); a model call retried
after an HTTP 503; a call cut at the length limit; every token count, token ids and
logprobs; both API styles. A task whose every call fails gives the task-level
checks something to find. Every artifact is read back from disk (JSON) before
anything is checked, and the run's two exports are validated against our copies of
the formats' schemas (``tests/helpers/formats.py``).
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
from rollcage.controller import rollout_health
from rollcage.export import export_run
from rollcage.policy import PolicyServer
from rollcage.protocol import ModelCall, ResponseItem, RolloutRecord, RunMetrics, WorkerInput, WorkerResult
from rollcage.wire import build_request, chat_messages, function_tools
from tests.controller.test_health_nemo import NEMO_SCRIPT, shared_disagreements
from tests.environments.test_nemo_gym_conformance import GymVerifyResponse
from tests.helpers.formats import AtifTrajectory, NgTrajectoryRecord, check_training_items
from tests.helpers.upstream import harbor_atif_errors, run_upstream

SANDBOX = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(600),
]

ACT = {
    "reasoning": "Look up Oslo and Atlantis, and add with Python.",
    "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo"}},
        {"name": "get_weather", "arguments": {"city": "Atlantis"}},
        {"name": "python", "arguments": {"code": "print(sum([40, 2]))"}},
    ],
}
SCRIPT = {
    "model": "scripted-policy",
    "tasks": {
        "matrix": [
            ACT,
            {"text": "cold;sum=42 — and here is a long explanation of why"},
            {"text": "cold;sum=42"},
        ],
        "matrix-r": [
            ACT,
            {"text": "cold;sum=42 — and here is a long explanation of why"},
            {"text": "cold;sum=42"},
        ],
        "doomed": [{"text": "never"}],
    },
}
FAULTS = [
    # Each matrix rollout's first sample: its first call is answered HTTP 503 once (retried), its second
    # turn is cut at the length limit. Every call of the doomed task fails.
    *(f"rollout={task}-s0-t0:call=1:status=503" for task in ("matrix", "matrix-r")),
    *(f"rollout={task}-s0-t0:call=3:kind=length" for task in ("matrix", "matrix-r")),
    "task=doomed:status=500",
]
SAMPLING = {
    "logprobs": True,
    "top_logprobs": 1,
    "extra_body": {"return_token_ids": True, "prompt_logprobs": 0},
}


def _row(task_id: str, **model: Any) -> dict[str, Any]:
    return {
        "id": task_id,
        "environment": "calc-weather",
        "input": "Is it cold in Oslo, and in Atlantis? Compute sum([40, 2]). Answer <condition>;sum=<n>.",
        "instructions": "Use the tools. Reply with the answer only.",
        "tools": ["python", "get_weather"],
        "agent": {"max_policy_calls": 5},
        "model": {"sampling": SAMPLING, "max_retries": 1, **model},
        "expected": "cold;sum=42",
    }


@dataclass
class Run:
    out: Path
    records: dict[str, RolloutRecord]
    results: dict[str, WorkerResult]
    inputs: dict[str, WorkerInput]
    metrics: RunMetrics
    yielded: list[RolloutRecord]


async def _collect(url: str, out: Path) -> list[RolloutRecord]:
    rows = [_row("matrix"), _row("matrix-r", api="responses", stream=True), _row("doomed", max_retries=0)]
    got = []
    async with rollcage.collect(
        rows,
        model=url,
        model_name="scripted-policy",
        attempts=2,
        concurrency=6,
        out=out,
        sandbox=SANDBOX,
        max_infra_retries=0,
        deadline_s=120,
    ) as rollouts:
        async for record in rollouts:
            got.append(record)
    return got


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    out = tmp_path_factory.mktemp("acceptance") / "run"
    with PolicyServer(SCRIPT, faults=FAULTS) as server:
        yielded = asyncio.run(_collect(server.base_url, out))
    # JSON round trip: everything below is read back from the files the run wrote.
    records = {
        r.rollout_id: r
        for r in (
            RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()
        )
    }
    results, inputs = {}, {}
    for rid, record in records.items():
        directory = Path(record.rollout_dir)
        results[rid] = WorkerResult.model_validate_json((directory / "result.json").read_bytes())
        inputs[rid] = WorkerInput.model_validate_json((directory / "input.json").read_bytes())
    metrics = RunMetrics.model_validate_json((out / "metrics.json").read_bytes())
    yield Run(out, records, results, inputs, metrics, yielded)


def _calls(run: Run, rid: str) -> list[ModelCall]:
    return run.results[rid].trajectory.model_calls


MATRIX = ["matrix-s0-t0", "matrix-r-s0-t0"]


def test_the_run_went_as_scripted(run: Run) -> None:
    assert {rid: (r.outcome, r.reward) for rid, r in run.records.items()} == {
        "matrix-s0-t0": ("completed", 1.0),
        "matrix-s1-t0": ("completed", 0.0),  # no cut: its second turn's long answer is wrong
        "matrix-r-s0-t0": ("completed", 1.0),
        "matrix-r-s1-t0": ("completed", 0.0),
        "doomed-s0-t0": ("infra_failure", None),
        "doomed-s1-t0": ("infra_failure", None),
    }
    assert sorted(r.rollout_id for r in run.yielded) == sorted(run.records)


@pytest.mark.parametrize("rid", MATRIX)
def test_c1_every_model_call_has_identity_status_attempts_and_termination(run: Run, rid: str) -> None:
    calls = _calls(run, rid)
    assert [c.id for c in calls] == [f"{rid}:m{i}" for i in range(3)]
    assert [c.status for c in calls] == ["completed", "incomplete", "completed"]
    first = calls[0]
    assert [(a.status, a.http_status) for a in first.attempts] == [("failed", 503), ("completed", 200)]
    assert first.attempts[0].error is not None and first.attempts[0].error.kind == "transient"
    assert first.attempts[0].ended_at <= first.attempts[1].started_at
    assert run.results[rid].termination_reason == "completed"


@pytest.mark.parametrize("rid", MATRIX)
def test_c2_every_token_count_and_the_token_data_are_kept(run: Run, rid: str) -> None:
    for call in _calls(run, rid):
        usage = call.usage
        assert None not in (
            usage.input_tokens,
            usage.output_tokens,
            usage.reasoning_tokens,
            usage.total_tokens,
            usage.cached_tokens,
        )
        tokens = call.tokens
        assert tokens.status == "observed" and tokens.prompt_token_ids and tokens.generation_token_ids
        assert len(tokens.prompt_token_ids) == usage.input_tokens
        assert (
            len(tokens.generation_token_ids) == len(tokens.generation_log_probs or []) == usage.output_tokens
        )
    assert (
        run.records[rid].metrics.token_counts == "complete"
        and run.records[rid].metrics.token_ids == "complete"
    )


@pytest.mark.parametrize("rid", MATRIX)
def test_c3_c8_turns_are_records_with_question_answer_reasoning_steps_and_resolution(
    run: Run, rid: str
) -> None:
    turns = run.results[rid].trajectory.turns
    assert [t.id for t in turns] == [f"{rid}:t{i}" for i in range(3)]
    assert [t.resolution for t in turns] == ["acted", "cut_off", "answered"]
    assert turns[0].input == [
        {"type": "message", "role": "user", "content": run.inputs[rid].input}
    ]  # the question, exactly
    assert [i["type"] for i in turns[1].input] == ["function_call_output"] * 3  # the tools' outputs came next
    assert turns[0].reasoning and turns[0].reasoning[0]["summary"][0]["text"].startswith("Look up Oslo")
    assert [i["type"] for i in turns[0].answer] == ["function_call"] * 3
    assert [t.tool_steps for t in turns] == [3, 3, 3]
    assert all(t.started_at <= (t.ended_at or 0) for t in turns)


@pytest.mark.parametrize("rid", MATRIX)
def test_c4_c9_every_request_rebuilds_from_input_json_and_the_trajectory(run: Run, rid: str) -> None:
    spec = run.inputs[rid]
    calls = _calls(run, rid)
    turns = run.results[rid].trajectory.turns
    tools = function_tools(list(spec.tools), codeact=False)
    history: list[ResponseItem] = []
    for turn, call in zip(turns, calls, strict=True):
        history = [*history, *turn.input]
        assert call.input_items() == history  # chat calls keep the Responses-shaped input beside the messages
        endpoint = spec.model.model_copy(update={"sampling": spec.model.sampling})
        assert build_request(endpoint, history, instructions=spec.instructions, tools=tools) == call.request
        if call.api == "chat":
            assert chat_messages(history, spec.instructions) == call.request["messages"]
        assert call.response is not None  # C9: the payloads are kept
        history = [*history, *call.output]


@pytest.mark.parametrize("rid", MATRIX)
def test_c5_c6_c7_parallel_resource_calls_are_timed_apart_and_a_failing_sibling_is_failed(
    run: Run, rid: str
) -> None:
    tools = run.results[rid].trajectory.tool_calls
    assert [(t.name, t.status) for t in tools] == [
        ("get_weather", "completed"),
        ("get_weather", "failed"),  # HTTP 404 from the environment: failed, its text still shown to the model
        ("python", "completed"),
    ]
    assert tools[1].output is not None and tools[1].output.startswith("error: HTTP 404 from get_weather")
    for tool in tools:
        assert tool.ended_at is not None and tool.duration_s == pytest.approx(tool.ended_at - tool.started_at)
    oslo, atlantis = tools[0], tools[1]
    assert atlantis.started_at < (oslo.ended_at or 0) and oslo.started_at < (
        atlantis.ended_at or 0
    )  # concurrent
    assert "cold" in (oslo.output or "")  # C7: a resource server's answer


@pytest.mark.parametrize("rid", MATRIX)
def test_c10_c11_every_model_call_is_owned_exactly_once_by_its_turn_and_the_invocation(
    run: Run, rid: str
) -> None:
    trajectory = run.results[rid].trajectory
    owners = [(call_id, turn.index) for turn in trajectory.turns for call_id in turn.model_calls]
    assert owners == [(call.id, call.turn) for call in trajectory.model_calls]
    assert all(tool.turn == 0 for tool in trajectory.tool_calls) and trajectory.turns[0].tool_calls == [
        t.call_id for t in trajectory.tool_calls
    ]


EXPECTED_HEALTH = {
    # rollout -> findings (everything else evaluated and clean, or unobserved as listed)
    "matrix-s0-t0": ({}, set()),
    "matrix-r-s0-t0": ({}, set()),
    "doomed-s0-t0": (
        # NeMo Gym's rules: the failed call's turn is hollow and its counts missing; the turn still
        # references a call, so only rollcage's own rule finds no answered agent turn.
        {
            "model_call_failed": 1,
            "rollout_missing_answered_turns": 1,
            "rollout_ended_on_failed_model_call": 1,
            "agent_turn_hollow": 1,
            "model_call_missing_token_counts": 1,
        },
        {
            "model_call_zero_completion_not_length_cut",
            "model_call_total_tokens_mismatch",
            "rollout_token_count_mismatch",
            "model_call_token_data_dropped",
        },
    ),
}


@pytest.mark.parametrize("rid", sorted(EXPECTED_HEALTH))
def test_h4_to_h11_each_check_is_evaluated_or_unobserved_with_a_reason(run: Run, rid: str) -> None:
    health = run.records[rid].health
    findings, unobserved = EXPECTED_HEALTH[rid]
    assert health.findings == findings
    assert set(health.unobserved) == unobserved and all(health.unobserved.values())
    assert health.verdict == ("unhealthy" if findings else "healthy")
    # Computed once, when the rollout ended; the same checks on the JSON read back agree.
    assert rollout_health(run.results[rid], run.records[rid].receipt) == health


def test_h12_h13_task_checks_over_the_repeats(run: Run) -> None:
    health = run.metrics.health
    assert health["task_no_successful_model_calls"].rollouts == ["doomed"]
    assert health["task_no_successful_model_calls"].evaluated == 3
    assert health["task_consistently_unhealthy"].rollouts == ["doomed"]
    # The length-limited call with content is neither a runaway generation nor a zero-token call.
    assert health["model_call_runaway_generation"].count == 0
    assert health["model_call_zero_completion_tokens"].count == 0
    assert run.metrics.health_verdicts == {"healthy": 4, "unhealthy": 2, "unobserved": 0}


def test_atif_export_validates_and_carries_the_token_data(run: Run, tmp_path: Path) -> None:
    report = export_run(run.out, "atif", tmp_path / "atif")
    assert report.exported == 6
    for rid in MATRIX:
        document = AtifTrajectory.model_validate(json.loads((tmp_path / "atif" / f"{rid}.json").read_text()))
        agent = [s for s in document.steps if s.source == "agent"]
        assert [s.source for s in document.steps[:2]] == ["system", "user"] and len(agent) == 3
        calls = _calls(run, rid)
        for step, call in zip(agent, calls, strict=True):
            assert (
                step.metrics is not None
                and step.metrics.completion_token_ids == call.tokens.generation_token_ids
            )
            assert step.metrics.logprobs == call.tokens.generation_log_probs
        first = agent[0]
        assert first.tool_calls is not None and [c.function_name for c in first.tool_calls] == [
            "get_weather",
            "get_weather",
            "python",
        ]
        assert first.observation is not None and len(first.observation.results) == 3
        assert document.final_metrics is not None and document.final_metrics.extra is not None
        assert (document.final_metrics.extra["reward"], document.final_metrics.total_steps) == (1.0, 5)


def test_atif_export_is_accepted_by_harbors_own_validator_and_models(run: Run, tmp_path: Path) -> None:
    export_run(run.out, "atif", tmp_path / "atif")
    files = sorted((tmp_path / "atif").glob("*.json"))
    assert len(files) == len(run.records)
    assert harbor_atif_errors(files) == {}


def test_nemo_gym_export_validates_with_tokens_on_the_generating_items(run: Run, tmp_path: Path) -> None:
    target = tmp_path / "rollouts.jsonl"
    report = export_run(run.out, "nemo-gym", target)
    # NeMo Gym's rollout file holds rollouts with a reward: the doomed task's have none.
    assert (report.exported, dict(report.skipped)) == (4, {"no reward (not graded, or masked)": 2})
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    indices = {row["task_id"]: row["_ng_task_index"] for row in rows}
    assert sorted(indices) == ["matrix", "matrix-r"] and len(set(indices.values())) == 2
    assert sorted((row["task_id"], row["_ng_rollout_index"]) for row in rows) == [
        ("matrix", 0),
        ("matrix", 1),
        ("matrix-r", 0),
        ("matrix-r", 1),
    ]
    for row in rows:
        GymVerifyResponse.model_validate(row)
        trajectory = NgTrajectoryRecord.model_validate(row["ng_trajectory"])
        assert check_training_items(row["response"]["output"]) == len(trajectory.model_calls)  # one per call
        refs = [ref.model_call_id for turn in trajectory.turns for ref in turn.model_calls]
        assert refs == [call.model_call_id for call in trajectory.model_calls]
        assert [ref.model_call_id for ref in trajectory.invocations[0].model_calls] == refs
        assert trajectory.turns[-1].resolved is True and trajectory.turns[0].resolved is None


def test_health_under_nemo_gyms_names_agrees_with_nemo_gyms_code_on_the_exported_rows(
    run: Run, tmp_path: Path
) -> None:
    target = tmp_path / "rollouts.jsonl"
    export_run(run.out, "nemo-gym", target)
    nemo = run_upstream("nemo-gym", NEMO_SCRIPT, str(target))
    checked = {got["rollout_id"]: got for got in nemo["rollouts"]}
    assert sorted(checked) == sorted(rid for rid in run.records if not rid.startswith("doomed"))
    differ = {rid: shared_disagreements(run.records[rid].health, got) for rid, got in checked.items()}
    assert not any(differ.values()), json.dumps(differ, indent=1)
