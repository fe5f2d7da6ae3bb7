"""One reading of a rollout, shared by the terminal view and the HTML report.

``digest_rollout`` turns the artifacts of a ``RolloutView`` into turns (a model
call with what it produced and the tool calls it requested), the outcome, the
receipt, the capture comparison and health findings. Both views present this
same digest, so they cannot disagree about what a rollout did. All text in a
digest is cleaned of control characters and clipped; the digest is plain data
(dataclasses of str/int/float/list), so the report embeds it as JSON as is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from rollcage.controller import HEALTH_CHECKS, rollout_health
from rollcage.protocol import ModelCall, RunnerError, SupervisorReceipt, ToolCall, Trajectory
from rollcage.viewer._capture import CaptureComparison
from rollcage.viewer._load import RolloutView
from rollcage.viewer._text import clean_text, clip, pretty_arguments

__all__ = [
    "ErrorDigest",
    "FindingDigest",
    "ItemDigest",
    "ReceiptDigest",
    "RolloutDigest",
    "ToolDigest",
    "TurnDigest",
    "digest_rollout",
]

_Clean = Callable[[str], str]

DEFAULT_TEXT_LIMIT = 20_000
"""Characters kept of one text (message, reasoning, arguments, tool output) in a digest."""


@dataclass(frozen=True, slots=True)
class ErrorDigest:
    """A ``RunnerError``, cleaned."""

    kind: str
    """transient, fatal or cancelled."""
    type: str
    """The exception class name."""
    message: str
    """What happened."""


@dataclass(frozen=True, slots=True)
class ItemDigest:
    """One piece of a model call's output other than a tool call."""

    kind: Literal["text", "reasoning", "refusal", "other"]
    """``text``: assistant text; ``reasoning``: reasoning summary or text (shown folded)."""
    text: str
    """The content, cleaned and clipped."""


@dataclass(frozen=True, slots=True)
class ToolDigest:
    """One tool call (or codeact cell): what the model asked for and what came back."""

    call_id: str
    """The model's call id."""
    name: str
    """Tool name."""
    arguments: str
    """Arguments, pretty-printed when they are JSON, else exactly as written (code)."""
    arguments_kind: Literal["json", "code"]
    """How to show ``arguments``."""
    status: str
    """pending, completed, failed, cancelled, incomplete; ``not run`` when requested but never started."""
    duration_s: float | None
    """Wall time of the call; ``None`` while pending or never run."""
    offset_s: float | None
    """Start, in seconds after the rollout's first model call."""
    output: str | None
    """The text shown to the model, cleaned and clipped; ``None`` while pending."""


@dataclass(frozen=True, slots=True)
class TurnDigest:
    """One model call and the tool calls it requested."""

    index: int
    """The model call's index."""
    api: str
    """chat or responses."""
    status: str
    """completed, incomplete or failed."""
    incomplete_reason: str | None
    """Why the output is incomplete (e.g. length)."""
    input_tokens: int | None
    """Prompt tokens, ``None`` if unreported."""
    output_tokens: int | None
    """Generated tokens, ``None`` if unreported."""
    reasoning_tokens: int | None
    """Reasoning tokens, ``None`` if unreported."""
    latency_s: float
    """ended_at - started_at."""
    ttfb_s: float | None
    """Time to the first response byte."""
    offset_s: float
    """Start, in seconds after the rollout's first model call."""
    attempts: int
    """HTTP attempts (1 + retries)."""
    token_data: str
    """Token ids and logprobs the server returned: observed, partial or unobserved."""
    http_status: int | None
    """HTTP status of the last attempt."""
    error: ErrorDigest | None
    """Why the call failed."""
    items: list[ItemDigest]
    """Text and reasoning, in output order."""
    tools: list[ToolDigest]
    """Tool calls requested in this turn, in request order."""


@dataclass(frozen=True, slots=True)
class ReceiptDigest:
    """The supervisor's receipt, as the views show it."""

    outcome: str
    """The outcome class."""
    outcome_reason: str
    """Why."""
    sandbox: str
    """bwrap or none."""
    exit: str
    """``exit 0``, ``signal SIGKILL`` or ``unknown``."""
    duration_s: float
    """Supervised wall time."""
    deadline_s: float
    """The deadline."""
    deadline_fired: bool
    """The deadline passed."""
    stop_requested: bool
    """An external stop arrived."""
    signals: list[str]
    """Signals sent, e.g. ``SIGTERM → group (deadline) at +30.00 s``."""
    cleanup_confirmed: bool
    """No descendant survived."""
    descendants_killed: int
    """Stray descendants killed."""
    temp_files_swept: int
    """Leftover temporary files removed."""
    last_checkpoint_seq: int | None
    """Last intact journal seq."""
    result_present: bool
    """result.json existed."""
    result_valid: bool
    """result.json was a valid WorkerResult."""
    model_calls_captured: int | None
    """Exchanges the egress proxy captured."""


