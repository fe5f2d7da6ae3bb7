"""Projections of a trajectory: partial for checkpoints, final for results; journal compaction."""

from __future__ import annotations

from typing import Any

from rollcage.checkpoint import CallCompactor, fold_records
from rollcage.protocol import (
    BoundaryRecord,
    CallAttempt,
    CallTokens,
    ModelCall,
    TokenUsage,
    Trajectory,
    TurnStart,
)
from rollcage.trajectory import TrajectoryRecorder, final_text, project_output, sum_usage


def _model_call(
    index: int,
    output: list[dict[str, Any]],
    messages: list[dict[str, Any]] | None = None,
    *,
    tokens: CallTokens | None = None,
) -> ModelCall:
    return ModelCall(
        id=f"r:m{index}",
        index=index,
        turn=index,
        api="chat",
        request={"model": "m", "messages": messages or [{"role": "user", "content": "go"}]},
        input=[{"type": "message", "role": "user", "content": "go"}],
        status="completed",
        output=output,
        usage=TokenUsage(input_tokens=10, output_tokens=5, total_tokens=15),
        tokens=tokens or CallTokens(),
        attempts=[CallAttempt(index=0, status="completed", http_status=200, started_at=1.0, ended_at=2.0)],
        started_at=1.0,
        ended_at=2.0,
    )


def _start(index: int, items: list[dict[str, Any]] | None = None) -> TurnStart:
    return TurnStart(
        index=index, id=f"r:t{index}", model_call_id=f"r:m{index}", started_at=1.0, input=items or []
    )


def _fc(call_id: str, name: str = "python") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": '{"code": "1"}'}


def _recorder_with_two_calls() -> TrajectoryRecorder:
    rec = TrajectoryRecorder()
    rec.add_model_call(_model_call(0, [_fc("a"), _fc("b", "get_weather")]))
    rec.start_tool_call("a", "python", '{"code": "1"}', 0)
    rec.start_tool_call("b", "get_weather", "{}", 0)
    rec.finish_tool_call("a", "completed", "1")
    return rec


def test_partial_projection_omits_pending_call_and_its_function_call() -> None:
    items = project_output(_recorder_with_two_calls().snapshot(), partial=True)
    ids = [(i["type"], i.get("call_id")) for i in items]
    assert ids == [("function_call", "a"), ("function_call_output", "a")]


def test_final_projection_gives_every_call_exactly_one_output() -> None:
    items = project_output(_recorder_with_two_calls().snapshot(), partial=False)
    outputs = [i for i in items if i["type"] == "function_call_output"]
    calls = [i for i in items if i["type"] == "function_call"]
    assert sorted(o["call_id"] for o in outputs) == sorted(c["call_id"] for c in calls) == ["a", "b"]
    pending = next(o for o in outputs if o["call_id"] == "b")
    assert pending["status"] == "incomplete"
    assert next(o for o in outputs if o["call_id"] == "a")["status"] == "completed"


def test_cancelled_call_is_incomplete_in_the_final_projection() -> None:
    rec = _recorder_with_two_calls()
    rec.stop_pending("cancelled", "[cancelled]")
    items = project_output(rec.snapshot(), partial=False)
    out_b = next(i for i in items if i.get("call_id") == "b" and i["type"] == "function_call_output")
    assert out_b["status"] == "incomplete"
    assert [c.status for c in rec.snapshot().tool_calls] == ["completed", "cancelled"]


def test_codeact_cells_appear_as_calls_with_outputs() -> None:
    rec = TrajectoryRecorder()
    text = "```python\nprint(1)\n```"
    rec.add_model_call(_model_call(0, [{"type": "message", "role": "assistant", "content": text}]))
    rec.start_tool_call("cell-0-0", "python", "print(1)", 0)
    rec.finish_tool_call("cell-0-0", "completed", "1\n")
    items = project_output(rec.snapshot(), partial=False)
    assert [i["type"] for i in items] == ["message", "function_call", "function_call_output"]
    assert items[1]["arguments"] == "print(1)"


def test_final_text_is_the_last_assistant_message() -> None:
    items = [
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "first"}]},
        {"type": "message", "role": "assistant", "content": "second"},
    ]
    assert final_text(items) == "second"
    assert final_text([]) == ""


def test_usage_sum_stays_none_when_any_call_did_not_report() -> None:
    a = _model_call(0, [])
    b = _model_call(1, []).model_copy(update={"usage": TokenUsage(input_tokens=1)})
    total = sum_usage([a, b])
    assert total.input_tokens == 11
    assert total.output_tokens is None


def test_journal_deltas_rebuild_the_exact_requests_inputs_and_prompt_tokens() -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    compactor = CallCompactor()
    records: list[dict[str, Any]] = [{"seq": 1, "kind": "start", "at": 0.0, "rollout_id": "r"}]
    originals = []
    prompt: list[int] = [1, 2, 3]
    for index in range(4):
        history = [*history, {"role": "assistant", "content": f"turn {index}"}]
        generation = [100 + index, 200 + index]
        tokens = CallTokens(
            prompt_token_ids=prompt, generation_token_ids=generation, generation_log_probs=[-0.5, -1.0]
        )
        call = _model_call(
            index, [{"type": "message", "role": "assistant", "content": "x"}], list(history), tokens=tokens
        )
        prompt = [*prompt, *generation, 9]
        originals.append(call)
        stripped, deltas = compactor.compact(call)
        if index > 0:
            by_field = {delta.field: delta for delta in deltas}
            # O(new items), not O(transcript): one message, and the previous generation plus one token.
            assert len(by_field["request.messages"].append) == 1
            assert by_field["tokens.prompt_token_ids"].append == [100 + index - 1, 200 + index - 1, 9]
            assert "messages" not in stripped.request and stripped.tokens.prompt_token_ids is None
        record = BoundaryRecord(kind="model_call", at=1.0, model_call=stripped, deltas=deltas)
        records.append({"seq": index + 2, **record.model_dump(mode="json", exclude_none=True)})
    checkpoint = fold_records(records)
    folded = checkpoint.trajectory.model_calls
    assert [c.request for c in folded] == [c.request for c in originals]
    assert [c.input for c in folded] == [c.input for c in originals]
    assert [c.tokens for c in folded] == [c.tokens for c in originals]
    assert all(c.tokens.status == "observed" for c in folded)
    assert checkpoint.rollout_id == "r" and checkpoint.seq == 5 and checkpoint.partial is True


def test_fold_keeps_latest_cookies_and_pending_calls_out_of_output() -> None:
    call = _model_call(0, [_fc("a")])
    pending = (
        _recorder_with_two_calls().snapshot().tool_calls[1].model_copy(update={"turn": 0, "call_id": "a"})
    )
    records = [
        {"seq": 1, "kind": "start", "at": 0.0, "rollout_id": "r", "resource_cookies": {"s": "1"}},
        {
            "seq": 2,
            **BoundaryRecord(kind="model_call", at=1.0, model_call=call, tool_calls=[pending]).model_dump(
                mode="json"
            ),
        },
        {"seq": 3, "kind": "tool_call", "at": 2.0, "tool_calls": [], "resource_cookies": {"s": "2"}},
    ]
    checkpoint = fold_records(records)
    assert checkpoint.resource_cookies == {"s": "2"}
    assert [i["type"] for i in checkpoint.output] == []  # the only call is still pending
    assert Trajectory.model_validate(checkpoint.trajectory.model_dump()).tool_calls[0].status == "pending"
