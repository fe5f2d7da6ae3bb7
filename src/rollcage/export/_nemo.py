"""A rollout as a line of NeMo Gym's rollout JSONL (what ``ng_collect_rollouts`` writes, and NeMo RL reads).

The row is NeMo Gym's verify response: ``responses_create_params`` (the request the
model was sent, sampling fields included), ``response`` (a complete NeMo Gym response
object, each model call's token arrays on the item that carries its generation, as
NeMo Gym's training items do), ``reward``, ``agent_ref`` (as NeMo Gym's collector
stamps it), the indices ``_ng_task_index`` (the task's dataset row) /
``_ng_rollout_index`` and the rollout id (``_ng_rollout_id``), and ``ng_trajectory``:
NeMo Gym's canonical trajectory record (schema 1.0), in which every model call is
owned by the rollout's one agent invocation and by exactly one turn, by its
``model_call_id``, and each turn's question and answer are cut from the invocation's
conversation as NeMo Gym's ``gym_rollout_to_atif`` cuts them. Only what the model saw
and wrote is in it: a codeact cell is a tool record, never a call the model made.
"""

from __future__ import annotations

from typing import Any, Literal

from rollcage.controller import create_params_for, function_tools, nemo_items, to_nemo_response
from rollcage.protocol import ModelCall, RolloutRecord, ToolCall, Turn, WorkerInput, WorkerResult
from rollcage.trajectory import project_calls

__all__ = ["AGENT_REF", "NG_TRAJECTORY_VERSION", "to_nemo_gym_row"]

NG_TRAJECTORY_VERSION = "1.0"
AGENT_REF = {"type": "responses_api_agents", "name": "rollcage"}
"""The agent that acted, as NeMo Gym's collector stamps every row (its ATIF export names the agent by it)."""
_LENGTH_REASONS = frozenset({"length", "max_output_tokens", "max_tokens"})


def to_nemo_gym_row(
    record: RolloutRecord, result: WorkerResult, spec: WorkerInput, *, task_index: int
) -> dict[str, Any]:
    """One rollout JSONL row; ``task_index``: the task's dataset row (``RolloutRecord.task_index``)."""
    params = create_params_for(
        input=spec.input,
        instructions=spec.instructions,
        tools=function_tools(list(spec.tools), codeact=spec.agent.mode == "codeact"),
        model=spec.model.model,
        sampling=spec.model.sampling.model_dump(),
    )
    return {
        "_ng_task_index": task_index,
        "_ng_rollout_index": record.sample,
        "_ng_rollout_id": record.rollout_id,
        "agent_ref": dict(AGENT_REF),
        "task_id": record.task_id,
        "responses_create_params": params,
        "response": to_nemo_response(result, params, with_tokens=True),
        "reward": record.reward,
        "ng_trajectory": ng_trajectory(record, result, params),
    }


def ng_trajectory(record: RolloutRecord, result: WorkerResult, params: dict[str, Any]) -> dict[str, Any]:
    """NeMo Gym's ``TrajectoryRecord`` of the rollout, as NeMo Gym's own agents write it.

    The conversation is the task's input then the rollout's output, each item in the
    one NeMo Gym shape (``nemo_items``). Each turn's ``question`` is the whole prefix
    of that conversation the model saw before its answer (the request's full input),
    its ``answer`` and ``reasoning_content`` the conversation's own items of its model
    calls, so NeMo Gym's ``gym_rollout_to_atif`` finds the turns where it cuts them.
    """
    trajectory = result.trajectory
    invocation = record.rollout_id
    given = params["input"]
    start = [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else list(given)
    conversation, owned = _conversation(result, start)
    last = trajectory.turns[-1].index if trajectory.turns else None
    return {
        "schema_version": NG_TRAJECTORY_VERSION,
        "task_id": record.task_id,
        "rollout_id": record.rollout_id,
        "invocations": [
            {
                "kind": "agent_invocation",
                "invocation_id": invocation,
                "status": _invocation_status(result),
                "duration_ms": max(0.0, result.ended_at - result.started_at) * 1000,
                "error_type": result.error.type if result.error is not None else None,
                "model_calls": [{"model_call_id": call.id} for call in trajectory.model_calls],
                "conversation": conversation,
            }
        ],
        "turns": [
            _turn(
                turn,
                record,
                invocation,
                resolved=_resolved(turn, result, last),
                conversation=conversation,
                owned=owned,
            )
            for turn in trajectory.turns
        ],
        "model_calls": [_model_call(call) for call in trajectory.model_calls],
        # Tools agent code called (bridge-*) ran inside a cell, which is the step the model took.
        "tool_calls": [
            _tool_call(tool, invocation)
            for tool in trajectory.tool_calls
            if not tool.call_id.startswith("bridge-")
        ],
        "gaps": [],
    }


def _conversation(
    result: WorkerResult, start: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], dict[str, tuple[int, list[int]]]]:
    """The conversation the model had, and each model call's place in it.

    The task's input, then call by call: the messages its turn added (a codeact turn's
    execution output, feedback such as a cut-off notice), then the call's items in
    NeMo Gym's shape (``nemo_items``). Each call maps to (where its output starts,
    the conversation positions it owns); ``{}`` when the output is not the worker's
    projection of this trajectory: no position can be trusted, and turns fall back
    to their own records.
    """
    converted = nemo_items(result)
    calls = project_calls(result.trajectory, partial=False)
    if sum(len(call.items) for call in calls) != len(converted):
        return [*start, *(item for item in converted if item is not None)], {}
    added = {
        turn.model_calls[0]: [_input_message(i) for i in turn.input if i.get("type", "message") == "message"]
        for turn in result.trajectory.turns
        if turn.index > 0 and turn.model_calls
    }
    conversation = list(start)
    owned: dict[str, tuple[int, list[int]]] = {}
    position = 0
    for call, items, lead, own in calls:
        conversation += added.get(call.id, [])
        mine: list[int] = []
        begins: int | None = None
        for offset in range(len(items)):
            if offset == lead:
                begins = len(conversation)
            item = converted[position + offset]
            if item is not None:
                if lead <= offset < lead + own:
                    mine.append(len(conversation))
                conversation.append(item)
        owned[call.id] = (begins if begins is not None else len(conversation), mine)
        position += len(items)
    if any(call.output and not owned[call.id][1] for call, *_ in calls):
        # A call that produced items owns none of the output: the output is not this trajectory's
        # projection after all (its tool records are missing, say), and a turn cut from it would
        # look hollow. The turns' own records say what each call answered.
        return [*start, *(item for item in converted if item is not None)], {}
    return conversation, owned


