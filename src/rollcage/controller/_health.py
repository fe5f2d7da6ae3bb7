"""Health checks of a rollout, computed once when it ends, under NeMo Gym's names.

Each check looks for a way a rollout can *look* fine while its data is not: a
reward computed where the model never answered, token counts nobody reported, a
capture that disagrees with what the worker says it did. The checks under NeMo
Gym's names follow NeMo Gym 0.7.0's own code (``nemo_gym/health/checks.py``,
``nemo_gym/rollout_health.py``) rule for rule, read on rollcage's own trajectory as
NeMo Gym reads the ``ng_trajectory`` that ``export --format nemo-gym`` writes of it
(tests/controller/test_health_nemo.py runs NeMo Gym's code on such rows and asserts
the same counts). Where rollcage's own rule is stricter it runs beside, under its
own name:

==========================================  ======  ===========================================
check                                       NeMo    finds
==========================================  ======  ===========================================
check_execution_error                       yes     checks that raised (each is then unobserved)
record_unreadable                           yes     a result.json present but not valid
rollout_duplicate_identity                  yes     records of one attempt logged twice (ledger)
rollout_missing_agent_turns                 H4      no turn with a message, tool call or call
rollout_ended_on_failed_model_call          yes     the last model call (by start) failed
agent_turn_hollow                           H5      turns with no text, reasoning or tool call
                                                    (a failed call's turn included)
trajectory_capture_mismatch                 H6      call references resolving to none or several
model_call_failed                           H7      calls with an HTTP error status or an error
model_call_missing_token_counts             H8      calls without both token counts (failed and
                                                    cut-off ones included)
model_call_zero_completion_tokens           H9      calls reporting 0 output tokens
model_call_runaway_generation               H10     calls cut at the length limit whose response
                                                    holds no text (a tool call alone is none)
rollout_token_count_mismatch                H11     result totals differ from the calls' sums;
                                                    unobserved when a call has no counts
task_consistently_unhealthy                 H12     tasks whose >= 2 computable repeats are all
                                                    unhealthy by NeMo Gym's checks
task_no_successful_model_calls              H13     tasks with no call that did not fail
rollout_missing_answered_turns              -       no turn whose call came back with an answer
trajectory_capture_accounting               -       ownership that does not add up, or HTTP
                                                    attempts the egress capture does not account
model_call_zero_completion_not_length_cut   -       H9 as ACCEPTANCE.md words it: length cuts
                                                    exempt
model_call_total_tokens_mismatch            -       a call whose total is not input + output
model_call_token_data_dropped               -       token ids or log probabilities the server
                                                    sent invalid or contradictory, and dropped
task_no_answered_model_calls                -       tasks with no answered call in any attempt
==========================================  ======  ===========================================

A check either runs (and finds something or not) or is *unobserved*, with the
evidence it lacked in words: no valid ``result.json``, no model call, no answered
call, no egress capture, no token totals, a call with no counts (failed, or cut off
by a cancel or timeout). Missing evidence is never read as healthy. Rollouts the
run itself stopped (Ctrl-C: ``cancelled``) are counted by the informational
``cancelled_by_run``; ``grader_error`` (informational too) counts rollouts whose
grader failed. The verdict: ``unhealthy`` when a check found something, else
``unobserved`` when one could not run, else ``healthy``; the task checks under
NeMo Gym's names read the verdict over its checks only (``nemo_verdict``).

Everything here is computed from the typed ``WorkerResult`` the supervisor
parsed, once per rollout (``assess``), and carried on the ``RolloutRecord``: a
resumed run reads it back from ``rollouts.jsonl`` and never opens a result again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rollcage.protocol import (
    CallTokens,
    HealthVerdict,
    ModelCall,
    ResponseItem,
    RolloutHealth,
    RolloutMetrics,
    SupervisorReceipt,
    TokenCoverage,
    Trajectory,
    Turn,
    WorkerResult,
)

__all__ = [
    "HEALTH_ALIASES",
    "HEALTH_CHECKS",
    "INFORMATIONAL_CHECKS",
    "TASK_CHECKS",
    "CheckInfo",
    "assess",
    "nemo_verdict",
    "rollout_health",
    "rollout_metrics",
    "unobserved_health",
]


@dataclass(frozen=True, slots=True)
class CheckInfo:
    """One check of the registry.

    Attributes:
        scope: What it is counted over: a rollout's calls or turns, the rollout, or a task.
        nemo: NeMo Gym's acceptance id (``H4``...), or its check id for the checks its acceptance text
            does not number; ``None``: rollcage's own.
        detail: What it looks for, in words.
    """

    scope: Literal["rollout", "task"]
    nemo: str | None
    detail: str


HEALTH_CHECKS: dict[str, CheckInfo] = {
    "check_execution_error": CheckInfo(
        "rollout", "check_execution_error", "checks that raised instead of running (count: checks)"
    ),
    "record_unreadable": CheckInfo(
        "rollout", "record_unreadable", "rollouts whose result.json is present but not a valid result"
    ),
    "rollout_duplicate_identity": CheckInfo(
        "rollout",
        "rollout_duplicate_identity",
        "records that claim an attempt (rollout id) another record of the run claims too (count: records)",
    ),
    "rollout_missing_agent_turns": CheckInfo(
        "rollout", "H4", "rollouts with no turn holding a message, a tool call or a model call"
    ),
    "rollout_ended_on_failed_model_call": CheckInfo(
        "rollout",
        "rollout_ended_on_failed_model_call",
        "rollouts whose last model call (by start time) failed, so a reward cannot tell the model's zero "
        "from the endpoint's",
    ),
    "agent_turn_hollow": CheckInfo(
        "rollout",
        "H5",
        "turns with no text, reasoning or tool call, a turn whose call failed included (count: turns)",
    ),
    "trajectory_capture_mismatch": CheckInfo(
        "rollout",
        "H6",
        "model-call references that resolve to no call or to several (count: call ids)",
    ),
    "model_call_failed": CheckInfo(
        "rollout", "H7", "model calls with an HTTP error status or an error (count: calls)"
    ),
    "model_call_missing_token_counts": CheckInfo(
        "rollout",
        "H8",
        "model calls without input or output token counts, failed and cut-off ones included (count: calls)",
    ),
    "model_call_zero_completion_tokens": CheckInfo(
        "rollout", "H9", "model calls that reported 0 output tokens, whatever their status (count: calls)"
    ),
    "model_call_runaway_generation": CheckInfo(
        "rollout",
        "H10",
        "model calls cut at the output length limit whose response holds no text (a tool call alone is "
        "none) (count: calls)",
    ),
    "rollout_token_count_mismatch": CheckInfo(
        "rollout", "H11", "rollouts whose result token totals differ from the sum of their calls'"
    ),
    "task_consistently_unhealthy": CheckInfo(
        "task", "H12", "tasks with at least two computable repeats, all unhealthy (ids: task ids)"
    ),
    "task_no_successful_model_calls": CheckInfo(
        "task",
        "H13",
        "tasks with no model call that did not fail in any attempt (a call cut off in flight counts as "
        "not failed) (ids: task ids)",
    ),
    "task_no_answered_model_calls": CheckInfo(
        "task", None, "tasks with no model call that came back with an answer in any attempt (ids: task ids)"
    ),
    "rollout_missing_answered_turns": CheckInfo(
        "rollout", None, "rollouts with no turn whose model call came back with an answer"
    ),
    "trajectory_capture_accounting": CheckInfo(
        "rollout",
        None,
        "rollouts whose model-call ownership does not add up (a call owned by no turn, by two, or by a turn "
        "it does not name) or whose HTTP attempts model_capture.jsonl does not account for",
    ),
    "model_call_zero_completion_not_length_cut": CheckInfo(
        "rollout",
        None,
        "answered model calls that reported 0 output tokens and were not cut at the length limit (NeMo Gym's "
        "acceptance text for H9) (count: calls)",
    ),
    "model_call_total_tokens_mismatch": CheckInfo(
        "rollout", None, "answered model calls whose total tokens are not input + output (count: calls)"
    ),
    "model_call_token_data_dropped": CheckInfo(
        "rollout",
        None,
        "answered model calls whose token ids or log probabilities were invalid or contradicted each other "
        "and were dropped, so the call's token data is partial or unobserved (count: calls)",
    ),
    "cancelled_by_run": CheckInfo(
        "rollout",
        None,
        "rollouts the run itself stopped (Ctrl-C, shutdown) before they finished; informational, not a "
        "model finding",
    ),
    "grader_error": CheckInfo(
        "rollout", None, "rollouts the outcome allowed to grade but whose grader failed (no reward)"
    ),
}
"""Every check by its stable name (NeMo Gym's where it has one); all appear in metrics.json."""

INFORMATIONAL_CHECKS = frozenset({"cancelled_by_run", "grader_error"})
"""Checks that say something about the run, not the rollout's health: they never set its verdict."""

TASK_CHECKS = frozenset(name for name, info in HEALTH_CHECKS.items() if info.scope == "task")
"""Checks counted per task, over its repeats (the others are per rollout)."""

HEALTH_ALIASES: dict[str, str] = {
    "no_model_turn": "rollout_missing_agent_turns",
    "hollow_turn": "agent_turn_hollow",
    "capture_mismatch": "trajectory_capture_mismatch",
    "failed_model_call": "model_call_failed",
    "unobserved_tokens": "model_call_missing_token_counts",
    "zero_completion_tokens": "model_call_zero_completion_tokens",
    "runaway_generation": "model_call_runaway_generation",
    "token_total_mismatch": "rollout_token_count_mismatch",
    "task_without_model_success": "task_no_successful_model_calls",
}
"""rollcage's earlier check names, and the NeMo Gym names that replaced them (dashboards keyed on them)."""

_LENGTH_REASONS = frozenset({"length", "max_output_tokens", "max_tokens"})
_INTERRUPTED = "interrupted"
_NO_RESULT = "no valid result.json"
_CONTENT_KEYS = ("text", "content", "output_text", "refusal", "encrypted_content", "summary", "arguments")
_TOOL_CALL_TYPES = frozenset({"function_call", "custom_tool_call", "mcp_call", "code_interpreter_call"})
_NEMO_CONTENT_KEYS = (
    "text",
    "content",
    "output_text",
    "answer",
    "refusal",
    "encrypted_content",
    "reasoning",
    "reasoning_content",
    "summary",
)
_NEMO_TOOL_CALL_TYPES = frozenset(
    {
        "function_call",
        "tool_call",
        "tool_use",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "file_search_call",
        "web_search_call",
        "computer_call",
        "image_generation_call",
        "code_interpreter_call",
        "local_shell_call",
        "custom_tool_call",
    }
)
_RUN_CHECKS = frozenset({"rollout_duplicate_identity"})
"""Rollout checks the ledger computes over the run's records, not one rollout's evidence."""


@dataclass(frozen=True, slots=True)
class _Evidence:
    """What one rollout offers the checks."""

    result: WorkerResult
    receipt: SupervisorReceipt | None
    answered: list[ModelCall]
    """Calls that came back with an answer (completed, or cut at the length limit)."""


_Check = Callable[[_Evidence], "int | str"]
"""A rollout check: the number of findings (0: none), or why it could not run."""


def assess(
    result: WorkerResult | None, receipt: SupervisorReceipt, *, grader_failed: bool
) -> tuple[RolloutHealth, RolloutMetrics]:
    """Health and metrics of one finished attempt, computed once from its parsed result and receipt.

    Args:
        result: The attempt's ``result.json`` as the supervisor validated it; ``None`` when
            there is no valid one.
        receipt: Its receipt.
        grader_failed: The outcome allowed grading and the grader failed.
    """
    return rollout_health(result, receipt, grader_failed=grader_failed), rollout_metrics(result, receipt)


def rollout_health(
    result: WorkerResult | None, receipt: SupervisorReceipt | None, *, grader_failed: bool = False
) -> RolloutHealth:
    """The health of one finished attempt (see the module's table).

    Args:
        result: Its parsed ``result.json``; ``None`` when there is no valid one.
        receipt: Its receipt; ``None`` for a bare result (the viewer), whose capture is then unobserved.
        grader_failed: The outcome allowed grading and the grader failed.
    """
    findings: dict[str, int] = {}
    unobserved: dict[str, str] = {}
    if receipt is not None and receipt.outcome == "cancelled":
        findings["cancelled_by_run"] = 1
    if grader_failed:
        findings["grader_error"] = 1
    evidence = _evidence(result, receipt)
    if evidence is None:
        unreadable = receipt is not None and receipt.result_present and not receipt.result_valid
        if unreadable:
            findings["record_unreadable"] = 1
        else:
            unobserved["record_unreadable"] = "no result.json"
        unobserved["check_execution_error"] = _NO_RESULT
        unobserved.update(dict.fromkeys(_ROLLOUT_CHECKS, _NO_RESULT))
    else:
        raised = 0
        for name, check in _ROLLOUT_CHECKS.items():
            try:
                found = check(evidence)
            except Exception as exc:  # NeMo Gym's rule: a check that raises is a finding, not a crash
                raised += 1
                found = f"the check raised {type(exc).__name__}"
            if isinstance(found, str):
                unobserved[name] = found
            elif found:
                findings[name] = found
        if raised:
            findings["check_execution_error"] = raised
    return RolloutHealth(
        verdict=_verdict(findings, unobserved),
        findings=findings,
        unobserved=unobserved,
        successful_model_calls=None if evidence is None else len(evidence.answered),
        unfailed_model_calls=None if evidence is None else _unfailed(evidence),
    )


def nemo_verdict(health: RolloutHealth) -> HealthVerdict:
    """The verdict NeMo Gym gives: over the checks under its names only (rollcage's own do not count)."""
    nemo = {name for name, info in HEALTH_CHECKS.items() if info.nemo is not None}
    return _verdict(
        {name: count for name, count in health.findings.items() if name in nemo},
        {name: why for name, why in health.unobserved.items() if name in nemo},
    )


def unobserved_health(reason: str) -> RolloutHealth:
    """The health of an attempt with no evidence at all (e.g. a task lost with its node): all unobserved."""
    names = [name for name in HEALTH_CHECKS if name not in TASK_CHECKS | INFORMATIONAL_CHECKS | _RUN_CHECKS]
    return RolloutHealth(verdict="unobserved", unobserved=dict.fromkeys(names, reason))


def _verdict(findings: Mapping[str, int], unobserved: Mapping[str, str]) -> HealthVerdict:
    if any(name not in INFORMATIONAL_CHECKS for name in findings):
        return "unhealthy"
    return "unobserved" if unobserved else "healthy"


def _evidence(result: WorkerResult | None, receipt: SupervisorReceipt | None) -> _Evidence | None:
    if result is None or (receipt is not None and not receipt.result_valid):
        return None
    answered = [c for c in result.trajectory.model_calls if _answered(c)]
    return _Evidence(result=result, receipt=receipt, answered=answered)


def _answered(call: ModelCall) -> bool:
    return call.status == "completed" or (
        call.status == "incomplete" and call.incomplete_reason != _INTERRUPTED
    )


def _length_limited(call: ModelCall) -> bool:
    return call.status == "incomplete" and call.incomplete_reason in _LENGTH_REASONS


# ----------------------------------------------------------------------------- the rollout checks
#
# The checks under NeMo Gym's names follow ``nemo_gym/health/checks.py`` and
# ``nemo_gym/rollout_health.py`` (0.7.0) rule for rule, read on rollcage's own
# trajectory the way NeMo Gym reads the ``ng_trajectory`` that ``export --format
# nemo-gym`` writes of it: every call is owned (by the invocation), a turn's
# message is its answer items or its reasoning summary, a call's finish reason is
# ``length`` when it was cut at the length limit. tests/controller/test_health_nemo.py
# runs NeMo Gym's own code on exported rows and asserts the same counts.


def _missing_agent_turns(evidence: _Evidence) -> int | str:
    # NeMo Gym's rule: a turn with a message, a tool call or a model call reference is model activity.
    turns = evidence.result.trajectory.turns
    return 0 if any(_nemo_message(t) or _nemo_tool_calls(t.answer) or t.model_calls for t in turns) else 1


def _missing_answered_turns(evidence: _Evidence) -> int | str:
    # rollcage's stricter rule: a turn whose every call failed is no agent turn.
    if any(_has_content(call.output) for call in evidence.answered):
        return 0
    if evidence.receipt is not None and evidence.receipt.outcome == "cancelled":
        return "the run stopped the rollout before an agent turn was answered"
    return 1


def _hollow_turns(evidence: _Evidence) -> int | str:
    turns = evidence.result.trajectory.turns
    return sum(1 for turn in turns if not _nemo_message(turn) and not _nemo_tool_calls(turn.answer))


def _nemo_message(turn: Turn) -> bool:
    reasoning = "".join(
        str(part.get("text", ""))
        for item in turn.reasoning
        for part in item.get("summary") or []
        if isinstance(part, dict)
    )
    return _nemo_nonempty(turn.answer) or bool(reasoning.strip())


def _nemo_tool_calls(items: Any) -> bool:
    if isinstance(items, (list, tuple)):
        return any(_nemo_tool_calls(item) for item in items)
    if not isinstance(items, dict):
        return False
    return items.get("type") in _NEMO_TOOL_CALL_TYPES or bool(items.get("tool_calls"))


def _nemo_nonempty(value: Any) -> bool:
    """NeMo Gym's ``_nonempty``: non-blank text under one of its content keys, at any depth."""
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, tuple)):
        return any(_nemo_nonempty(item) for item in value)
    if isinstance(value, dict):
        return any(_nemo_nonempty(value.get(key)) for key in _NEMO_CONTENT_KEYS)
    return False


