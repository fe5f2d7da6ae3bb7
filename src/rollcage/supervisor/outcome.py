"""The outcome of one attempt, from the evidence the supervisor gathered: one pure function.

The rules, in order (DESIGN.md's outcome table; the first that applies wins):

1. the worker could not be run under supervision (bad ``input.json``, the
   worker could not be started, the supervisor itself failed) → ``infra_failure``;
1b. the rollout exceeded one of its budgets (e.g. the capture's bytes) →
    ``agent_error``: the policy's fault, whatever the worker did after;
2. the supervisor stopped the worker at the **deadline** → ``timeout``;
3. the supervisor stopped it on an external **stop** (signal, stop file, the
   controller's event) → ``cancelled``;
4. the worker died of a signal the supervisor did not send → ``infra_failure``;
5. no ``result.json``, or one that is not a valid ``WorkerResult`` →
   ``infra_failure`` (with exit code 0 that is a protocol violation, and the
   reason says so). A checkpoint never stands in for a result;
6. a valid result without error → ``completed``;
7. a ``transient`` error → ``infra_failure``;
8. a ``cancelled`` error the supervisor did not ask for → ``infra_failure``;
9. a ``fatal`` error after at least one model response → ``agent_error`` (the
   policy's fault, graded); before any model response (bad input, a kernel that
   never started, 401 from the endpoint) → ``infra_failure``, the worker's message
   carried into the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from rollcage.protocol import Outcome, WorkerResult

__all__ = ["OutcomeEvidence", "classify_outcome", "model_responses"]


@dataclass(frozen=True)
class OutcomeEvidence:
    """What the supervisor knows once the worker is gone.

    Attributes:
        stop_cause: What made the supervisor stop the worker before it exited by
            itself: ``deadline``, ``stop``, or ``None`` (it exited on its own).
        deadline_s: The deadline, for the words of the reason.
        exit_code: The worker's exit code; ``None`` if a signal ended it or it never ran.
        exit_signal: The signal that ended it (``'SIGKILL'``), if any.
        signals_sent: Names of the signals the supervisor sent to the worker.
        result_present: ``result.json`` existed after the worker exited.
        result: The parsed result, if it was valid.
        result_problem: Why ``result.json`` is not valid (when present but invalid).
        setup_failure: Why the worker could not run under supervision (invalid
            input, it could not be started, the supervisor failed), in words.
        log_tail: The last line of ``worker.log``, to help explain a missing result.
        budget_exceeded: The per-rollout budget the rollout exceeded, in words; ``None``: none.
    """

    stop_cause: Literal["deadline", "stop"] | None = None
    deadline_s: float = 0.0
    exit_code: int | None = None
    exit_signal: str | None = None
    signals_sent: Sequence[str] = field(default_factory=tuple)
    result_present: bool = False
    result: WorkerResult | None = None
    result_problem: str | None = None
    setup_failure: str | None = None
    log_tail: str | None = None
    budget_exceeded: str | None = None


def model_responses(result: WorkerResult) -> int:
    """How many model calls of the result got a response."""
    return sum(1 for call in result.trajectory.model_calls if call.response is not None)


def _result_words(evidence: OutcomeEvidence) -> str:
    result = evidence.result
    if result is not None:
        kind = "no error" if result.error is None else f"error kind {result.error.kind!r}"
        return f"its result ({kind}) is kept as evidence and is not graded"
    if evidence.result_present:
        return f"its result.json is invalid ({evidence.result_problem})"
    return "it published no result"


def _exit_words(evidence: OutcomeEvidence) -> str:
    if evidence.exit_signal is not None:
        return f"the worker was killed by {evidence.exit_signal}"
    if evidence.exit_code is not None:
        return f"the worker exited with code {evidence.exit_code}"
    return "the worker's exit status is unknown"


def classify_outcome(evidence: OutcomeEvidence) -> tuple[Outcome, str]:
    """Classify one attempt (see the module docstring for the rules).

    Args:
        evidence: What the supervisor gathered.

    Returns:
        The outcome and the reason, in words.
    """
    if evidence.setup_failure is not None:
        return "infra_failure", evidence.setup_failure
    if evidence.budget_exceeded is not None:
        return "agent_error", f"{evidence.budget_exceeded}; the rollout was stopped (the policy's fault)"
    if evidence.stop_cause == "deadline":
        return "timeout", f"the deadline of {evidence.deadline_s:g}s fired; {_result_words(evidence)}"
    if evidence.stop_cause == "stop":
        return "cancelled", f"stopped on request; {_result_words(evidence)}"
    if evidence.exit_signal is not None and evidence.exit_signal not in evidence.signals_sent:
        return (
            "infra_failure",
            f"the worker was killed by {evidence.exit_signal}, which the supervisor did not send "
            f"(OOM killer, preemption, another process); {_result_words(evidence)}",
        )
    violation = " (a protocol violation: exit code 0 promises a result)" if evidence.exit_code == 0 else ""
    if not evidence.result_present:
        tail = f"; worker.log ends with: {evidence.log_tail}" if evidence.log_tail else ""
        return "infra_failure", f"no result.json: {_exit_words(evidence)}{violation}{tail}"
    result = evidence.result
    if result is None:
        return (
            "infra_failure",
            f"result.json is invalid ({evidence.result_problem}): {_exit_words(evidence)}{violation}",
        )
    error = result.error
    if error is None:
        return "completed", "the worker published a valid result without error"
    what = f"{error.type}: {error.message}"
    if error.kind == "transient":
        return "infra_failure", f"transient (infrastructure) error: {what}"
    if error.kind == "cancelled":
        return "infra_failure", f"the worker cancelled itself without a stop from the supervisor: {what}"
    responses = model_responses(result)
    if responses == 0:
        return "infra_failure", f"fatal error before the first model response: {what}"
    return "agent_error", f"fatal error after {responses} model response(s): {what}"
