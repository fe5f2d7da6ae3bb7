"""Hostile model servers through the whole rollout: real supervisor, real bubblewrap, real worker.

One seeded scripted policy server plays, per rollout, one bad behaviour of each
family (``rollcage.policy._hostile`` and the content kinds), in both API styles,
streamed and not, almost always *after* the first model response, where a
misclassification would blame the policy. All rollouts run once, batched, in a
module fixture; each test then asserts one thing of every case:

* the outcome class: a broken or refusing server is ``infra_failure`` (retried,
  never graded), a server that merely spells things oddly gives ``completed``;
* the worker never exits with a traceback (``worker.log``);
* the capture has exactly one line per exchange the server saw.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rollcage.durable import read_journal
from rollcage.policy import PolicyServer
from rollcage.protocol import SupervisorReceipt, WorkerResult
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import requires_bwrap

SCRIPT = {
    "tasks": {
        "t": [
            {
                "reasoning": "compute",
                "tool_calls": [{"name": "python", "arguments": {"code": "print(40 + 2)"}}],
            },
            {"tool_calls": [{"name": "python", "arguments": {"code": "print('again, and again')"}}]},
            {"text": "42"},
        ]
    }
}
SEED = 20240611
CONCURRENCY = 4


@dataclass(frozen=True)
class Case:
    """One rollout: which fault (rule without its rollout= part), where, and what must come of it."""

    name: str
    fault: str | None
    api: str
    stream: bool
    outcome: str
    termination: str | None = None
    model: dict[str, Any] = field(default_factory=dict)
    agent: dict[str, Any] = field(default_factory=dict)


CASES = [
    Case("clean", None, "chat", False, "completed", "completed"),
    # ids: missing or reused, in every turn
    Case("no-ids-chat", "kind=no_ids", "chat", False, "completed", "completed"),
    Case("no-ids-responses-stream", "kind=no_ids", "responses", True, "completed", "completed"),
    Case("reused-ids-chat-stream", "kind=reused_ids", "chat", True, "completed", "completed"),
    Case("reused-ids-responses", "kind=reused_ids", "responses", False, "completed", "completed"),
    # wrong JSON types, after the first response (the variant is drawn from the seed and the call)
    *(
        Case(
            f"wrong-types-{api}-{'stream' if stream else 'plain'}",
            "call=2-9:kind=wrong_types",
            api,
            stream,
            "infra_failure",
        )
        for api in ("chat", "responses")
        for stream in (False, True)
    ),
    # event-stream framing: broken, and legal but unusual
    Case("bad-sse-chat", "call=2-9:kind=bad_sse", "chat", True, "infra_failure"),
    Case("bad-sse-responses", "call=2-9:kind=bad_sse", "responses", True, "infra_failure"),
    Case("odd-sse-chat", "kind=odd_sse", "chat", True, "completed", "completed"),
    Case("odd-sse-responses", "kind=odd_sse", "responses", True, "completed", "completed"),
    # an answer with no answer in it: only [DONE], in_progress
    Case("done-only-chat", "call=2-9:kind=no_answer", "chat", True, "infra_failure"),
    Case("no-answer-responses", "call=2-9:kind=no_answer", "responses", False, "infra_failure"),
    # lying content types
    Case("lying-type-stream", "call=2-9:kind=lying_type", "chat", True, "infra_failure"),
    Case("lying-type-plain", "kind=lying_type", "responses", False, "completed", "completed"),
    # trickled bytes: within the timeout, and past it
    Case("trickle", "call=2:kind=trickle:delay=0.5", "responses", True, "completed", "completed"),
    Case(
        "trickle-past-timeout",
        "call=2-9:kind=trickle:delay=30",
        "chat",
        False,
        "infra_failure",
        model={"timeout_s": 1.5},
    ),
    # huge arguments: past the client's bound, and within it
    Case(
        "huge-arguments",
        "call=2-9:kind=huge_arguments:size=2097152",
        "chat",
        False,
        "infra_failure",
        model={"max_response_bytes": 1048576},
    ),
    Case(
        "big-arguments", "call=2:kind=huge_arguments:size=65536", "responses", True, "completed", "completed"
    ),
    # many calls in one response; calls of a tool that does not exist
    Case("many-calls", "call=1:kind=many_calls:count=10000", "chat", False, "completed", "max_tool_calls"),
    Case(
        "unknown-tool",
        "kind=unknown_tool",
        "responses",
        False,
        "completed",
        "invalid_policy_output",
        agent={"max_invalid_outputs": 1},
    ),
    # nesting too deep to keep
    Case("deep", "call=2-9:kind=deep", "chat", True, "infra_failure"),
    # credentials refused after the first response: infrastructure, never the policy's fault
    Case("http-401", "call=2-9:status=401", "chat", False, "infra_failure"),
    Case("http-403-stream", "call=2-9:status=403", "responses", True, "infra_failure"),
    Case(
        "failed-invalid-api-key",
        "call=2-9:kind=failed:code=invalid_api_key",
        "responses",
        False,
        "infra_failure",
    ),
    Case(
        "stream-error-invalid-api-key",
        "call=2-9:kind=failed:code=invalid_api_key",
        "chat",
        True,
        "infra_failure",
    ),
]


@dataclass
class Ran:
    """A finished case: its directory, receipt, and what the server saw of it."""

    case: Case
    root: Path
    receipt: SupervisorReceipt
    requests: int

    def result(self) -> WorkerResult:
        return WorkerResult.model_validate_json((self.root / "result.json").read_bytes())

    def capture(self) -> list[dict[str, Any]]:
        lines = (self.root / "model_capture.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


def _input(case: Case, model_url: str) -> dict[str, Any]:
    return {
        "rollout_id": case.name,
        "task_id": "t",
        "input": "What is 40 + 2?",
        "model": {
            "base_url": model_url,
            "model": "scripted",
            "api": case.api,
            "stream": case.stream,
            "timeout_s": 20,
            "max_retries": 1,
            "retry_backoff_s": 0,
            **case.model,
        },
        "agent": {"max_tool_calls": 8, "tool_timeout_s": 20, **case.agent},
        "tools": [{"type": "python"}],
    }


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Ran]]:
    base = tmp_path_factory.mktemp("hostile")
    rules = [f"rollout={case.name}:{case.fault}" for case in CASES if case.fault]
    config = SupervisorConfig(deadline_s=90, grace_s=2, sandbox=BwrapSandbox())

    async def run_all(server: PolicyServer) -> dict[str, Ran]:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def one(case: Case) -> Ran:
            root = base / case.name
            (root / "workspace").mkdir(parents=True)
            (root / "input.json").write_text(json.dumps(_input(case, server.base_url)))
            async with gate:
                receipt = await supervise(root, config)
            return Ran(case, root, receipt, server.state.requests_by_rollout.get(case.name, 0))

        done = await asyncio.gather(*(one(case) for case in CASES))
        return {item.case.name: item for item in done}

    with PolicyServer(SCRIPT, faults=rules, seed=SEED) as server:
        yield asyncio.run(run_all(server))


_bwrap = pytest.mark.bwrap
_requires = requires_bwrap()


@_bwrap
@_requires
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_hostile_behaviour_gets_its_outcome_class(ran: dict[str, Ran], case: Case) -> None:
    item = ran[case.name]
    assert item.receipt.outcome == case.outcome, item.receipt.outcome_reason
    assert item.requests >= 1, "the worker never reached the model"
    result = item.result()
    if case.termination is not None:
        assert result.termination_reason == case.termination, result.error
    if case.outcome == "infra_failure":
        # Refused after a good first response: that is exactly where blaming the policy would happen.
        assert result.error is not None and result.error.kind == "transient", result.error
        assert any(call.status != "failed" for call in result.trajectory.model_calls)


@_bwrap
@_requires
@pytest.mark.timeout(600)
def test_the_worker_never_exits_with_a_traceback(ran: dict[str, Ran]) -> None:
    logged = {name: (item.root / "worker.log").read_text(errors="replace") for name, item in ran.items()}
    assert [name for name, text in logged.items() if "Traceback" in text] == []


@_bwrap
@_requires
@pytest.mark.timeout(600)
def test_tool_call_ids_are_unique_and_the_servers_ids_are_kept(ran: dict[str, Ran]) -> None:
    for name in ("no-ids-chat", "no-ids-responses-stream", "reused-ids-chat-stream", "reused-ids-responses"):
        calls = ran[name].result().trajectory.tool_calls
        assert len(calls) == 2 and len({call.call_id for call in calls}) == 2, name
        expected = None if name.startswith("no-ids") else "call_reused"
        assert {call.server_call_id for call in calls} == {expected}, name


@_bwrap
@_requires
@pytest.mark.timeout(600)
def test_a_response_with_10000_calls_costs_one_journal_record(ran: dict[str, Ran]) -> None:
    records = read_journal(ran["many-calls"].root / "checkpoint.jsonl")
    assert [record["kind"] for record in records] == ["start", "turn_start", "model_call"]
    assert len(records[2]["tool_calls"]) == 10_000


@_bwrap
@_requires
@pytest.mark.timeout(600)
def test_every_exchange_has_exactly_one_capture_line(ran: dict[str, Ran]) -> None:
    """Needs the egress proxy to write its line even when the client resets mid-answer."""
    mismatched = {
        name: (len([line for line in item.capture() if line["route"] == "model"]), item.requests)
        for name, item in ran.items()
    }
    assert {name: counts for name, counts in mismatched.items() if counts[0] != counts[1]} == {}


@_bwrap
@_requires
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["clean", "reused-ids-responses", "odd-sse-chat"])
def test_show_finds_the_real_capture_agrees_with_a_clean_trajectory(ran: dict[str, Ran], name: str) -> None:
    from rollcage.viewer import load_rollout

    view = load_rollout(ran[name].root)
    assert view.capture is not None and view.capture.captured == ran[name].requests
    assert view.capture.agrees, [difference.summary for difference in view.capture.differences]