def _owned(evidence: _Evidence) -> list[ModelCall] | str:
    """The calls NeMo Gym binds (an id held by exactly one call), or why none can be."""
    calls = evidence.result.trajectory.model_calls
    counts = Counter(call.id for call in calls)
    owned = [call for call in calls if counts[call.id] == 1]
    return owned if owned else "no model call was made"


def _capture_mismatch(evidence: _Evidence) -> int | str:
    # NeMo Gym's rule: references that resolve to no call, or to several (each id counted once).
    trajectory = evidence.result.trajectory
    if not trajectory.model_calls and not any(t.model_calls for t in trajectory.turns):
        return "no model call was made"
    counts = Counter(call.id for call in trajectory.model_calls)
    referenced = {ref for turn in trajectory.turns for ref in turn.model_calls} | set(counts)
    return sum(1 for ref in referenced if counts[ref] != 1)


def _capture_accounting(evidence: _Evidence) -> int | str:
    # rollcage's stricter rule: every call owned by exactly the turn it names, and the egress
    # capture accounting for every HTTP attempt.
    trajectory = evidence.result.trajectory
    if _ownership_contradictions(
        trajectory.model_calls, [(t.index, t.model_calls) for t in trajectory.turns]
    ):
        return 1
    if evidence.receipt is None:
        return "no receipt.json"
    captured = evidence.receipt.model_calls_captured
    if captured is None:
        return "no egress capture (the rollout ran without the proxy)"
    # Calls a resumed rollout replayed from the earlier attempt's journal crossed that attempt's proxy.
    replayed = _replayed(trajectory)
    attempts = [
        attempt for call in trajectory.model_calls if call.id not in replayed for attempt in call.attempts
    ]
    # An attempt that got an HTTP status certainly crossed the proxy; one that failed without an
    # answer (or was cut off by the stop) may have ended before it reached the proxy.
    answered = sum(1 for attempt in attempts if attempt.http_status is not None)
    return 0 if answered <= captured <= len(attempts) else 1


