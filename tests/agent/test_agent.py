"""The agent loop in-process: the real model client against the scripted policy, real executor."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.agent import Agent, extract_code_blocks
from rollcage.model import ModelClient
from rollcage.policy import PolicyServer
from rollcage.protocol import BoundaryRecord, ExecutorSettings, ToolStatus, WorkerInput
from rollcage.tools import make_executor
from rollcage.trajectory import TrajectoryRecorder


class _Cells:
    """The worker's executor adapter, reduced to what the loop needs."""

    def __init__(self, cwd: Path) -> None:
        self.executor = make_executor(ExecutorSettings(), cwd=cwd)
        self.cells_started = 0

    def prestart(self) -> None:
        pass

    async def run_cell(self, code: str, timeout_s: float) -> tuple[ToolStatus, str]:
        self.cells_started += 1
        await self.executor.start()
        result = await self.executor.run(code, timeout_s)
        return ("completed" if result.status == "ok" else "failed"), result.text


@pytest.fixture
def server() -> Iterator[PolicyServer]:
    marker = "open('ran', 'w').write('yes')"
    script = {
        "tasks": {
            "t": [
                {"tool_calls": [{"name": "python", "arguments": {"code": marker}}]},
                {"text": "done"},
            ]
        }
    }
    with PolicyServer(script) as srv:
        yield srv


def _spec(url: str) -> WorkerInput:
    return WorkerInput.model_validate(
        {
            "rollout_id": "r",
            "task_id": "t",
            "input": "go",
            "model": {"base_url": url, "model": "m", "max_retries": 0, "timeout_s": 120},
            "tools": [{"type": "python"}],
        }
    )


async def test_next_action_waits_until_the_boundary_is_durable(server: PolicyServer, tmp_path: Path) -> None:
    """While the sink holds a boundary (the journal's fsync), the loop must not act."""
    release = asyncio.Event()
    held = asyncio.Event()
    seen: list[BoundaryRecord] = []

    async def sink(record: BoundaryRecord) -> None:
        seen.append(record)
        if record.kind == "model_call" and not held.is_set():
            held.set()
            await release.wait()

    cells = _Cells(tmp_path)
    spec = _spec(server.base_url)
    try:
        async with ModelClient(spec.model, rollout_id="r", task_id="t") as client:
            agent = Agent(
                spec, model=client, resources=None, cells=cells, recorder=TrajectoryRecorder(), boundary=sink
            )
            task = asyncio.create_task(agent.run())
            async with asyncio.timeout(20):
                await held.wait()
            # Give the loop every chance to run ahead if it were not waiting on the sink.
            for _ in range(50):
                await asyncio.sleep(0)
            assert cells.cells_started == 0, "the tool started before its model boundary was durable"
            assert len(server.request_log) == 1
            release.set()
            async with asyncio.timeout(20):
                result = await task
    finally:
        await cells.executor.aclose()
    assert result.termination_reason == "completed"
    assert (tmp_path / "ran").read_text() == "yes"
    assert [r.kind for r in seen] == ["turn_start", "model_call", "tool_call", "turn_start", "model_call"]


async def test_cancelling_the_loop_leaves_the_running_call_pending(
    server: PolicyServer, tmp_path: Path
) -> None:
    recorder = TrajectoryRecorder()
    started = asyncio.Event()

    class _SlowCells(_Cells):
        async def run_cell(self, code: str, timeout_s: float) -> tuple[ToolStatus, str]:
            started.set()
            await asyncio.Event().wait()  # never returns: only cancellation ends it
            raise AssertionError("unreachable")

    async def sink(record: BoundaryRecord) -> None:
        pass

    spec = _spec(server.base_url)
    async with ModelClient(spec.model, rollout_id="r", task_id="t") as client:
        agent = Agent(
            spec, model=client, resources=None, cells=_SlowCells(tmp_path), recorder=recorder, boundary=sink
        )
        task = asyncio.create_task(agent.run())
        async with asyncio.timeout(20):
            await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [c.status for c in recorder.pending()] == ["pending"]


