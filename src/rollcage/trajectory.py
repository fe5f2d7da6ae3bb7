"""Recording turns, model calls and tool calls, and projecting them to Responses-API items.

A ``TrajectoryRecorder`` is the single mutable record of a rollout while it runs;
``Trajectory`` (protocol) is its published, immutable form. Turns are built, not
journaled: a turn's start (its question and the id of the model call it makes)
is recorded when it starts, and the rest (answer, reasoning, tool calls, tool
steps, resolution) follows from its model call and the tool calls it owns, so
a checkpoint and a result can never disagree about them. Two projections turn the
trajectory into the Responses-style ``output`` list:

* *partial* (checkpoints): a tool call whose output is still pending is left out
  together with its ``function_call``, so the view never shows a call without
  its answer and never claims an answer that does not exist yet;
* *final* (results): every call keeps its ``function_call`` and gets exactly one
  ``function_call_output``; a call that never completed gets one with status
  ``incomplete``, so the transcript is well formed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

from rollcage.protocol import (
    ModelCall,
    ResponseItem,
    ResumedFrom,
    TokenUsage,
    ToolCall,
    ToolStatus,
    Trajectory,
    Turn,
    TurnResolution,
    TurnStart,
)

__all__ = [
    "INTERRUPTED",
    "ProjectedCall",
    "TrajectoryRecorder",
    "arguments_json",
    "build_turns",
    "final_text",
    "leads_call",
    "message_text",
    "project_calls",
    "project_output",
    "sum_usage",
]

_DONE: frozenset[ToolStatus] = frozenset({"completed", "failed"})


class TrajectoryRecorder:
    """The mutable record of one rollout: model calls and tool calls in order.

    Not thread-safe; it lives on the worker's event loop.
    """

    def __init__(self) -> None:
        """Start empty."""
        self._turns: list[TurnStart] = []
        self._model_calls: list[ModelCall] = []
        self._tool_calls: dict[str, ToolCall] = {}
        self.resumed_from: ResumedFrom | None = None
        """Set once a resumed rollout has left its earlier attempt's journal."""
        self.resume_refused: str | None = None
        """Why a resume that was asked for started fresh instead."""

    @property
    def model_calls(self) -> list[ModelCall]:
        """Model calls so far (do not mutate)."""
        return self._model_calls

    def start_turn(self, start: TurnStart) -> None:
        """Record that a turn started: its question, and the id of the model call it is about to make."""
        self._turns.append(start)

    def add_model_call(self, call: ModelCall) -> None:
        """Record a finished (completed, incomplete, failed or interrupted) model call."""
        self._model_calls.append(call)

    def start_tool_call(
        self, call_id: str, name: str, arguments: str, turn: int, *, server_call_id: str | None = None
    ) -> ToolCall:
        """Record a requested tool call as pending and return it.

        Raises:
            ValueError: ``call_id`` is taken (ids are the agent's own: a bug, never the model's doing).
        """
        if call_id in self._tool_calls:
            raise ValueError(f"duplicate tool call id {call_id!r}")
        call = ToolCall(
            call_id=call_id,
            server_call_id=server_call_id,
            name=name,
            arguments=arguments,
            turn=turn,
            status="pending",
            started_at=time.time(),
        )
        self._tool_calls[call_id] = call
        return call

    def mark_started(self, call_id: str) -> None:
        """Reset a pending call's start time to when it actually began running (it may have queued)."""
        call = self._tool_calls[call_id]
        self._tool_calls[call_id] = call.model_copy(update={"started_at": time.time()})

    def finish_tool_call(self, call_id: str, status: ToolStatus, output: str) -> ToolCall:
        """Record how a tool call ended and return the finished record."""
        call = self._tool_calls[call_id]
        ended = time.time()
        done = call.model_copy(
            update={
                "status": status,
                "output": output,
                "ended_at": ended,
                "duration_s": max(0.0, ended - call.started_at),
            }
        )
        self._tool_calls[call_id] = done
        return done

    def apply(self, call: ToolCall) -> None:
        """Insert or replace a tool call record as is (used when folding a journal)."""
        self._tool_calls[call.call_id] = call

    def get(self, call_id: str) -> ToolCall:
        """The current record of one tool call."""
        return self._tool_calls[call_id]

    def pending(self) -> list[ToolCall]:
        """Tool calls that have not ended."""
        return [c for c in self._tool_calls.values() if c.status == "pending"]

    def stop_pending(self, status: ToolStatus, output: str) -> list[ToolCall]:
        """End every pending call with ``status`` (cancellation, or a loop that stopped early)."""
        return [self.finish_tool_call(c.call_id, status, output) for c in self.pending()]

    def snapshot(self, *, final: bool = False) -> Trajectory:
        """The trajectory as an immutable protocol value.

        Args:
            final: For a result: a turn whose model call never came back (none
                recorded, not even an interrupted one) is ``interrupted``, not ``pending``.
        """
        tools = list(self._tool_calls.values())
        return Trajectory(
            model_calls=list(self._model_calls),
            tool_calls=tools,
            turns=build_turns(self._turns, self._model_calls, tools, final=final),
            resumed_from=self.resumed_from,
            resume_refused=self.resume_refused,
        )