def _ownership_contradictions(calls: list[ModelCall], turns: list[tuple[int, list[str]]]) -> bool:
    """Whether the turns' model-call references do not resolve exactly once, each to its own call."""
    by_id: dict[str, ModelCall] = {}
    for call in calls:
        if call.id in by_id:
            return True  # two calls with one id: a reference to it would be ambiguous
        by_id[call.id] = call
    owned: set[str] = set()
    for index, references in turns:
        for reference in references:
            owner = by_id.get(reference)
            if owner is None or reference in owned or owner.turn != index:
                return True
            owned.add(reference)
    return owned != set(by_id)


def _failed(call: ModelCall) -> bool:
    """NeMo Gym's ``_is_failed``: an HTTP error status, an error, or a failed response."""
    return (
        (call.http_status is not None and call.http_status >= 400)
        or call.error is not None
        or (call.status == "failed")
    )


def _failed_calls(evidence: _Evidence) -> int | str:
    calls = _owned(evidence)
    return calls if isinstance(calls, str) else sum(1 for call in calls if _failed(call))


def _unfailed(evidence: _Evidence) -> int:
    """NeMo Gym's ``_is_successful`` count: not failed, and no HTTP status or a 2xx/3xx one."""
    calls = _owned(evidence)
    if isinstance(calls, str):
        return 0
    return sum(1 for c in calls if not _failed(c) and (c.http_status is None or 200 <= c.http_status < 400))


