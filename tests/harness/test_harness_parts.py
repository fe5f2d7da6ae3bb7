"""The harness machinery, part by part, without a sandbox: forwarder, proxy budget, capture journal, events.

Real servers on loopback stand in for the model (the scripted policy) and a real
egress proxy on a Unix socket stands between them, as in a rollout; only the
harness itself is replaced by the test's own HTTP client.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import termios
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollcage import load_checkpoint
from rollcage.durable import read_journal
from rollcage.harness import (
    BUDGET_CODE,
    CaptureJournal,
    Forwarder,
    WireCalls,
    WireExchange,
    read_events,
    relay_line,
)
from rollcage.harness._events import MAX_EVENT_BYTES
from rollcage.policy import PolicyServer
from rollcage.protocol import (
    BoundaryRecord,
    CallAttempt,
    CommandHarness,
    HarnessEnvironment,
    ModelCall,
    ModelEndpoint,
    ToolCall,
    Trajectory,
    TurnStart,
    WorkerInput,
)
from rollcage.supervisor import ProxyConfig
from rollcage.supervisor.proxy import MODEL_PREFIX, EgressProxy, routes_for, sandbox_input
from rollcage.trajectory import build_turns, project_output
from tests.helpers.waiting import wait_for_async

SCRIPT = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(1)"}}]},
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(2)"}}]},
            {"text": "done"},
        ]
    }
}
TOKEN = "rollout-token"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rc-harness-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def policy() -> Iterator[PolicyServer]:
    with PolicyServer(SCRIPT) as server:
        yield server


def spec_for(base_url: str, *, uds: str | None = None, max_policy_calls: int = 8) -> WorkerInput:
    return WorkerInput(
        rollout_id="r1",
        task_id="t1",
        input="hi",
        model=ModelEndpoint(base_url=base_url, model="m", max_retries=0, uds=uds),
        agent={"max_policy_calls": max_policy_calls, "harness": {"type": "command", "argv": ["true"]}},
    )


def chat(
    client: httpx.AsyncClient,
    base: str,
    token: str | None = TOKEN,
    *,
    messages: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {"model": "m", "messages": messages or [{"role": "user", "content": "hi"}], **extra}
    return client.post(f"{base}/chat/completions", json=body, headers=headers)


# --------------------------------------------------------------------------- the forwarder


async def test_forwarder_records_each_model_call_before_the_harness_sees_its_end(
    policy: PolicyServer,
) -> None:
    seen: list[WireExchange] = []
    release = asyncio.Event()

    async def record(exchange: WireExchange) -> None:
        seen.append(exchange)
        await release.wait()

    async with Forwarder(spec_for(policy.base_url), token=TOKEN, on_model_exchange=record) as fwd:
        async with httpx.AsyncClient(timeout=30) as client:
            pending = asyncio.ensure_future(chat(client, fwd.base_url))
            await wait_for_async(lambda: seen, within_s=30, what="the exchange to be recorded")
            # A negative needs a window: had the forwarder answered without waiting for the record,
            # the answer would be back well within it (it has the whole upstream response already).
            await asyncio.sleep(0.2)
            assert not pending.done()
            release.set()
            response = await pending
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["tool_calls"]
    assert seen[0].api == "chat" and seen[0].status == 200 and seen[0].response == response.content


async def test_a_model_call_in_flight_when_the_rollout_stops_is_interrupted_not_failed() -> None:
    seen: list[WireExchange] = []

    async def record(exchange: WireExchange) -> None:
        seen.append(exchange)

    with PolicyServer(SCRIPT, faults=["kind=hang"]) as policy:
        async with Forwarder(spec_for(policy.base_url), token=TOKEN, on_model_exchange=record) as fwd:
            async with httpx.AsyncClient(timeout=30) as client:
                pending = asyncio.ensure_future(chat(client, fwd.base_url))
                assert await asyncio.to_thread(policy.state.wait_for_requests, 1, 30)
                await fwd.aclose()  # as the worker does when it is cancelled
                with contextlib.suppress(httpx.HTTPError):
                    await pending
    (exchange,) = seen
    assert exchange.interrupted
    wire = await WireCalls("r1").next(exchange)
    call = wire.call
    assert (call.status, call.incomplete_reason, [a.status for a in call.attempts]) == (
        "incomplete",
        "interrupted",
        ["incomplete"],
    )
    (turn,) = build_turns([wire.turn], [call], wire.tools, final=True)
    assert (turn.model_calls, turn.resolution) == (["r1:m0"], "interrupted")


@pytest.mark.parametrize(
    "messages",
    [
        3,
        [1],
        [{"role": 1}],
        [{"role": "assistant", "tool_calls": 5}],
        [{"role": "assistant", "tool_calls": "ab"}],
        [{"role": "assistant", "tool_calls": [{"id": 1, "function": {}}]}],
        [{"role": "tool", "content": "no call id"}],
        [{"role": "user", "content": [{"type": "input_audio"}]}],
        [{"role": "assistant", "content": {"not": "text"}}],
    ],
)
async def test_a_harness_request_of_any_shape_is_kept_and_read_back_only_when_faithful(messages: Any) -> None:
    body = json.dumps({"model": "m", "messages": messages}).encode()
    answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()
    exchange = WireExchange(
        api="chat",
        request=body,
        status=200,
        content_type="application/json",
        response=answer,
        started_at=1.0,
        first_byte_at=1.5,
        ended_at=2.0,
    )
    wire = await WireCalls("r1").next(exchange)
    assert wire.call.status == "completed" and wire.call.request["messages"] == messages
    assert wire.call.input is None and wire.turn.input == []


async def test_forwarder_refuses_model_calls_past_the_budget_without_forwarding_them(
    policy: PolicyServer,
) -> None:
    refused: list[bool] = []

    async def record(exchange: WireExchange) -> None:
        return None

    spec = spec_for(policy.base_url, max_policy_calls=2)
    async with Forwarder(
        spec, token=TOKEN, on_model_exchange=record, on_refused=lambda: refused.append(True)
    ) as fwd:
        async with httpx.AsyncClient(timeout=30) as client:
            statuses = [(await chat(client, fwd.base_url)).status_code for _ in range(2)]
            third = await chat(client, fwd.base_url)
    assert statuses == [200, 200]
    assert third.status_code == 403 and third.json()["error"]["code"] == BUDGET_CODE
    assert refused == [True] and (fwd.model_calls, fwd.refused) == (2, 1)
    assert len(policy.request_log) == 2


async def test_forwarder_serves_only_the_model_and_tools_and_only_with_the_rollout_token(
    policy: PolicyServer,
) -> None:
    async def record(exchange: WireExchange) -> None:
        return None

    async with Forwarder(spec_for(policy.base_url), token=TOKEN, on_model_exchange=record) as fwd:
        async with httpx.AsyncClient(timeout=30) as client:
            wrong = await chat(client, fwd.base_url, token="guess")
            missing = await chat(client, fwd.base_url, token=None)
            origin = f"http://127.0.0.1:{fwd.port}"
            headers = {"Authorization": f"Bearer {TOKEN}"}
            elsewhere = await client.get(f"{origin}/model/v1/models", headers=headers)
            dotted = await client.post(f"{origin}/v1/%2e%2e/admin", headers=headers)
            no_tool = await client.post(f"{fwd.tools_url}/get_weather", json={}, headers=headers)
    assert (wrong.status_code, missing.status_code) == (401, 401)
    assert (elsewhere.status_code, dotted.status_code, no_tool.status_code) == (404, 404, 404)
    assert policy.request_log == []


# --------------------------------------------------------------------------- the proxy's budget, the journal


class Rig:
    """A forwarder in front of a real egress proxy in front of the scripted policy, with the journal."""

    def __init__(self, proxy: EgressProxy, forwarder: Forwarder, journal: CaptureJournal, root: Path) -> None:
        self.proxy = proxy
        self.forwarder = forwarder
        self.journal = journal
        self.root = root
        self.exchanges: list[WireExchange] = []

    def capture(self) -> list[dict[str, Any]]:
        path = self.root / "model_capture.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
async def rig(policy: PolicyServer, short_dir: Path) -> AsyncIterator[Rig]:
    original = spec_for(policy.base_url, max_policy_calls=8)
    journal = CaptureJournal(short_dir / "checkpoint.jsonl", rollout_id="r1", model_prefix=MODEL_PREFIX)
    await journal.__aenter__()
    proxy = EgressProxy(
        short_dir / "p.sock",
        routes_for(original, model_credential=None, resource_credentials={}),
        capture_path=short_dir / "model_capture.jsonl",
        rollout_id="r1",
        config=ProxyConfig(),
        on_capture=journal.on_capture,
        model_call_limit=2,
    )
    await proxy.__aenter__()
    inside = sandbox_input(original, str(short_dir / "p.sock"))
    exchanges: list[WireExchange] = []

    async def record(exchange: WireExchange) -> None:
        exchanges.append(exchange)

    forwarder = Forwarder(inside, token=TOKEN, on_model_exchange=record)
    await forwarder.__aenter__()
    rig = Rig(proxy, forwarder, journal, short_dir)
    rig.exchanges = exchanges
    try:
        yield rig
    finally:
        await forwarder.aclose()
        await proxy.aclose()
        await journal.aclose()


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), "little")


async def test_the_proxy_refuses_model_calls_past_its_limit_and_they_are_no_model_calls(rig: Rig) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        statuses = [(await chat(client, rig.forwarder.base_url)).status_code for _ in range(3)]
    assert statuses == [200, 200, 403]
    await wait_for_async(lambda: len(rig.capture()) == 3, within_s=30, what="three capture lines")
    refused = rig.capture()[2]
    assert (refused["route"], refused["status"], refused["upstream_url"]) == ("model", 403, None)
    assert "max_policy_calls" in refused["error"]
    # Neither the worker's record nor the journal counts a call that never reached the model.
    assert [x.status for x in rig.exchanges] == [200, 200]
    await wait_for_async(lambda: rig.journal.model_calls == 2, within_s=30, what="two journaled calls")


async def test_the_journal_keeps_model_calls_from_the_capture_and_relayed_tool_calls_in_order(
    rig: Rig,
) -> None:
    read_fd, write_fd = os.pipe()
    pump = asyncio.ensure_future(rig.journal.pump(read_fd))
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            # As an RL harness asks: token ids and log probabilities (vLLM's request fields).
            ask = {"logprobs": True, "return_token_ids": True}
            first = await chat(client, rig.forwarder.base_url, **ask)
            assert first.status_code == 200
            await wait_for_async(lambda: rig.journal.model_calls == 1, within_s=30, what="the first call")
            # The worker relays the end of call_1_0 having seen two model calls; the second is not journaled
            # yet, so the relayed boundary waits for it. It claims to be the supervisor's: it is not.
            done = ToolCall(
                call_id="call_1_0",
                name="python",
                arguments="{}",
                turn=1,
                status="completed",
                output="2",
                started_at=time.time(),
                ended_at=time.time(),
                reported_by="harness",
            )
            record = BoundaryRecord(
                kind="tool_call", at=time.time(), tool_calls=[done], reported_by="supervisor"
            )
            os.write(write_fd, relay_line(record, after=2))
            # Taken off the pipe by the journal's pump, which then holds it for the second call.
            await wait_for_async(lambda: _unread(read_fd) == 0, within_s=30, what="the relayed line read")
            # The harness's next request: its history, the model's tool call (its server id) and the output.
            answer = first.json()["choices"][0]["message"]
            history = [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": answer["tool_calls"]},
                {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "1"},
            ]
            assert (await chat(client, rig.forwarder.base_url, messages=history, **ask)).status_code == 200
        # As the supervisor does: the proxy's last capture journaled, then the relay drained.
        await wait_for_async(lambda: rig.journal.model_calls == 2, within_s=30, what="the second call")
        os.close(write_fd)
        write_fd = -1
        await rig.journal.finish(pump)
    finally:
        if write_fd >= 0:
            os.close(write_fd)
    entries = read_journal(rig.root / "checkpoint.jsonl")
    assert [(e["kind"], e["reported_by"]) for e in entries] == [
        ("start", "supervisor"),
        ("turn_start", "supervisor"),
        ("model_call", "supervisor"),
        ("turn_start", "supervisor"),
        ("model_call", "supervisor"),
        ("tool_call", "harness"),
    ]
    checkpoint = load_checkpoint(rig.root / "checkpoint.jsonl")
    trajectory = checkpoint.trajectory
    assert [(c.id, c.index, c.turn) for c in trajectory.model_calls] == [("r1:m0", 0, 0), ("r1:m1", 1, 1)]
    calls = {c.call_id: c for c in trajectory.tool_calls}
    assert calls["call_0_0"].status == "pending" and calls["call_1_0"].status == "completed"
    # The journal's second request is a delta against the first (O(new content) a line), rebuilt whole.
    assert entries[4].get("deltas")
    assert trajectory.model_calls[1].request["messages"][0]["content"] == "hi"
    for call in trajectory.model_calls:
        # Evidence as RL-grade as the builtin loop's: the wire's attempt, the server's token data
        # (lifted out of the kept response), the chat messages as Responses items.
        (attempt,) = call.attempts
        assert (attempt.status, attempt.http_status) == ("completed", 200)
        assert attempt.started_at == call.started_at and attempt.ended_at == call.ended_at
        assert call.tokens.status == "observed" and call.tokens.generation_token_ids
        assert call.response is not None and "prompt_token_ids" not in call.response
    assert trajectory.model_calls[0].input == [{"type": "message", "role": "user", "content": "hi"}]
    assert [i["type"] for i in trajectory.model_calls[1].input_items()] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    # One turn per model call, owning exactly it; turn 1's question is the tool output, not the history.
    assert [(t.id, t.model_calls, t.resolution) for t in trajectory.turns] == [
        ("r1:t0", ["r1:m0"], "acted"),
        ("r1:t1", ["r1:m1"], "acted"),
    ]
    assert trajectory.turns[1].input == [
        {"type": "function_call_output", "call_id": answer["tool_calls"][0]["id"], "output": "1"}
    ]


# --------------------------------------------------------------------------- events, protocol, projection


async def test_harness_events_are_bounded_and_a_bad_line_is_dropped_not_fatal() -> None:
    reader = asyncio.StreamReader(limit=MAX_EVENT_BYTES + 1)
    good = {"type": "tool_end", "id": "c1", "status": "completed", "output": "ok"}
    reader.feed_data(b"x" * (MAX_EVENT_BYTES + 10) + b"\n")
    reader.feed_data(b'{"type": "tool_end", "id": "c1", "status": "maybe"}\n')
    reader.feed_data(b'{"type": "answer", "text": "42", "reward": 1}\n')
    reader.feed_data(json.dumps(good).encode() + b"\n")
    reader.feed_data(b'{"type": "answer", "text": "cold;sum=42"}')
    reader.feed_eof()
    got = [event async for event in read_events(reader)]
    assert got[:3] == [None, None, None]
    assert [e.model_dump() for e in got[3:] if e is not None] == [
        good,
        {"type": "answer", "text": "cold;sum=42"},
    ]


def test_harness_settings_refuse_what_could_leave_the_workspace_or_the_argv() -> None:
    with pytest.raises(ValueError, match="relative path"):
        CommandHarness(type="command", argv=["agent"], answer_file="../../etc/passwd")
    with pytest.raises(ValueError, match="NUL"):
        CommandHarness(type="command", argv=["agent", "a\0b"])
    with pytest.raises(ValueError, match="absolute path"):
        HarnessEnvironment(python="venv/bin/python", bin="/v/bin", mounts=["/v"])
    with pytest.raises(ValueError, match="absolute path"):
        HarnessEnvironment(python="/v/bin/python", bin="/v/bin", mounts=["/v/../etc"])


def test_a_dataset_row_cannot_choose_what_the_sandbox_mounts(tmp_path: Path) -> None:
    from rollcage.controller._dataset import InvalidRow, iter_dataset

    row = {
        "id": "sneaky",
        "input": "hi",
        "agent": {"harness": {"type": "nooa"}},
        "harness_env": {"python": "/root/.ssh/python", "bin": "/root", "mounts": ["/root"]},
    }
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    (item,) = list(iter_dataset(tmp_path / "d.jsonl"))
    assert isinstance(item, InvalidRow) and "harness_env" in item.reason


def test_a_call_the_harness_made_before_a_model_call_is_projected_before_it() -> None:
    call = ModelCall(
        id="r1:m0",
        index=0,
        turn=0,
        api="chat",
        request={},
        status="completed",
        output=[{"type": "message", "role": "assistant", "content": "hi"}],
        attempts=[CallAttempt(index=0, status="completed", http_status=200, started_at=10.0, ended_at=11.0)],
        started_at=10.0,
        ended_at=11.0,
    )
    prefill = ToolCall(
        call_id="harness_0",
        name="execute_python",
        arguments="{}",
        turn=0,
        status="completed",
        output="inputs",
        started_at=9.0,
        ended_at=9.5,
        origin="harness",
        reported_by="harness",
    )
    items = project_output(Trajectory(model_calls=[call], tool_calls=[prefill]), partial=False)
    assert [item["type"] for item in items] == ["function_call", "function_call_output", "message"]
    # The turn owns the call the harness ran before it, but the model only answered: it did not act.
    start = TurnStart(index=0, id="r1:t0", model_call_id="r1:m0", started_at=9.0, input=[])
    (turn,) = build_turns([start], [call], [prefill], final=True)
    assert (turn.tool_calls, turn.resolution) == (["harness_0"], "answered")
