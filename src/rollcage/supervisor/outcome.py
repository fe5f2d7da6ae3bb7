"""The outcome of one attempt, from the evidence the supervisor gathered: one pure function.

The rules, in order (the outcome table of docs/reference/outcomes.md; the first that applies wins):

1. the worker could not be run under supervision (bad ``input.json``, the
   worker could not be started, the supervisor itself failed) → ``infra_failure``;
   so too when the supervisor could not keep the evidence (the disk filled up while
   it copied the workspace back or kept ``result.json``): the infrastructure's fault,
   never the worker's;
2. the rollout went over one of its **budgets** (total memory or processes,
   workspace, ``/tmp`` or ``/dev/shm`` bytes or inodes, the capture's bytes) after the policy had acted
   (a model response in the result or the journal) → ``agent_error``: the agent's
   code made the sandbox grow, so this is the policy's fault, whatever else
   happened next (the kernel killing the worker for the memory budget, a deadline
   that fired meanwhile); before any model response the budget was too small for
   the worker itself → ``infra_failure``;
3. the supervisor stopped the worker at the **deadline** → ``timeout``;
4. the supervisor stopped it on an external **stop** (signal, stop file, the
   controller's event) → ``cancelled``;
5. the worker died of a signal the supervisor did not send → ``infra_failure``;
6. no ``result.json``, or one that is not a valid ``WorkerResult`` →
   ``infra_failure`` (with exit code 0 that is a protocol violation, and the
   reason says so). A checkpoint never stands in for a result;
7. a valid result without error → ``completed``;
8. a ``transient`` error → ``infra_failure``;
9. a ``cancelled`` error the supervisor did not ask for → ``infra_failure``;
10. a ``fatal`` error after at least one model response → ``agent_error`` (the
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
            itself: ``deadline``, ``stop``, ``budget``, or ``None`` (it exited on its own).
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
        budget_exceeded: The budget the sandbox went over and what was seen, in words
            (``"memory_bytes: ..."``); ``None``: every budget held.
        journal_responses: Model responses recorded in the checkpoint journal (the
            result may be missing when a budget ended the rollout).
        evidence_problem: Why the supervisor could not keep the rollout's evidence on the
            disk (the disk filled up while it copied the workspace back), in words; ``None``:
            it kept all of it.
    """

    stop_cause: Literal["deadline", "stop", "budget"] | None = None
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
    journal_responses: int = 0
    evidence_problem: str | None = None


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
    if evidence.evidence_problem is not None:
        return (
            "infra_failure",
            f"infrastructure failure after the worker ended: {evidence.evidence_problem}; "
            f"{_exit_words(evidence)}",
        )
    if evidence.budget_exceeded is not None:
        result = evidence.result
        kept = "it published no result" if result is None else "its result is kept as evidence"
        words = f"{_exit_words(evidence)}; {kept}"
        responses = max(
            evidence.journal_responses, model_responses(evidence.result) if evidence.result else 0
        )
        if responses == 0:
            return (
                "infra_failure",
                f"budget exceeded before the first model response (too small for the worker itself?): "
                f"{evidence.budget_exceeded}; {words}",
            )
        return "agent_error", f"budget exceeded: {evidence.budget_exceeded}; the rollout was ended; {words}"
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