def _ended_on_failed_call(evidence: _Evidence) -> int | str:
    # A rollout's calls all go to its one policy model: one chain, ordered by start time.
    calls = evidence.result.trajectory.model_calls
    if not calls:
        return "no model call was made"
    last = max(calls, key=lambda call: (call.started_at, call.index))
    return int(_failed(last))


def _missing_token_counts(evidence: _Evidence) -> int | str:
    calls = _owned(evidence)
    if isinstance(calls, str):
        return calls
    return sum(1 for c in calls if c.usage.input_tokens is None or c.usage.output_tokens is None)


def _zero_completion_tokens(evidence: _Evidence) -> int | str:
    calls = _owned(evidence)
    return calls if isinstance(calls, str) else sum(1 for c in calls if c.usage.output_tokens == 0)


def _zero_completion_not_length_cut(evidence: _Evidence) -> int | str:
    # NeMo Gym's acceptance text: a call cut at the length limit is the runaway check's business.
    if not evidence.answered:
        return "no answered model call"
    return sum(1 for c in evidence.answered if c.usage.output_tokens == 0 and not _length_limited(c))


def _runaway_generation(evidence: _Evidence) -> int | str:
    calls = _owned(evidence)
    if isinstance(calls, str):
        return calls
    cut = [call for call in calls if _length_limited(call)]
    if any(call.response is None for call in cut):
        return "a call cut at the length limit kept no response"
    return sum(1 for call in cut if not _response_has_content(call.response))