async def test_a_model_call_cancelled_in_flight_is_recorded_interrupted_with_its_turn(tmp_path: Path) -> None:
    """The journal says the call started; the trajectory keeps it, incomplete, owned by its turn."""
    script = {"tasks": {"t": [{"text": "never seen"}]}}
    seen: list[BoundaryRecord] = []

    async def sink(record: BoundaryRecord) -> None:
        seen.append(record)

    with PolicyServer(script, faults=["call=1:kind=hang"]) as srv:
        spec = _spec(srv.base_url)
        recorder = TrajectoryRecorder()
        async with ModelClient(spec.model, rollout_id="r", task_id="t") as client:
            agent = Agent(spec, model=client, resources=None, cells=None, recorder=recorder, boundary=sink)
            task = asyncio.create_task(agent.run())
            assert await asyncio.to_thread(srv.state.wait_for_requests, 1, 20.0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert [r.kind for r in seen] == ["turn_start"]
    assert seen[0].turn is not None and seen[0].turn.model_call_id == "r:m0"
    assert seen[0].turn.input == [{"type": "message", "role": "user", "content": "go"}]
    trajectory = recorder.snapshot(final=True)
    (call,) = trajectory.model_calls
    assert (call.id, call.turn, call.status, call.incomplete_reason) == (
        "r:m0",
        0,
        "incomplete",
        "interrupted",
    )
    assert [a.status for a in call.attempts] == ["incomplete"] and call.request["messages"]
    (turn,) = trajectory.turns
    assert (turn.id, turn.model_calls, turn.resolution) == ("r:t0", ["r:m0"], "interrupted")


@pytest.mark.parametrize(
    ("text", "blocks"),
    [
        ("no code here", []),
        ("```python\nx = 1\n```", ["x = 1"]),
        ("a\n```py\nprint(1)\n```\nb\n```python\n\n```\n```python\ny=2\n```", ["print(1)", "y=2"]),
        ("```bash\nls\n```", []),
    ],
)
def test_extract_code_blocks(text: str, blocks: list[Any]) -> None:
    assert extract_code_blocks(text) == blocks


# --------------------------------------------------------------------------- hostile model answers

HOSTILE_SCRIPT = {
    "tasks": {
        "t": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "1"}}] * 2},
            {"tool_calls": [{"name": "python", "arguments": {"code": "2"}}]},
            {"text": "done"},
        ]
    }
}


class _InstantCells:
    """An executor stand-in that answers at once: these tests are about the loop's bookkeeping."""

    def __init__(self) -> None:
        self.cells: list[str] = []

    def prestart(self) -> None:
        pass

    async def run_cell(self, code: str, timeout_s: float) -> tuple[ToolStatus, str]:
        self.cells.append(code)
        return "completed", "ok"


@pytest.fixture(scope="module")
def hostile_server() -> Iterator[PolicyServer]:
    rules = [
        "rollout=no-ids:kind=no_ids",
        "rollout=reused:kind=reused_ids",
        "rollout=many:call=1:kind=many_calls:count=10000",
        "rollout=unknown:kind=unknown_tool",
    ]
    with PolicyServer(HOSTILE_SCRIPT, faults=rules, keep_bodies=True) as srv:
        yield srv


async def _run_hostile(
    server: PolicyServer, rollout_id: str, **agent: Any
) -> tuple[Any, TrajectoryRecorder, list[BoundaryRecord], _InstantCells]:
    spec = _spec(server.base_url).model_copy(update={"rollout_id": rollout_id})
    spec = WorkerInput.model_validate({**spec.model_dump(), "agent": agent})
    recorder, seen, cells = TrajectoryRecorder(), [], _InstantCells()

    async def sink(record: BoundaryRecord) -> None:
        seen.append(record)

    async with ModelClient(spec.model, rollout_id=rollout_id, task_id="t") as client:
        loop = Agent(spec, model=client, resources=None, cells=cells, recorder=recorder, boundary=sink)
        async with asyncio.timeout(60):
            result = await loop.run()
    return result, recorder, seen, cells


@pytest.mark.parametrize(("rollout_id", "server_id"), [("no-ids", None), ("reused", "call_reused")])
async def test_tool_call_ids_are_the_loops_own_whatever_ids_the_server_sends(
    hostile_server: PolicyServer, rollout_id: str, server_id: str | None
) -> None:
    result, recorder, _, cells = await _run_hostile(hostile_server, rollout_id)
    assert result.termination_reason == "completed" and cells.cells == ["1", "1", "2"]
    calls = recorder.snapshot().tool_calls
    assert [c.call_id for c in calls] == ["call_0_0", "call_0_1", "call_1_0"]
    assert [c.server_call_id for c in calls] == [server_id] * 3  # the server's word, kept as evidence
    # The model is shown the loop's ids, each call paired with its own output.
    last = hostile_server.request_log[-1].body
    assert last is not None
    sent = [(m.get("role"), m.get("tool_call_id")) for m in last["messages"] if m.get("role") == "tool"]
    assert sent == [("tool", "call_0_0"), ("tool", "call_0_1"), ("tool", "call_1_0")]


async def test_a_response_with_10000_calls_stops_at_the_budget_in_one_record(
    hostile_server: PolicyServer,
) -> None:
    result, recorder, seen, cells = await _run_hostile(hostile_server, "many", max_tool_calls=8)
    assert result.termination_reason == "max_tool_calls" and cells.cells == []
    # The refusals ride in the response's own record (after the turn's start).
    assert [r.kind for r in seen] == ["turn_start", "model_call"]
    record = seen[-1]
    assert len(record.tool_calls) == 10_000 and {c.status for c in record.tool_calls} == {"failed"}
    assert len({c.call_id for c in recorder.snapshot().tool_calls}) == 10_000


async def test_calls_of_a_tool_that_does_not_exist_count_as_invalid_outputs(
    hostile_server: PolicyServer,
) -> None:
    result, recorder, _, cells = await _run_hostile(hostile_server, "unknown", max_invalid_outputs=1)
    assert result.termination_reason == "invalid_policy_output" and cells.cells == []
    outputs = {c.output for c in recorder.snapshot().tool_calls}
    assert outputs == {"error: there is no tool named 'no_such_tool'"}
