"""A rollout as an ATIF v1.7 trajectory (Harbor's Agent Trajectory Interchange Format, RFC 0001).

The mapping (one document per rollout; ``step_id`` from 1, ISO 8601 timestamps):

* the task's instructions: a ``system`` step; the task's input messages: ``user`` steps;
* each turn: an ``agent`` step: ``message`` (its answer text), ``reasoning_content``,
  ``tool_calls`` (``tool_call_id``, ``function_name``, ``arguments`` as an object; the
  call's status and timings in ``extra``), ``observation`` (each tool call's output,
  ``source_call_id`` its id), ``metrics`` (prompt, completion and cached tokens, and,
  where the server returned them, ``prompt_token_ids``, ``completion_token_ids`` and
  ``logprobs``), ``llm_call_count`` (its model calls) and ``extra`` (turn id, model call
  ids, attempts, resolution, cumulative tool steps);
* what a harness ran on its own, no model call asking (NOOA's prefill, which prints the task's
  inputs before the first model call): an ``agent`` step of its own with ``llm_call_count`` 0,
  ATIF's deterministic dispatch, before the turn's model step when it ran before the model
  call, else after it; never among the model's ``tool_calls``;
* feedback the loop gave the model between turns (codeact's execution output, a
  cut-off notice): ``user`` steps before the turn that read them;
* ``final_metrics``: the sums, and the reward, outcome and health in ``extra``;
* the rollout's ``workspace.diff`` (what it changed), where it has one: the document's own
  ``extra.workspace_diff`` (ATIF has no field for a trajectory's resulting change).
"""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

from rollcage import __version__
from rollcage.durable import read_bounded
from rollcage.protocol import (
    FileSeal,
    ModelCall,
    ResponseItem,
    RolloutRecord,
    ToolCall,
    Turn,
    WorkerInput,
    WorkerResult,
)
from rollcage.trajectory import leads_call, message_text

__all__ = ["ATIF_VERSION", "read_workspace_diff", "to_atif"]

ATIF_VERSION = "ATIF-v1.7"

logger = logging.getLogger("rollcage.export")


_DIFF_LIMIT = 8 << 20
"""The largest workspace.diff carried (the controller writes at most 4 MiB)."""


def read_workspace_diff(directory: Path | None, seal: FileSeal | None = None) -> str | None:
    """The rollout directory's ``workspace.diff`` as text; ``None`` when it has none or it is unreadable.

    ``seal``: the record's (``RolloutRecord.workspace_diff``); a file that does not match it (torn
    by a machine crash: the file is not synced) is ``None`` too, never carried. ``None``: unchecked.
    """
    if directory is None:
        return None
    try:
        data = read_bounded(directory / "workspace.diff", limit=_DIFF_LIMIT if seal is None else seal.size)
    except OSError as exc:
        if seal is not None:  # sealed, so published: a machine crash lost it, or it was tampered with
            logger.warning("%s/workspace.diff: not exported: %s", directory, exc)
        return None
    if seal is not None and not seal.matches(data):
        logger.warning(
            "%s/workspace.diff: torn (it does not match its record's seal); not exported", directory
        )
        return None
    return data.decode("utf-8", errors="replace")


def to_atif(
    record: RolloutRecord, result: WorkerResult, spec: WorkerInput, *, workspace_diff: str | None = None
) -> dict[str, Any]:
    """The rollout as an ATIF v1.7 trajectory document (JSON-ready); ``workspace_diff``: its change."""
    trajectory = result.trajectory
    tools = {tool.call_id: tool for tool in trajectory.tool_calls}
    calls = {call.id: call for call in trajectory.model_calls}
    steps: list[dict[str, Any]] = []

    def add(step: dict[str, Any]) -> None:
        steps.append({"step_id": len(steps) + 1, **step})

    if spec.instructions:
        add({"timestamp": _iso(result.started_at), "source": "system", "message": spec.instructions})
    for turn in trajectory.turns:
        for item in turn.input:
            if item.get("type", "message") == "message" and item.get("role", "user") != "assistant":
                add({"timestamp": _iso(turn.started_at), "source": "user", "message": message_text(item)})
        owned = [calls[i] for i in turn.model_calls if i in calls]
        own_tools = [tools[i] for i in turn.tool_calls if i in tools]
        harness = [tool for tool in own_tools if tool.origin == "harness"]
        lead = [tool for tool in harness if leads_call(tool, owned[0] if owned else None)]
        if lead:
            add(_dispatch_step(turn, lead))
        add(_agent_step(turn, owned, [t for t in own_tools if t.origin == "model"], spec.model.model))
        if len(lead) < len(harness):
            add(_dispatch_step(turn, [tool for tool in harness if tool not in lead]))
    usage = result.response.usage if result.response is not None else None
    return {
        "schema_version": ATIF_VERSION,
        "session_id": record.rollout_id,
        "trajectory_id": record.rollout_id,
        "agent": {
            "name": "rollcage",
            "version": __version__,
            "model_name": spec.model.model,
            "tool_definitions": _tool_definitions(trajectory.model_calls),
            "extra": {"mode": spec.agent.mode, "api": spec.model.api},
        },
        "steps": steps,
        "notes": "Exported by rollcage from result.json; tool call outputs are the text the model saw.",
        "final_metrics": {
            "total_prompt_tokens": usage.input_tokens if usage else None,
            "total_completion_tokens": usage.output_tokens if usage else None,
            "total_cached_tokens": usage.cached_tokens if usage else None,
            "total_steps": len(steps),
            "extra": {
                "task_id": record.task_id,
                "outcome": record.outcome,
                "reward": record.reward,
                "masked": record.masked,
                "termination_reason": result.termination_reason,
                "health": record.health.verdict,
                "token_counts": record.metrics.token_counts,
            },
        },
        "extra": {
            "task_id": record.task_id,
            "sample": record.sample,
            "try_index": record.try_index,
            **({"workspace_diff": workspace_diff} if workspace_diff is not None else {}),
        },
    }