def _response_has_content(response: Any) -> bool:
    """NeMo Gym's rule: text in the raw response (a tool call alone is no content)."""
    if not isinstance(response, dict):
        return False
    if _nemo_nonempty(response.get("output_text")) or _nemo_nonempty(response.get("content")):
        return True
    choices = response.get("choices")
    chat = any(
        _nemo_nonempty(choice.get("text")) or _nemo_nonempty((choice.get("message") or {}).get("content"))
        for choice in (choices if isinstance(choices, list) else [])
        if isinstance(choice, dict)
    )
    return _nemo_nonempty(response.get("output")) or chat


def _token_count_mismatch(evidence: _Evidence) -> int | str:
    calls = _owned(evidence)
    if isinstance(calls, str):
        return calls
    if any(c.usage.input_tokens is None or c.usage.output_tokens is None for c in calls):
        # A call that failed, or was cut off by a cancel or a timeout, reported no counts: the
        # rollout's accounting cannot be checked, which is not the same as it adding up.
        return "a model call reported no token counts (failed, or cut off by a cancel or timeout)"
    response = evidence.result.response
    if response is None or response.usage.input_tokens is None or response.usage.output_tokens is None:
        return "the result reports no token totals"
    summed = (sum(c.usage.input_tokens or 0 for c in calls), sum(c.usage.output_tokens or 0 for c in calls))
    return 0 if summed == (response.usage.input_tokens, response.usage.output_tokens) else 1


