"""A fake supervisor that keeps the supervisor's contract without running any process.

It lets the scheduler (concurrency, retries, resume, stop) be tested in
milliseconds and deterministically; the real supervisor is exercised by the
end-to-end tests. It reads ``input.json``, writes ``result.json`` (when the
planned outcome has one) and ``receipt.json``, and returns both (``supervise_rollout``'s ``Supervised``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollcage.durable import publish_json
from rollcage.protocol import (
    CallAttempt,
    ModelCall,
    Outcome,
    ResponseOutput,
    RunnerError,
    SupervisorReceipt,
    TokenUsage,
    Trajectory,
    TurnStart,
    WorkerInput,
    WorkerResult,
)
from rollcage.supervisor import Supervised
from rollcage.trajectory import build_turns

__all__ = ["FakePlan", "FakeSupervisor"]


@dataclass(frozen=True)
class FakePlan:
    """What the fake does for one attempt.

    Attributes:
        outcome: The outcome to report.
        answer: The final answer text (``output_text``).
        hang: Wait for the stop event (or ``hang_s``) before answering ``cancelled``/``timeout``.
        usage: Token usage of the one model call; ``None`` leaves it unreported.
    """

    outcome: Outcome = "completed"
    answer: str = ""
    hang: bool = False
    usage: TokenUsage | None = None


class FakeSupervisor:
    """An async callable with ``rollcage.supervisor.supervise``'s signature."""

    def __init__(
        self,
        answers: Mapping[str, str] | None = None,
        *,
        outcomes: Mapping[str, Sequence[Outcome]] | None = None,
        plan: Callable[[WorkerInput, int], FakePlan] | None = None,
        hang_s: float = 30.0,
        delay_s: float = 0.0,
    ) -> None:
        """Configure the fake.

        Args:
            answers: Final answer per task id (default ``""``).
            outcomes: Outcome per task id and try index (last one repeats); default completed.
            plan: Full control: ``plan(worker_input, try_index)`` (overrides the two above).
            hang_s: How long a hanging attempt waits for the stop before reporting ``timeout``.
            delay_s: Time each attempt takes (to observe concurrency).
        """
        self._answers = dict(answers or {})
        self._outcomes = {k: list(v) for k, v in (outcomes or {}).items()}
        self._plan = plan
        self._hang_s = hang_s
        self._delay_s = delay_s
        self.calls: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.started = asyncio.Event()
        self._changed = asyncio.Event()

    async def wait_in_flight(self, count: int, *, timeout_s: float = 60.0) -> None:
        """Return once ``count`` attempts are in flight at the same time.

        Raises:
            TimeoutError: Not reached within ``timeout_s``.

        **Cancellation:** nothing to undo.
        """
        async with asyncio.timeout(timeout_s):
            while self.in_flight < count:
                self._changed.clear()
                await self._changed.wait()

    def plan_for(self, worker_input: WorkerInput) -> FakePlan:
        """The plan for an attempt, from the constructor's arguments."""
        try_index = int(worker_input.rollout_id.rsplit("-t", 1)[1])
        if self._plan is not None:
            return self._plan(worker_input, try_index)
        outcomes = self._outcomes.get(worker_input.task_id, ["completed"])
        outcome = outcomes[min(try_index, len(outcomes) - 1)]
        usage = TokenUsage(input_tokens=10, output_tokens=5, total_tokens=15)
        return FakePlan(outcome=outcome, answer=self._answers.get(worker_input.task_id, ""), usage=usage)

    async def __call__(
        self, rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None
    ) -> Supervised:
        """Play one attempt and return its receipt and result (``supervise_rollout``'s contract).

        **Cancellation:** propagates at once; nothing is written after it.
        """
        started = time.time()
        raw = await asyncio.to_thread((rollout_dir / "input.json").read_bytes)
        worker_input = WorkerInput.model_validate_json(raw)
        self.calls.append(worker_input.rollout_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.started.set()
        self._changed.set()
        try:
            plan = self.plan_for(worker_input)
            outcome = plan.outcome
            stop_requested = False
            if plan.hang:
                stopped = False
                if stop is not None:
                    try:
                        async with asyncio.timeout(self._hang_s):
                            await stop.wait()
                        stopped = True
                    except TimeoutError:
                        stopped = False
                outcome = "cancelled" if stopped else "timeout"
                stop_requested = stopped
            elif self._delay_s:
                await asyncio.sleep(self._delay_s)
            result = self._result(worker_input, plan, outcome, started)
            if result is not None:
                await asyncio.to_thread(publish_json, rollout_dir / "result.json", result)
            ended = time.time()
            receipt = SupervisorReceipt(
                rollout_id=worker_input.rollout_id,
                outcome=outcome,
                outcome_reason=f"fake: {outcome}",
                sandbox="none",
                exit_code=0 if outcome == "completed" else 1,
                deadline_s=self._hang_s,
                grace_s=0.0,
                deadline_fired=outcome == "timeout",
                stop_requested=stop_requested,
                started_at=started,
                ended_at=ended,
                duration_s=ended - started,
                cleanup_confirmed=True,
                result_present=result is not None,
                result_valid=result is not None,
                result_error=result.error if result is not None else None,
                model_calls_captured=None,
            )
            await asyncio.to_thread(publish_json, rollout_dir / "receipt.json", receipt)
            return Supervised(receipt, result)
        finally:
            self.in_flight -= 1
            self._changed.set()

    @staticmethod
    def _result(
        worker_input: WorkerInput, plan: FakePlan, outcome: Outcome, started: float
    ) -> WorkerResult | None:
        if outcome == "infra_failure":
            return None
        now = time.time()
        usage = plan.usage or TokenUsage()
        message = {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": plan.answer}],
        }
        rid = worker_input.rollout_id
        call = ModelCall(
            id=f"{rid}:m0",
            index=0,
            turn=0,
            api="chat",
            request={},
            response={},
            status="completed",
            output=[message],
            usage=usage,
            attempts=[
                CallAttempt(index=0, status="completed", http_status=200, started_at=started, ended_at=now)
            ],
            started_at=started,
            ended_at=now,
        )
        start = TurnStart(
            index=0,
            id=f"{rid}:t0",
            model_call_id=call.id,
            started_at=started,
            input=[{"type": "message", "role": "user", "content": "task"}],
        )
        error: RunnerError | None = None
        if outcome == "agent_error":
            error = RunnerError(kind="fatal", type="FakeError", message="the agent broke")
        elif outcome in ("cancelled", "timeout"):
            error = RunnerError(kind="cancelled", type="Cancelled", message="stopped")
        return WorkerResult(
            rollout_id=worker_input.rollout_id,
            task_id=worker_input.task_id,
            response=ResponseOutput(
                id=worker_input.rollout_id,
                model=worker_input.model.model,
                status="completed" if error is None else "incomplete",
                output=[message],
                output_text=plan.answer,
                usage=usage,
            ),
            trajectory=Trajectory(model_calls=[call], turns=build_turns([start], [call], [], final=True)),
            # A worker that called no tool ends with the cookies it started with.
            resource_cookies=dict(worker_input.resource_cookies),
            termination_reason="completed"
            if error is None
            else ("cancelled" if error.kind == "cancelled" else "error"),
            error=error,
            started_at=started,
            ended_at=now,
        )