@dataclass(frozen=True, slots=True)
class FindingDigest:
    """A health finding about this rollout."""

    name: str
    """Stable check name."""
    detail: str
    """What was found."""


@dataclass(slots=True)
class RolloutDigest:
    """Everything the views show about one rollout."""

    rollout_id: str
    """Id of the attempt."""
    task_id: str
    """Id of the task ('' if unknown)."""
    source: Literal["result", "checkpoint", "none"]
    """Where the trajectory came from."""
    partial: bool
    """Shown from a checkpoint: evidence only, never graded."""
    outcome: str | None
    """From the receipt (or the run record); ``None`` if neither exists."""
    outcome_reason: str | None
    """Why that outcome."""
    graded: bool | None
    """From the run record; ``None`` outside a run."""
    reward: float | None
    """From the run record; ``None`` when not graded or outside a run."""
    grader: str | None
    """The grader's detail, as compact JSON."""
    termination: str | None
    """The agent loop's termination reason."""
    error: ErrorDigest | None
    """The result's error."""
    instructions: str | None
    """System instructions from input.json."""
    task_input: str | None
    """The model-visible input, as text."""
    turns: list[TurnDigest]
    """Model calls in order."""
    orphan_tools: list[ToolDigest]
    """Tool calls whose turn is not among the model calls (should not happen; shown if it does)."""
    answer: str | None
    """The final output text."""
    started_at: float | None
    """Unix time the worker (or the first model call) started."""
    duration_s: float | None
    """Supervised (or worker) wall time."""
    input_tokens: int | None
    """Summed prompt tokens over calls that reported them; ``None`` if none did."""
    output_tokens: int | None
    """Summed generated tokens, likewise."""
    checkpoint_seq: int | None
    """Last journal seq, for a partial view."""
    receipt: ReceiptDigest | None
    """The supervisor's receipt."""
    capture: CaptureComparison | None
    """model_capture.jsonl against the trajectory."""
    findings: list[FindingDigest] = field(default_factory=list)
    """Health findings: local checks plus the run's checks that name this rollout."""
    problems: list[str] = field(default_factory=list)
    """Artifacts that failed to read."""
    log_tail: str | None = None
    """The end of worker.log."""
    workspace_diff: str | None = None
    """The start of workspace.diff: what the rollout changed."""


def digest_rollout(view: RolloutView, *, text_limit: int = DEFAULT_TEXT_LIMIT) -> RolloutDigest:
    """Build the shared reading of one rollout."""

    def text(value: str) -> str:
        return clip(clean_text(value), text_limit)

    result, checkpoint, record = view.result, view.checkpoint, view.record
    trajectory = result.trajectory if result else checkpoint.trajectory if checkpoint else Trajectory()
    origin = _origin(trajectory, result.started_at if result else None)
    turns, orphans = _turns(trajectory, origin, text)
    receipt = view.receipt
    answer: str | None = None
    if result is not None and result.response is not None and result.response.output_text:
        answer = text(result.response.output_text)

    outcome = receipt.outcome if receipt else record.outcome if record else None
    outcome_reason = receipt.outcome_reason if receipt else None
    duration: float | None = None
    if receipt is not None:
        duration = receipt.duration_s
    elif result is not None:
        duration = max(0.0, result.ended_at - result.started_at)

    digest = RolloutDigest(
        rollout_id=clean_text(view.rollout_id),
        task_id=clean_text(view.task_id or ""),
        source="result" if result else "checkpoint" if checkpoint else "none",
        partial=view.partial,
        outcome=outcome,
        outcome_reason=clean_text(outcome_reason) if outcome_reason else None,
        graded=record.graded if record else None,
        reward=record.reward if record else None,
        grader=text(_compact_json(record.grader)) if record and record.grader is not None else None,
        termination=result.termination_reason if result else record.termination_reason if record else None,
        error=_error(result.error) if result else None,
        instructions=text(view.instructions) if view.instructions else None,
        task_input=text(_input_text(view.task_input)) if view.task_input is not None else None,
        turns=turns,
        orphan_tools=orphans,
        answer=answer,
        started_at=result.started_at if result else origin,
        duration_s=duration,
        input_tokens=_sum(call.usage.input_tokens for call in trajectory.model_calls),
        output_tokens=_sum(call.usage.output_tokens for call in trajectory.model_calls),
        checkpoint_seq=checkpoint.seq if checkpoint else None,
        receipt=_receipt(receipt) if receipt else None,
        capture=view.capture,
        problems=[clean_text(problem) for problem in view.problems],
        log_tail=clean_text(view.log_tail) if view.log_tail is not None else None,
        workspace_diff=clean_text(view.workspace_diff) if view.workspace_diff is not None else None,
    )
    digest.findings = _findings(view, trajectory)
    return digest


