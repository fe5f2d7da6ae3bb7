"""Rollout and run directories for the viewer tests, built from the protocol models.

Every artifact is made by validating a protocol model and writing its JSON, so a
fixture cannot drift from the shapes the worker, supervisor and controller
publish. The checkpoint journal is written in the documented line format of
``rollcage.durable`` (``{"seq": n, <record>, "crc32": "xxxxxxxx"}``, the checksum
over the line without it) so the real ``load_checkpoint`` reads it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rollcage.protocol import (
    SCHEMA_VERSION,
    BoundaryRecord,
    CallAttempt,
    CapturedBody,
    CapturedMessage,
    CaptureExchange,
    HealthFinding,
    ModelCall,
    Outcome,
    Percentiles,
    ResponseOutput,
    RolloutHealth,
    RolloutMetrics,
    RolloutRecord,
    RunMetrics,
    RunnerError,
    SignalEvent,
    SupervisorReceipt,
    TokenUsage,
    ToolCall,
    Trajectory,
    TurnStart,
    WorkerResult,
)
from rollcage.trajectory import build_turns

__all__ = [
    "T0",
    "XSS_IMG",
    "XSS_SCRIPT",
    "RunFixture",
    "cancelled_result",
    "capture_lines",
    "completed_result",
    "model_call",
    "partial_journal",
    "receipt",
    "record",
    "tool_call",
    "trajectory_of",
    "write_large_run",
    "write_rollout_dir",
    "write_run",
]

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: a fixed clock, so rendered times are stable
XSS_SCRIPT = "<script>alert(1)</script>"
XSS_IMG = "<img src=x onerror=alert(2)>"


def model_call(
    index: int,
    *,
    text: str | None = None,
    reasoning: str | None = None,
    calls: Sequence[tuple[str, str, str]] = (),
    status: str = "completed",
    incomplete_reason: str | None = None,
    tokens: tuple[int | None, int | None] = (120, 30),
    start: float = 0.0,
    latency: float = 0.8,
    attempts: int = 1,
    error: RunnerError | None = None,
) -> ModelCall:
    """A model call at ``T0 + start`` with reasoning, text and function calls ``(id, name, args)``."""
    output: list[dict[str, Any]] = []
    if reasoning is not None:
        output.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": reasoning}]})
    if text is not None:
        output.append(
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
        )
    for call_id, name, arguments in calls:
        output.append({"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments})
    request = {
        "model": "scripted",
        "input": [{"role": "user", "content": "What is 2+2?"}] + [{"turn": i} for i in range(index)],
    }
    tries = [
        CallAttempt(
            index=k,
            status="failed",
            http_status=503,
            error=RunnerError(kind="transient", type="TransientModelError", message="HTTP 503"),
            started_at=T0 + start,
            ended_at=T0 + start + latency / 2,
        )
        for k in range(attempts - 1)
    ]
    tries.append(
        CallAttempt(
            index=attempts - 1,
            status="failed" if status == "failed" else "completed",
            http_status=500 if status == "failed" else 200,
            error=error,
            started_at=T0 + start,
            first_byte_at=T0 + start + latency / 4,
            ended_at=T0 + start + latency,
        )
    )
    return ModelCall(
        id=f"r:m{index}",
        index=index,
        turn=index,
        api="responses",
        request=request,
        response=None if status == "failed" else {"id": f"resp_{index}", "output": output},
        status=status,
        incomplete_reason=incomplete_reason,
        output=output,
        usage=TokenUsage(
            input_tokens=tokens[0],
            output_tokens=tokens[1],
            total_tokens=None if None in tokens else (tokens[0] or 0) + (tokens[1] or 0),
        ),
        http_status=500 if status == "failed" else 200,
        attempts=tries,
        started_at=T0 + start,
        first_byte_at=T0 + start + latency / 4,
        ended_at=T0 + start + latency,
        error=error,
    )


def trajectory_of(calls: Sequence[ModelCall], tools: Sequence[ToolCall]) -> Trajectory:
    """A trajectory whose turns own ``calls`` one each (each turn's question: one user message)."""
    starts = [
        TurnStart(
            index=call.turn,
            id=f"r:t{call.turn}",
            model_call_id=call.id,
            started_at=call.started_at,
            input=[{"type": "message", "role": "user", "content": f"question {call.turn}"}],
        )
        for call in calls
    ]
    return Trajectory(
        model_calls=list(calls), tool_calls=list(tools), turns=build_turns(starts, calls, tools, final=True)
    )


def tool_call(
    call_id: str,
    name: str,
    arguments: str,
    turn: int,
    *,
    output: str | None,
    status: str = "completed",
    start: float = 1.0,
    duration: float | None = 0.05,
) -> ToolCall:
    """A tool call that started at ``T0 + start``."""
    return ToolCall(
        call_id=call_id,
        name=name,
        arguments=arguments,
        turn=turn,
        status=status,
        output=output,
        started_at=T0 + start,
        ended_at=None if duration is None else T0 + start + duration,
        duration_s=duration,
    )


def completed_result(
    rollout_id: str = "calc-1-s0-t0",
    task_id: str = "calc-1",
    *,
    tool_output: str = "4",
    answer: str = "The answer is 4.",
) -> WorkerResult:
    """Two turns: reasoning + a python tool call, then the answer."""
    calls = [
        model_call(
            0,
            text="Let me compute that with Python.",
            reasoning="The user wants 2+2. I should use the python tool to be sure of the arithmetic.",
            calls=[("call_py_1", "python", '{"code": "print(2+2)"}')],
            start=0.0,
        ),
        model_call(1, text=answer, tokens=(160, 12), start=1.2),
    ]
    tools = [tool_call("call_py_1", "python", '{"code": "print(2+2)"}', 0, output=tool_output, start=0.9)]
    return WorkerResult(
        rollout_id=rollout_id,
        task_id=task_id,
        response=ResponseOutput(
            id=rollout_id, model="scripted", status="completed", output=[], output_text=answer
        ),
        trajectory=trajectory_of(calls, tools),
        termination_reason="completed",
        started_at=T0 - 0.1,
        ended_at=T0 + 2.5,
    )


def cancelled_result(rollout_id: str = "calc-2-s0-t0", task_id: str = "calc-2") -> WorkerResult:
    """Stopped by SIGTERM while its weather tool call was running: the call is kept, marked incomplete."""
    calls = [
        model_call(
            0,
            text="Checking the weather.",
            calls=[("call_w_1", "get_weather", '{"city": "Oslo"}')],
        )
    ]
    tools = [
        tool_call(
            "call_w_1",
            "get_weather",
            '{"city": "Oslo"}',
            0,
            output="[tool call interrupted: the rollout was cancelled]",
            status="incomplete",
            duration=None,
        )
    ]
    return WorkerResult(
        rollout_id=rollout_id,
        task_id=task_id,
        response=None,
        trajectory=trajectory_of(calls, tools),
        termination_reason="cancelled",
        error=RunnerError(
            kind="cancelled", type="Cancelled", message="SIGTERM received: the run was cancelled"
        ),
        started_at=T0,
        ended_at=T0 + 3.0,
    )


def partial_journal(rollout_id: str = "calc-3-s0-t0") -> list[BoundaryRecord]:
    """A journal cut short by SIGKILL: one model call and its tool call still pending."""
    call = model_call(
        0,
        text="Running the calculation now.",
        calls=[("call_py_9", "python", '{"code": "sum(range(10))"}')],
    )
    pending = tool_call(
        "call_py_9", "python", '{"code": "sum(range(10))"}', 0, output=None, status="pending", duration=None
    )
    start = TurnStart(
        index=0,
        id=f"{rollout_id}:t0",
        model_call_id=call.id,
        started_at=T0,
        input=[{"type": "message", "role": "user", "content": "Sum 0..9."}],
    )
    return [
        BoundaryRecord(kind="start", at=T0, schema_version=SCHEMA_VERSION, rollout_id=rollout_id),
        BoundaryRecord(kind="turn_start", at=T0, turn=start),
        BoundaryRecord(kind="model_call", at=T0 + 0.8, model_call=call, tool_calls=[pending]),
    ]


def receipt(rollout_id: str, outcome: Outcome, **overrides: Any) -> SupervisorReceipt:
    """A receipt with sensible defaults for ``outcome``."""
    fields: dict[str, Any] = {
        "rollout_id": rollout_id,
        "outcome": outcome,
        "outcome_reason": {
            "completed": "valid result, no error",
            "agent_error": "the agent failed after a model response",
            "timeout": "the deadline fired",
            "cancelled": "stopped by the controller",
            "infra_failure": "worker killed by SIGKILL from outside the supervisor; no result.json",
        }[outcome],
        "sandbox": "bwrap",
        "exit_code": 0 if outcome == "completed" else 1,
        "deadline_s": 600.0,
        "grace_s": 5.0,
        "deadline_fired": outcome == "timeout",
        "stop_requested": outcome == "cancelled",
        "signals_sent": (
            [SignalEvent(signal="SIGTERM", target="group", at=T0 + 2.0, reason="stop")]
            if outcome == "cancelled"
            else []
        ),
        "started_at": T0 - 0.2,
        "ended_at": T0 + 3.0,
        "duration_s": 3.2,
        "cleanup_confirmed": True,
        "last_checkpoint_seq": 4,
        "result_present": outcome != "infra_failure",
        "result_valid": outcome != "infra_failure",
    }
    if outcome == "infra_failure":
        fields["exit_code"] = None
        fields["exit_signal"] = "SIGKILL"
    fields.update(overrides)
    return SupervisorReceipt.model_validate(fields)


def record(
    rollout_id: str,
    task_id: str,
    outcome: Outcome,
    reward: float | None,
    *,
    rollout_dir: str,
    sample: int = 0,
    try_index: int = 0,
    tokens: int | None = 322,
    duration: float = 3.2,
    health: RolloutHealth | None = None,
) -> RolloutRecord:
    """One ``rollouts.jsonl`` line."""
    graded = outcome in ("completed", "agent_error")
    return RolloutRecord(
        rollout_id=rollout_id,
        task_id=task_id,
        sample=sample,
        try_index=try_index,
        outcome=outcome,
        graded=graded,
        reward=reward if graded else None,
        grader={"name": "exact", "expected_match": reward == 1.0} if graded else None,
        termination_reason="completed" if outcome == "completed" else None,
        receipt=receipt(rollout_id, outcome),
        metrics=RolloutMetrics(
            model_calls=2, tool_calls=1, total_tokens=tokens, input_tokens=None, duration_s=duration
        ),
        health=health or RolloutHealth(verdict="healthy", successful_model_calls=2),
        rollout_dir=rollout_dir,
    )


def capture_lines(result: WorkerResult) -> list[dict[str, Any]]:
    """A ``model_capture.jsonl`` that agrees with ``result``'s trajectory, in the proxy's own line shape."""
    lines = []
    for call in result.trajectory.model_calls:
        for _ in range(len(call.attempts)):
            body = orjson.dumps(call.request)
            answer = orjson.dumps(call.response)
            exchange = CaptureExchange(
                seq=len(lines) + 1,
                rollout_id=result.rollout_id,
                route="model",
                name=None,
                method="POST",
                path="/model/v1/responses",
                upstream_url="http://127.0.0.1:9/v1/responses",
                credential_added=False,
                request=CapturedMessage(
                    headers=[("content-type", "application/json")],
                    body=CapturedBody(size=len(body), json_value=call.request),
                ),
                response=CapturedMessage(
                    headers=[("content-type", "application/json")],
                    body=CapturedBody(size=len(answer), json_value=call.response),
                    status=200,
                ),
                status=200,
                started_at=call.started_at,
                first_byte_at=call.first_byte_at,
                ended_at=call.ended_at,
                duration_s=call.ended_at - call.started_at,
                error=None,
            )
            line = exchange.model_dump(mode="json")
            for message in (line["request"], line["response"]):
                # The proxy writes only the body's one present form (json, text or base64).
                message["body"] = {key: value for key, value in message["body"].items() if value is not None}
            lines.append(line)
    return lines


def _journal_bytes(records: list[BoundaryRecord]) -> bytes:
    lines = []
    for seq, boundary in enumerate(records, start=1):
        body = orjson.dumps({"seq": seq, **boundary.model_dump(mode="json", exclude_none=True)})
        crc = f"{zlib.crc32(body) & 0xFFFFFFFF:08x}"
        lines.append(body[:-1] + f',"crc32":"{crc}"}}\n'.encode())
    return b"".join(lines)


def write_rollout_dir(
    directory: Path,
    *,
    result: WorkerResult | None = None,
    journal: list[BoundaryRecord] | None = None,
    receipt_model: SupervisorReceipt | None = None,
    task_input: str | None = "What is 2+2? Answer with a sentence.",
    capture: list[dict[str, Any]] | None = None,
    log: str | None = None,
    raw_result: bytes | None = None,
) -> Path:
    """Write a rollout directory with the artifacts given (each one optional)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "workspace").mkdir(exist_ok=True)
    rollout_id = directory.name
    if task_input is not None:
        # input.json as the supervisor writes it; the viewer reads only ids, input and instructions.
        payload = {
            "schema_version": SCHEMA_VERSION,
            "rollout_id": rollout_id,
            "task_id": rollout_id.rsplit("-s", 1)[0],
            "input": task_input,
            "instructions": "You are a careful calculator. Use tools.",
            "model": {"base_url": "http://127.0.0.1:8000/v1", "model": "scripted"},
        }
        (directory / "input.json").write_bytes(orjson.dumps(payload))
    if result is not None:
        (directory / "result.json").write_text(result.model_dump_json())
    if raw_result is not None:
        (directory / "result.json").write_bytes(raw_result)
    if journal is not None:
        (directory / "checkpoint.jsonl").write_bytes(_journal_bytes(journal))
    if receipt_model is not None:
        (directory / "receipt.json").write_text(receipt_model.model_dump_json())
    if capture is not None:
        (directory / "model_capture.jsonl").write_bytes(
            b"".join(orjson.dumps(line) + b"\n" for line in capture)
        )
    if log is not None:
        (directory / "worker.log").write_text(log)
    return directory


@dataclass
class RunFixture:
    """A run directory and what went into it."""

    path: Path
    """The run directory."""
    metrics: RunMetrics
    """What metrics.json holds."""
    records: list[RolloutRecord]
    """What rollouts.jsonl holds (without the torn tail)."""


def write_run(run_dir: Path, *, torn_tail: bool = True) -> RunFixture:
    """A run with a rollout of every outcome, one of which shows hostile agent output.

    * ``calc-1-s0-t0`` completed, reward 1; ``calc-1-s1-t0`` completed, reward 0,
      its tool output is ``<script>alert(1)</script>`` and its answer an ``<img onerror>``;
    * ``calc-2-s0-t0`` cancelled; ``calc-3-s0-t0`` infra_failure with a partial journal;
    * ``calc-4-s0-t0`` timeout; ``calc-5-s0-t0`` agent_error, reward 0, whose capture disagrees.
    """
    rollouts = run_dir / "rollouts"
    good = completed_result("calc-1-s0-t0", "calc-1")
    write_rollout_dir(
        rollouts / "calc-1-s0-t0",
        result=good,
        receipt_model=receipt("calc-1-s0-t0", "completed"),
        capture=capture_lines(good),
        log="worker started\nagent finished\n",
    )
    hostile = completed_result(
        "calc-1-s1-t0", "calc-1", tool_output=f"{XSS_SCRIPT} 4", answer=f"{XSS_IMG} The answer is 5."
    )
    write_rollout_dir(
        rollouts / "calc-1-s1-t0",
        result=hostile,
        receipt_model=receipt("calc-1-s1-t0", "completed"),
        task_input=f"What is 2+2? {XSS_SCRIPT}",
    )
    write_rollout_dir(
        rollouts / "calc-2-s0-t0",
        result=cancelled_result("calc-2-s0-t0", "calc-2"),
        receipt_model=receipt("calc-2-s0-t0", "cancelled"),
        log="worker started\nSIGTERM received\n",
    )
    write_rollout_dir(
        rollouts / "calc-3-s0-t0",
        journal=partial_journal("calc-3-s0-t0"),
        receipt_model=receipt("calc-3-s0-t0", "infra_failure"),
    )
    timed_out = cancelled_result("calc-4-s0-t0", "calc-4")
    write_rollout_dir(
        rollouts / "calc-4-s0-t0", result=timed_out, receipt_model=receipt("calc-4-s0-t0", "timeout")
    )
    agent_error = completed_result("calc-5-s0-t0", "calc-5").model_copy(
        update={
            "error": RunnerError(
                kind="fatal", type="InvalidPolicyOutput", message="malformed tool JSON twice"
            ),
            "termination_reason": "invalid_policy_output",
        }
    )
    disagreeing = capture_lines(agent_error)
    sent = disagreeing[1]["request"]["body"]
    sent["json"] = {**sent["json"], "temperature": 0.7}
    extra = orjson.loads(orjson.dumps(disagreeing[0]))
    extra["seq"] = len(disagreeing) + 1
    extra["request"]["body"] = {"size": 38, "json": {"model": "scripted", "input": "extra"}}
    disagreeing.append(extra)
    write_rollout_dir(
        rollouts / "calc-5-s0-t0",
        result=agent_error,
        receipt_model=receipt("calc-5-s0-t0", "agent_error"),
        capture=disagreeing,
    )

    records = [
        record("calc-1-s0-t0", "calc-1", "completed", 1.0, rollout_dir="rollouts/calc-1-s0-t0"),
        record("calc-1-s1-t0", "calc-1", "completed", 0.0, rollout_dir="rollouts/calc-1-s1-t0", sample=1),
        record("calc-2-s0-t0", "calc-2", "cancelled", None, rollout_dir="rollouts/calc-2-s0-t0", tokens=150),
        record(
            "calc-3-s0-t0", "calc-3", "infra_failure", None, rollout_dir="rollouts/calc-3-s0-t0", tokens=None
        ),
        record(
            "calc-4-s0-t0", "calc-4", "timeout", None, rollout_dir="rollouts/calc-4-s0-t0", duration=600.0
        ),
        record("calc-5-s0-t0", "calc-5", "agent_error", 0.0, rollout_dir="rollouts/calc-5-s0-t0"),
    ]
    data = b"".join(orjson.dumps(r.model_dump(mode="json")) + b"\n" for r in records)
    if torn_tail:
        data += b'{"schema_version":1,"rollout_id":"calc-6-s0'  # a crash mid-append
    (run_dir / "rollouts.jsonl").write_bytes(data)
    metrics = RunMetrics(
        dataset="examples/calc/dataset.jsonl",
        tasks=5,
        rollouts=6,
        outcomes={"completed": 2, "agent_error": 1, "timeout": 1, "cancelled": 1, "infra_failure": 1},
        graded=3,
        mean_reward=1 / 3,
        pass_at_1=0.25,
        pass_at_k=0.5,
        k=2,
        retries=1,
        tokens=TokenUsage(input_tokens=1400, output_tokens=210, total_tokens=1610),
        duration_s=Percentiles(mean=102.67, p50=3.2, p90=301.6, p99=570.16, max=600.0),
        wall_s=612.5,
        health={
            "model_call_failed": HealthFinding(count=0, detail="model calls that failed (count: calls)"),
            "trajectory_capture_accounting": HealthFinding(
                count=1, rollouts=["calc-5-s0-t0"], detail="worker trajectory vs model_capture.jsonl"
            ),
        },
    )
    (run_dir / "metrics.json").write_text(metrics.model_dump_json())
    return RunFixture(path=run_dir, metrics=metrics, records=records)


def _linked(source: Path, directory: Path) -> Path:
    """``directory`` holding hard links to ``source``'s files: a rollout directory of its own, made fast."""
    directory.mkdir()
    for path in source.iterdir():
        if path.is_file():
            os.link(path, directory / path.name)
    return directory


def write_large_run(run_dir: Path, count: int) -> RunMetrics:
    """``count`` synthetic records whose rollout directories hard-link a handful of shared artifacts.

    Each record has its own ``rollouts/<rollout_id>/`` (readers look nowhere else), made of
    links so that writing the run stays fast.
    """
    outcomes: list[Outcome] = [
        "completed",
        "completed",
        "agent_error",
        "timeout",
        "cancelled",
        "infra_failure",
    ]
    shared = []
    for index in range(8):
        result = completed_result(f"shared-{index}", f"task-{index}")
        shared.append(
            write_rollout_dir(
                run_dir / "rollouts" / f"shared-{index}",
                result=result,
                receipt_model=receipt(f"shared-{index}", "completed"),
                capture=capture_lines(result),
            )
        )
    tally: dict[Outcome, int] = dict.fromkeys(outcomes, 0)
    with (run_dir / "rollouts.jsonl").open("wb") as handle:
        base = record("x", "x", "completed", 1.0, rollout_dir="x").model_dump(mode="json")
        for index in range(count):
            outcome = outcomes[index % len(outcomes)]
            tally[outcome] += 1
            graded = outcome in ("completed", "agent_error")
            rollout_id = f"task-{index // 2}-s{index % 2}-t0"
            line = {
                **base,
                "rollout_id": rollout_id,
                "task_id": f"task-{index // 2}",
                "sample": index % 2,
                "outcome": outcome,
                "graded": graded,
                "reward": float(index % 3 == 0) if graded else None,
                "metrics": {
                    **base["metrics"],
                    "total_tokens": 100 + index % 977,
                    "duration_s": 1 + index % 37,
                },
                "rollout_dir": str(_linked(shared[index % len(shared)], run_dir / "rollouts" / rollout_id)),
            }
            handle.write(orjson.dumps(line) + b"\n")
    metrics = RunMetrics(
        dataset="synthetic.jsonl",
        tasks=(count + 1) // 2,
        rollouts=count,
        outcomes=tally,
        graded=tally["completed"] + tally["agent_error"],
        mean_reward=0.33,
        pass_at_1=0.33,
        pass_at_k=0.5,
        k=2,
        retries=0,
    )
    (run_dir / "metrics.json").write_text(metrics.model_dump_json())
    return metrics