def _input_message(item: dict[str, Any]) -> dict[str, Any]:
    """A message the agent added to the conversation, as a NeMo Gym input item (which must say its type)."""
    return {"type": "message", "role": item.get("role", "user"), "content": item.get("content", "")}


def _invocation_status(result: WorkerResult) -> Literal["completed", "failed", "incomplete"]:
    if result.error is None:
        return "completed"
    return "incomplete" if result.error.kind == "cancelled" else "failed"


def _resolved(turn: Turn, result: WorkerResult, last: int | None) -> bool | None:
    """The terminal turn says whether the invocation resolved (answered, completed); earlier ones do not."""
    if turn.index != last:
        return None
    return result.termination_reason == "completed" and result.error is None


def _turn(
    turn: Turn,
    record: RolloutRecord,
    invocation: str,
    *,
    resolved: bool | None,
    conversation: list[dict[str, Any]],
    owned: dict[str, tuple[int, list[int]]],
) -> dict[str, Any]:
    spans = [owned[call_id] for call_id in turn.model_calls if call_id in owned]
    if spans and len(spans) == len(turn.model_calls):
        own = [conversation[i] for _, positions in spans for i in positions]
        question: list[dict[str, Any]] = conversation[: spans[0][0]]
        answer = [item for item in own if item.get("type") != "reasoning"]
        reasoning = [item for item in own if item.get("type") == "reasoning"]
    else:  # not the worker's projection: the turn's own record, as it is
        question, answer, reasoning = list(turn.input), list(turn.answer), list(turn.reasoning)
    return {
        "invocation_id": invocation,
        "task_id": record.task_id,
        "rollout_id": record.rollout_id,
        "turn_no": turn.index + 1,
        "timestamp": turn.started_at,
        "question": question,
        "answer": answer,
        "reasoning_content": reasoning or None,
        "resolved": resolved,
        "step_count": turn.tool_steps,
        "model_calls": [{"model_call_id": call_id} for call_id in turn.model_calls],
    }


def _model_call(call: ModelCall) -> dict[str, Any]:
    first_byte = call.attempts[-1].first_byte_at
    last = call.attempts[-1]
    response_id = call.response.get("id") if isinstance(call.response, dict) else None
    return {
        "model_call_id": call.id,
        "started_at": call.started_at,
        "completed_at": call.ended_at,
        "duration_ms": max(0.0, call.ended_at - call.started_at) * 1000,
        "request": call.request,
        "response": call.response,
        "response_metadata": {
            "response_id": response_id if isinstance(response_id, str) else None,
            "model": call.request.get("model") if isinstance(call.request.get("model"), str) else None,
            "dialect": "chat" if call.api == "chat" else "responses",  # NeMo Gym's names
            "status_code": call.http_status,
            "response_status": call.status,
            "finish_reason": _finish_reason(call),
            "error_category": call.error.type if call.error is not None else None,
            "latency_ttft_ms": (first_byte - last.started_at) * 1000 if first_byte is not None else None,
        },
        "token_stats": {
            "prompt_tokens": call.usage.input_tokens,
            "completion_tokens": call.usage.output_tokens,
            "reasoning_tokens": call.usage.reasoning_tokens,
            "total_tokens": call.usage.total_tokens,
            "cached_tokens": call.usage.cached_tokens,
        },
    }


def _finish_reason(call: ModelCall) -> str | None:
    if call.status == "failed":
        return None
    if call.status == "incomplete":
        return "length" if call.incomplete_reason in _LENGTH_REASONS else call.incomplete_reason
    return "tool_calls" if any(item.get("type") == "function_call" for item in call.output) else "stop"


def _tool_call(tool: ToolCall, invocation: str) -> dict[str, Any]:
    status = tool.status if tool.status != "pending" else "incomplete"
    return {
        "kind": "tool_call",
        "invocation_id": invocation,
        "tool_call_id": tool.call_id,
        "tool_name": tool.name,
        "started_at": tool.started_at,
        "completed_at": tool.ended_at,
        "duration_ms": tool.duration_s * 1000 if tool.duration_s is not None else None,
        "timing_source": "harness",
        "status": status,
        # NeMo Gym's agents mark a tool that answered with an error so (its ATIF export then refuses the row).
        "error_type": "tool_error" if status == "failed" else None,
        "output": tool.output,
    }