def _call_total_mismatch(evidence: _Evidence) -> int | str:
    if not evidence.answered:
        return "no answered model call"
    return sum(
        1
        for c in evidence.answered
        if c.usage.total_tokens is not None
        and c.usage.input_tokens is not None
        and c.usage.output_tokens is not None
        and c.usage.total_tokens != c.usage.input_tokens + c.usage.output_tokens
    )


def _token_data_dropped(evidence: _Evidence) -> int | str:
    if not evidence.answered:
        return "no answered model call"
    return sum(1 for c in evidence.answered if c.tokens.note is not None)


_ROLLOUT_CHECKS: dict[str, _Check] = {
    "rollout_missing_agent_turns": _missing_agent_turns,
    "rollout_missing_answered_turns": _missing_answered_turns,
    "rollout_ended_on_failed_model_call": _ended_on_failed_call,
    "agent_turn_hollow": _hollow_turns,
    "trajectory_capture_mismatch": _capture_mismatch,
    "trajectory_capture_accounting": _capture_accounting,
    "model_call_failed": _failed_calls,
    "model_call_missing_token_counts": _missing_token_counts,
    "model_call_zero_completion_tokens": _zero_completion_tokens,
    "model_call_zero_completion_not_length_cut": _zero_completion_not_length_cut,
    "model_call_runaway_generation": _runaway_generation,
    "rollout_token_count_mismatch": _token_count_mismatch,
    "model_call_total_tokens_mismatch": _call_total_mismatch,
    "model_call_token_data_dropped": _token_data_dropped,
}