def _origin(trajectory: Trajectory, started_at: float | None) -> float | None:
    if started_at is not None:
        return started_at
    if trajectory.model_calls:
        return trajectory.model_calls[0].started_at
    return None


def _sum(values: Iterable[int | None]) -> int | None:
    present = [value for value in values if value is not None]
    return sum(present) if present else None


def _error(error: RunnerError | None) -> ErrorDigest | None:
    if error is None:
        return None
    return ErrorDigest(kind=error.kind, type=clean_text(error.type), message=clean_text(error.message))


def _compact_json(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return repr(value)


def _input_text(task_input: str | list[Any]) -> str:
    if isinstance(task_input, str):
        return task_input
    parts: list[str] = []
    for item in task_input:
        if isinstance(item, dict):
            role = item.get("role")
            body = _content_text(item.get("content"))
            parts.append(f"{role}: {body}" if isinstance(role, str) else body or _compact_json(item))
        else:
            parts.append(_compact_json(item))
    return "\n".join(parts)


def _content_text(content: Any) -> str:
    """Text of a Responses/Chat message content: a string or a list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for part in content:
            if isinstance(part, dict):
                value = part.get("text", part.get("refusal"))
                texts.append(value if isinstance(value, str) else _compact_json(part))
            elif isinstance(part, str):
                texts.append(part)
        return "\n".join(texts)
    return "" if content is None else _compact_json(content)


def _reasoning_text(item: dict[str, Any]) -> str:
    texts: list[str] = []
    for key in ("summary", "content"):
        parts = item.get(key)
        if isinstance(parts, list):
            texts.extend(
                part["text"] for part in parts if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    if texts:
        return "\n".join(texts)
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str):
        return f"(encrypted reasoning, {len(encrypted):,} characters)"
    return "(reasoning with no readable text)"


def _turns(
    trajectory: Trajectory, origin: float | None, text: _Clean
) -> tuple[list[TurnDigest], list[ToolDigest]]:
    by_turn: dict[int, list[ToolCall]] = {}
    for tool in trajectory.tool_calls:
        by_turn.setdefault(tool.turn, []).append(tool)
    turns: list[TurnDigest] = []
    seen_turns: set[int] = set()
    for call in trajectory.model_calls:
        seen_turns.add(call.index)
        turns.append(_turn(call, by_turn.get(call.index, []), origin, text))
    orphans = [
        _tool(tool, origin, text)
        for turn, tools in by_turn.items()
        if turn not in seen_turns
        for tool in tools
    ]
    return turns, orphans


def _turn(call: ModelCall, tools: list[ToolCall], origin: float | None, text: _Clean) -> TurnDigest:
    items: list[ItemDigest] = []
    requested: list[ToolDigest] = []
    executed = {tool.call_id: tool for tool in tools}
    placed: set[str] = set()
    for item in call.output:
        kind = item.get("type")
        if kind == "message":
            body = _content_text(item.get("content"))
            if body:
                items.append(ItemDigest(kind="text", text=text(body)))
        elif kind == "reasoning":
            items.append(ItemDigest(kind="reasoning", text=text(_reasoning_text(item))))
        elif kind == "refusal":
            items.append(ItemDigest(kind="refusal", text=text(str(item.get("refusal", "")))))
        elif kind == "function_call":
            call_id = str(item.get("call_id", item.get("id", "")))
            if call_id in executed and call_id not in placed:
                placed.add(call_id)
                requested.append(_tool(executed[call_id], origin, text))
            else:
                # Asked for but never started (e.g. the tool-call budget ran out).
                arguments, is_json = pretty_arguments(str(item.get("arguments", "")))
                requested.append(
                    ToolDigest(
                        call_id=clean_text(call_id),
                        name=clean_text(str(item.get("name", "?"))),
                        arguments=text(arguments),
                        arguments_kind="json" if is_json else "code",
                        status="not run",
                        duration_s=None,
                        offset_s=None,
                        output=None,
                    )
                )
        elif kind != "function_call_output":
            items.append(ItemDigest(kind="other", text=text(_compact_json(item))))
    # Code cells (codeact) have no function_call item: they follow the text they came from.
    requested.extend(_tool(tool, origin, text) for tool in tools if tool.call_id not in placed)
    return TurnDigest(
        index=call.index,
        api=call.api,
        status=call.status,
        incomplete_reason=call.incomplete_reason,
        input_tokens=call.usage.input_tokens,
        output_tokens=call.usage.output_tokens,
        reasoning_tokens=call.usage.reasoning_tokens,
        latency_s=max(0.0, call.ended_at - call.started_at),
        ttfb_s=None if call.first_byte_at is None else max(0.0, call.first_byte_at - call.started_at),
        offset_s=0.0 if origin is None else call.started_at - origin,
        attempts=len(call.attempts),
        token_data=call.tokens.status,
        http_status=call.http_status,
        error=_error(call.error),
        items=items,
        tools=requested,
    )


def _tool(tool: ToolCall, origin: float | None, text: _Clean) -> ToolDigest:
    arguments, is_json = pretty_arguments(tool.arguments)
    duration = tool.duration_s
    if duration is None and tool.ended_at is not None:
        duration = max(0.0, tool.ended_at - tool.started_at)
    return ToolDigest(
        call_id=clean_text(tool.call_id),
        name=clean_text(tool.name),
        arguments=text(arguments),
        arguments_kind="json" if is_json else "code",
        status=tool.status,
        duration_s=duration,
        offset_s=None if origin is None else tool.started_at - origin,
        output=None if tool.output is None else text(tool.output),
    )


def _receipt(receipt: SupervisorReceipt) -> ReceiptDigest:
    if receipt.exit_signal is not None:
        exit_text = f"signal {receipt.exit_signal}"
    elif receipt.exit_code is not None:
        exit_text = f"exit {receipt.exit_code}"
    else:
        exit_text = "unknown"
    signals = [
        f"{event.signal} → {event.target} ({event.reason}) at +{event.at - receipt.started_at:.2f} s"
        for event in receipt.signals_sent
    ]
    return ReceiptDigest(
        outcome=receipt.outcome,
        outcome_reason=clean_text(receipt.outcome_reason),
        sandbox=receipt.sandbox,
        exit=exit_text,
        duration_s=receipt.duration_s,
        deadline_s=receipt.deadline_s,
        deadline_fired=receipt.deadline_fired,
        stop_requested=receipt.stop_requested,
        signals=signals,
        cleanup_confirmed=receipt.cleanup_confirmed,
        descendants_killed=receipt.descendants_killed,
        temp_files_swept=receipt.temp_files_swept,
        last_checkpoint_seq=receipt.last_checkpoint_seq,
        result_present=receipt.result_present,
        result_valid=receipt.result_valid,
        model_calls_captured=receipt.model_calls_captured,
    )


def _findings(view: RolloutView, trajectory: Trajectory) -> list[FindingDigest]:
    """The rollout's health (its record's, else computed by the same checks), then what only a viewer sees.

    Names are the controller's stable health-check names (``rollcage.controller``'s
    ``HEALTH_CHECKS``), so the two merge. Checks that could not run are grouped by
    the evidence they lacked.
    """
    health = view.record.health if view.record is not None else rollout_health(view.result, view.receipt)
    found: dict[str, str] = {
        name: f"{count} — {HEALTH_CHECKS[name].detail}" if name in HEALTH_CHECKS else str(count)
        for name, count in health.findings.items()
    }
    lacking: dict[str, list[str]] = {}
    for name, reason in health.unobserved.items():
        lacking.setdefault(reason, []).append(name)
    for reason, names in lacking.items():
        found[f"unobserved ({reason})"] = ", ".join(names)
    if view.result is not None:
        unfinished = [
            tool.call_id for tool in trajectory.tool_calls if tool.status in ("incomplete", "pending")
        ]
        if unfinished:
            found["incomplete_tool_calls"] = f"{len(unfinished)} tool call(s) never completed"
        if view.result.checkpoint_failures:
            found["checkpoint_write_failures"] = (
                f"{view.result.checkpoint_failures} boundary record(s) failed to persist"
            )
    if view.capture is not None and not view.capture.agrees:
        found["trajectory_capture_accounting"] = (
            f"{len(view.capture.differences)} difference(s) between model_capture.jsonl "
            f"({view.capture.captured} exchanges) and the trajectory "
            f"({view.capture.trajectory_attempts} attempts)"
        )
    if view.receipt is not None and not view.receipt.cleanup_confirmed:
        found["cleanup_not_confirmed"] = "the supervisor could not confirm that no descendant survived"
    for name, finding in view.run_findings.items():
        found.setdefault(name, finding.detail or "named by the run's health checks")
    return [FindingDigest(name=name, detail=clean_text(detail)) for name, detail in found.items()]