def _dispatch_step(turn: Turn, owned: list[ToolCall]) -> dict[str, Any]:
    """What a harness ran on its own: ATIF's deterministic dispatch (an agent step with no LLM call)."""
    step: dict[str, Any] = {
        "timestamp": _iso(min(tool.started_at for tool in owned)),
        "source": "agent",
        "message": "",
        "llm_call_count": 0,
        "tool_calls": [_tool_call(tool) for tool in owned],
        "extra": {"turn_id": turn.id, "origin": "harness"},
    }
    results = _observations(owned)
    if results:
        step["observation"] = {"results": results}
    return step


def _observations(owned: list[ToolCall]) -> list[dict[str, Any]]:
    return [
        {"source_call_id": tool.call_id, "content": tool.output, "extra": {"status": tool.status}}
        for tool in owned
        if tool.output is not None
    ]


def _agent_step(turn: Turn, calls: list[ModelCall], owned: list[ToolCall], model: str) -> dict[str, Any]:
    """The turn's model step: its calls' answer, reasoning and metrics, and the tool calls the model made."""
    reasoning = "".join(_reasoning_text(item) for item in turn.reasoning)
    step: dict[str, Any] = {
        "timestamp": _iso(turn.started_at),
        "source": "agent",
        "model_name": model,
        "message": "".join(message_text(item) for item in turn.answer if item.get("type") == "message"),
        "llm_call_count": len(calls),
        "extra": {
            "turn_id": turn.id,
            "resolution": turn.resolution,
            "tool_steps": turn.tool_steps,
            "model_call_ids": [call.id for call in calls],
            "attempts": [len(call.attempts) for call in calls],
        },
    }
    if reasoning:
        step["reasoning_content"] = reasoning
    if owned:
        step["tool_calls"] = [_tool_call(tool) for tool in owned]
        results = _observations(owned)
        if results:
            step["observation"] = {"results": results}
    if calls:
        step["metrics"] = _metrics(calls)
    return step


def _metrics(calls: list[ModelCall]) -> dict[str, Any]:
    last = calls[-1]
    metrics: dict[str, Any] = {
        "prompt_tokens": last.usage.input_tokens,
        "completion_tokens": last.usage.output_tokens,
        "cached_tokens": last.usage.cached_tokens,
        "extra": {
            "reasoning_tokens": last.usage.reasoning_tokens,
            "total_tokens": last.usage.total_tokens,
            "status": last.status,
            "incomplete_reason": last.incomplete_reason,
            "token_data": last.tokens.status,
        },
    }
    tokens = last.tokens
    if tokens.prompt_token_ids is not None:
        metrics["prompt_token_ids"] = tokens.prompt_token_ids
    if tokens.generation_token_ids is not None and tokens.scope == "generation":
        metrics["completion_token_ids"] = tokens.generation_token_ids
    if tokens.generation_log_probs is not None and tokens.scope == "generation":
        metrics["logprobs"] = tokens.generation_log_probs
    return metrics


def _tool_call(tool: ToolCall) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "status": tool.status,
        "started_at": _iso(tool.started_at),
        "ended_at": _iso(tool.ended_at) if tool.ended_at is not None else None,
        "duration_s": tool.duration_s,
    }
    try:
        arguments = json.loads(tool.arguments) if tool.arguments.strip() else {}
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        # Code cells and arguments that are not a JSON object: kept verbatim beside an empty object.
        extra["raw_arguments"] = tool.arguments
        arguments = {"code": tool.arguments} if tool.call_id.startswith("cell-") else {}
    return {"tool_call_id": tool.call_id, "function_name": tool.name, "arguments": arguments, "extra": extra}


def _tool_definitions(calls: list[ModelCall]) -> list[dict[str, Any]] | None:
    """The function tools the model was offered (OpenAI's function-calling schema), from the first request."""
    if not calls:
        return None
    offered = calls[0].request.get("tools")
    if not isinstance(offered, list):
        return None
    definitions = []
    for tool in offered:
        if not isinstance(tool, dict):
            continue
        nested = tool.get("function")
        function: dict[str, Any] = nested if isinstance(nested, dict) else tool
        definitions.append(
            {
                "type": "function",
                "function": {
                    key: function[key] for key in ("name", "description", "parameters") if key in function
                },
            }
        )
    return definitions or None


def _reasoning_text(item: ResponseItem) -> str:
    summary = item.get("summary")
    if not isinstance(summary, list):
        return ""
    return "".join(str(part.get("text", "")) for part in summary if isinstance(part, dict))


def _iso(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