def build_turns(
    starts: Iterable[TurnStart], calls: Iterable[ModelCall], tools: Iterable[ToolCall], *, final: bool
) -> list[Turn]:
    """The turn records: each start, with what its model calls and tool calls say about it."""
    calls_of: dict[int, list[ModelCall]] = {}
    for call in calls:
        calls_of.setdefault(call.turn, []).append(call)
    tools_of: dict[int, list[ToolCall]] = {}
    for tool in tools:
        tools_of.setdefault(tool.turn, []).append(tool)
    turns: list[Turn] = []
    steps = 0
    for start in starts:
        owned = calls_of.get(start.index, [])
        owned_tools = tools_of.get(start.index, [])
        tool_ids = [tool.call_id for tool in owned_tools]
        steps += len(tool_ids)
        # What a harness ran on its own before the model call (``lead``) is not the model acting.
        acted = any(not leads_call(tool, owned[0] if owned else None) for tool in owned_tools)
        output = owned[-1].output if owned else []
        turns.append(
            Turn(
                index=start.index,
                id=start.id,
                started_at=start.started_at,
                ended_at=owned[-1].ended_at if owned else None,
                input=start.input,
                model_calls=[call.id for call in owned],
                answer=[item for item in output if item.get("type") != "reasoning"],
                reasoning=[item for item in output if item.get("type") == "reasoning"],
                tool_calls=tool_ids,
                tool_steps=steps,
                resolution=_resolution(owned[-1] if owned else None, acted, final=final),
            )
        )
    return turns


def leads_call(tool: ToolCall, call: ModelCall | None) -> bool:
    """Whether a harness ran ``tool`` on its own before ``call`` (NOOA's prefill; a projected lead)."""
    return tool.origin == "harness" and call is not None and tool.started_at < call.started_at


def _resolution(call: ModelCall | None, acted: bool, *, final: bool) -> TurnResolution:
    if call is None:
        return "interrupted" if final else "pending"
    if call.status == "failed":
        return "failed"
    if call.status == "incomplete":
        return "interrupted" if call.incomplete_reason == INTERRUPTED else "cut_off"
    return "acted" if acted else "answered"


INTERRUPTED = "interrupted"
"""``ModelCall.incomplete_reason`` of a call still in flight when the rollout stopped."""


def project_output(trajectory: Trajectory, *, partial: bool) -> list[ResponseItem]:
    """Project a trajectory to Responses-API output items.

    Args:
        trajectory: The calls to project.
        partial: True for checkpoints (omit pending calls), False for results
            (every call gets one output; unfinished ones are marked incomplete).

    Returns:
        The model's output items in order, each followed by the outputs of the
        tool calls it requested. Code cells of codeact turns (which have no
        ``function_call`` item of the model's own) appear as a ``function_call``
        named after the tool plus its output, so every action is visible.
    """
    return [item for projected in project_calls(trajectory, partial=partial) for item in projected.items]


class ProjectedCall(NamedTuple):
    """One model call's share of ``project_output``.

    Attributes:
        call: The model call.
        items: Its items in the projection: the calls a harness ran on its own before it
            (``lead`` items), then its own output, then its tools'.
        lead: How many of ``items`` come before the call's own output.
        own: How many of ``items`` are the call's own output (the model's generation).
    """

    call: ModelCall
    items: list[ResponseItem]
    lead: int
    own: int


def project_calls(trajectory: Trajectory, *, partial: bool) -> list[ProjectedCall]:
    """``project_output``, call by call (exporters attach each call's token data to its last own item)."""
    by_turn: dict[int, list[ToolCall]] = {}
    for tool in trajectory.tool_calls:
        by_turn.setdefault(tool.turn, []).append(tool)
    projected: list[ProjectedCall] = []
    for call in trajectory.model_calls:
        tools = by_turn.pop(call.turn, [])
        shown = {t.call_id for t in tools if not partial or t.status in _DONE}
        # A call a harness made on its own before this model call (NOOA's first turn) comes first.
        before = [t for t in tools if leads_call(t, call)]
        items: list[ResponseItem] = []
        for tool in before:
            if tool.call_id in shown:
                items += [_call_item(tool), _output_item(tool)]
        lead = len(items)
        tools = [t for t in tools if t not in before]
        declared: set[str] = set()
        for item in call.output:
            if item.get("type") == "function_call":
                declared.add(str(item.get("call_id")))
                if str(item.get("call_id")) not in shown:
                    continue
            items.append(item)
        own = len(items) - lead
        for tool in tools:
            if tool.call_id not in shown:
                continue
            if tool.call_id not in declared:
                items.append(_call_item(tool))
            items.append(_output_item(tool))
        projected.append(ProjectedCall(call, items, lead, own))
    return projected


def _call_item(tool: ToolCall) -> ResponseItem:
    return {"type": "function_call", "call_id": tool.call_id, "name": tool.name, "arguments": tool.arguments}


def _output_item(tool: ToolCall) -> ResponseItem:
    if tool.status in _DONE:
        return {
            "type": "function_call_output",
            "call_id": tool.call_id,
            "output": tool.output or "",
            "status": "completed",
        }
    return {
        "type": "function_call_output",
        "call_id": tool.call_id,
        "output": tool.output or f"[{tool.status}: the call did not complete]",
        "status": "incomplete",
    }


def final_text(items: Iterable[ResponseItem]) -> str:
    """Text of the last assistant message among ``items`` ('' if there is none)."""
    text = ""
    for item in items:
        if item.get("type") == "message" and item.get("role", "assistant") == "assistant":
            text = message_text(item)
    return text


def message_text(item: ResponseItem) -> str:
    """The text of one message item, whether its content is a string or a list of parts."""
    content: Any = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def sum_usage(calls: Iterable[ModelCall]) -> TokenUsage:
    """Sum token counts over calls; a field stays None unless every call reported it."""
    calls = list(calls)
    totals: dict[str, int | None] = {}
    for field in TokenUsage.model_fields:
        values = [getattr(c.usage, field) for c in calls]
        totals[field] = sum(v for v in values if v is not None) if values and None not in values else None
    return TokenUsage(**totals)


def arguments_json(value: Any) -> str:
    """Serialise tool arguments the way they are recorded (compact JSON)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