def _has_content(items: list[ResponseItem]) -> bool:
    """Whether the items hold anything: non-blank text, reasoning, or a tool call."""
    return any(item.get("type") in _TOOL_CALL_TYPES or _nonempty(item) for item in items)


def _nonempty(value: Any) -> bool:
    stack = [value]
    while stack:
        current = stack.pop()
        if isinstance(current, str):
            if current.strip():
                return True
        elif isinstance(current, list):
            stack.extend(current)
        elif isinstance(current, dict):
            stack.extend(current.get(key) for key in _CONTENT_KEYS)
    return False


# ----------------------------------------------------------------------------- metrics


def rollout_metrics(result: WorkerResult | None, receipt: SupervisorReceipt) -> RolloutMetrics:
    """Token and timing metrics of one finished attempt; sums say whether they cover every call."""
    if result is None or not receipt.result_valid:
        return RolloutMetrics(duration_s=receipt.duration_s)
    # A resumed rollout's replayed calls were made (and counted) by the earlier attempt: counting
    # them again would double the run's tokens.
    replayed = _replayed(result.trajectory)
    resumed = result.trajectory.resumed_from
    answered_from_journal = frozenset(resumed.replayed_tool_calls) if resumed is not None else frozenset()
    calls = [c for c in result.trajectory.model_calls if c.id not in replayed]
    answered = [c for c in calls if _answered(c)]
    interrupted = any(c.incomplete_reason == _INTERRUPTED for c in calls)
    return RolloutMetrics(
        replayed_model_calls=len(replayed),
        model_calls=len(calls),
        failed_model_calls=sum(1 for c in calls if c.status == "failed"),
        tool_calls=sum(1 for t in result.trajectory.tool_calls if t.call_id not in answered_from_journal),
        input_tokens=_sum([c.usage.input_tokens for c in answered]),
        output_tokens=_sum([c.usage.output_tokens for c in answered]),
        total_tokens=_sum([c.usage.total_tokens for c in answered]),
        token_counts=_coverage(
            [c.usage.input_tokens is not None and c.usage.output_tokens is not None for c in answered],
            incomplete=interrupted,
        ),
        token_ids=_coverage([_complete(c.tokens) for c in answered], incomplete=False),
        duration_s=receipt.duration_s,
    )


def _replayed(trajectory: Trajectory) -> frozenset[str]:
    """Ids of the model calls a resumed rollout answered from an earlier attempt's journal."""
    resumed = trajectory.resumed_from
    return frozenset(resumed.replayed_model_calls) if resumed is not None else frozenset()


def _complete(tokens: CallTokens) -> bool:
    return tokens.status == "observed" and tokens.scope == "generation"


def _coverage(reported: list[bool], *, incomplete: bool) -> TokenCoverage:
    if not any(reported):
        return "unobserved"
    return "complete" if all(reported) and not incomplete else "partial"


def _sum(values: list[int | None]) -> int | None:
    """The sum of the reported values; ``None`` when none was reported (``token_counts`` says how many)."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None
