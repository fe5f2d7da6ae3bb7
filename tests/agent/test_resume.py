"""Resuming a rollout from an earlier attempt's journal: the real worker, SIGKILLed, then resumed.

Each resume is checked against an uninterrupted run of the same script: the final
trajectory is the same (ids and timings aside), the policy server saw only the
calls after the kill, and the executor's state was rebuilt by re-running cells.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.checkpoint import load_checkpoint
from rollcage.durable import CheckpointJournal
from rollcage.environments.calc_weather import create_app
from rollcage.policy import PolicyServer
from rollcage.protocol import WorkerResult
from tests.helpers.worker_env import RolloutDir, serve_asgi, wait_for, worker_input

CALLS = 5
# Each turn's cell depends on the executor state the earlier cells built: a resume that does not
# restore it prints something else (or fails with a NameError).
FC_TURNS: list[dict[str, Any]] = [
    {"tool_calls": [{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}]},
    {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Oslo"}},
            {"name": "python", "arguments": {"code": "x = x * 10 + 2\nprint(x)"}},
        ]
    },
    {"tool_calls": [{"name": "python", "arguments": {"code": "open('f.txt', 'w').write(str(x))"}}]},
    {"tool_calls": [{"name": "python", "arguments": {"code": "print(open('f.txt').read(), x + 1)"}}]},
    {"text": "x=12"},
]
CODEACT_TURNS: list[dict[str, Any]] = [
    {"code": "w = get_weather('Oslo')\nprint(w)"},
    {"code": "n = len(w)\nprint(n)"},
    {"code": "import json\nsubmit(f\"{json.loads(w)['condition']};{n}\")"},
]
# Agent code whose output differs on every run: replaying it cannot restore the state the model saw.
ND_TURNS: list[dict[str, Any]] = [
    {"tool_calls": [{"name": "python", "arguments": {"code": "x = 1\nprint(x)"}}]},
    {"tool_calls": [{"name": "python", "arguments": {"code": "import os\nprint(os.getpid())"}}]},
    {"tool_calls": [{"name": "python", "arguments": {"code": "print(x)"}}]},
    {"text": "done"},
]
# Two calls in one response: the slow cell is still running when the fast tool call's end is journaled.
PARALLEL_TURNS: list[dict[str, Any]] = [
    {
        "tool_calls": [
            {"name": "python", "arguments": {"code": "import time\ntime.sleep(1.5)\nprint('slept')"}},
            {"name": "get_weather", "arguments": {"city": "Oslo"}},
        ]
    },
    {"text": "done"},
]
SCRIPT = {"tasks": {"fc": FC_TURNS, "ca": CODEACT_TURNS, "nd": ND_TURNS, "par": PARALLEL_TURNS}}


@pytest.fixture(scope="module")
def weather_url() -> Iterator[str]:
    with serve_asgi(create_app()) as url:
        yield url


@pytest.fixture
def policy(serve_policy: Callable[..., PolicyServer]) -> Callable[..., PolicyServer]:
    def start(faults: tuple[str, ...] = ()) -> PolicyServer:
        return serve_policy(SCRIPT, faults=list(faults), keep_bodies=True)

    return start


@pytest.fixture
def dirs(tmp_path: Path) -> Iterator[Callable[[str], RolloutDir]]:
    made: list[RolloutDir] = []

    def make(name: str) -> RolloutDir:
        made.append(RolloutDir(tmp_path / name))
        return made[-1]

    try:
        yield make
    finally:
        for rd in made:
            rd.kill()


def _input(server: PolicyServer, weather: str, task: str, rollout_id: str, **extra: Any) -> dict[str, Any]:
    mode = "codeact" if task == "ca" else "function_calling"
    data = worker_input(model_url=server.base_url, task_id=task, resource_url=weather, mode=mode)
    return {**data, "rollout_id": rollout_id, **extra}


def _run(rd: RolloutDir, data: dict[str, Any]) -> WorkerResult:
    rd.write_input(data)
    code = rd.run()
    assert code == 0, rd.log_text()
    return rd.result_model()


def _kill_at(rd: RolloutDir, server: PolicyServer, data: dict[str, Any], call: int) -> None:
    """Run ``data`` until its ``call``-th model request hangs, then SIGKILL the worker."""
    rd.write_input(data)
    rd.start()
    rollout = data["rollout_id"]
    wait_for(
        lambda: any(f.rollout_id == rollout for f in server.faults_injected), what=f"model request {call}"
    )
    # Every boundary up to the hung call's turn start is durable before the request is sent.
    wait_for(
        lambda: any(r.get("kind") == "turn_start" and r["turn"]["index"] == call - 1 for r in rd.records())
    )
    assert rd.proc is not None
    os.killpg(rd.proc.pid, signal.SIGKILL)
    assert rd.wait() == -signal.SIGKILL


def _resume_into(previous: RolloutDir, rd: RolloutDir) -> None:
    shutil.copyfile(previous.checkpoint, rd.root / "resume.jsonl")


def _kill_then_resume(
    server: PolicyServer, dirs: Callable[[str], RolloutDir], weather: str, task: str, call: int
) -> tuple[WorkerResult, RolloutDir]:
    """Run ``task`` as ``<task>-0`` until its ``call``-th request hangs, SIGKILL it, resume as ``-1``."""
    first, second = dirs("try0"), dirs("try1")
    _kill_at(first, server, _input(server, weather, task, f"{task}-0"), call)
    _resume_into(first, second)
    resume = {"previous_rollout_id": f"{task}-0"}
    return _run(second, _input(server, weather, task, f"{task}-1", resume=resume)), second


def _comparable(result: WorkerResult) -> dict[str, Any]:
    """The result without ids and timings (which differ between attempts by design)."""
    t = result.trajectory
    assert result.response is not None
    return {
        "calls": [
            (c.index, c.turn, c.status, c.request, c.output, c.usage, c.tokens, c.http_status)
            for c in t.model_calls
        ],
        "tools": [(c.call_id, c.name, c.arguments, c.turn, c.status, c.output) for c in t.tool_calls],
        "turns": [(u.index, u.input, u.answer, u.tool_calls, u.tool_steps, u.resolution) for u in t.turns],
        "output": result.response.output,
        "text": result.response.output_text,
        "usage": result.response.usage,
        "termination": result.termination_reason,
    }


@pytest.fixture(scope="module")
def baselines(tmp_path_factory: pytest.TempPathFactory, weather_url: str) -> dict[str, WorkerResult]:
    """Uninterrupted runs of both scripts: what every resume must reproduce."""
    results: dict[str, WorkerResult] = {}
    with PolicyServer(SCRIPT) as server:
        for task in ("fc", "ca"):
            rd = RolloutDir(tmp_path_factory.mktemp("baseline") / task)
            try:
                results[task] = _run(rd, _input(server, weather_url, task, f"{task}-base"))
            finally:
                rd.kill()
    assert results["fc"].response is not None and results["fc"].response.output_text == "x=12"
    return results


@pytest.mark.parametrize("killed_at", range(2, CALLS + 1))
def test_sigkill_after_k_calls_then_resume_equals_an_uninterrupted_run(
    killed_at: int,
    policy: Callable[..., PolicyServer],
    dirs: Callable[[str], RolloutDir],
    weather_url: str,
    baselines: dict[str, WorkerResult],
) -> None:
    server = policy((f"rollout=fc-0:call={killed_at}:kind=hang",))
    first, second = dirs("try0"), dirs("try1")
    _kill_at(first, server, _input(server, weather_url, "fc", "fc-0"), killed_at)
    before = (first.root / "checkpoint.jsonl").read_bytes()
    _resume_into(first, second)
    result = _run(second, _input(server, weather_url, "fc", "fc-1", resume={"previous_rollout_id": "fc-0"}))

    assert _comparable(result) == _comparable(baselines["fc"])
    # The policy server answered only the calls after the kill (the hung one is asked again).
    done = killed_at - 1
    assert server.requests.get("fc-1", 0) == CALLS - done
    resumed = result.trajectory.resumed_from
    assert resumed is not None and result.trajectory.resume_refused is None
    assert resumed.previous_rollout_id == "fc-0"
    assert resumed.replayed_model_calls == [f"fc-1:m{i}" for i in range(done)]
    assert resumed.boundary == load_checkpoint(first.checkpoint).seq
    # Cells were re-run (state restored), the weather call answered from the journal, never re-sent.
    cells = ["call_0_0", "call_1_1", "call_2_0", "call_3_0"][:done]
    assert resumed.rerun_cells == cells
    assert ("call_1_0" in resumed.replayed_tool_calls) == (done >= 2)
    assert [c.id for c in result.trajectory.model_calls] == [f"fc-1:m{i}" for i in range(CALLS)]
    # The earlier attempt's directory is evidence: untouched.
    assert (first.root / "checkpoint.jsonl").read_bytes() == before


def test_a_resumed_rollouts_journal_folds_to_its_result(
    policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], weather_url: str
) -> None:
    """Exactly once: the replayed boundaries are in the new journal once, and resuming from it works too."""
    server = policy(("rollout=fc-0:call=3:kind=hang", "rollout=fc-1:call=2:kind=hang"))
    first, second, third = dirs("try0"), dirs("try1"), dirs("try2")
    _kill_at(first, server, _input(server, weather_url, "fc", "fc-0"), 3)
    _resume_into(first, second)
    # The resumed attempt is killed too, after one call of its own.
    _kill_at(
        second, server, _input(server, weather_url, "fc", "fc-1", resume={"previous_rollout_id": "fc-0"}), 2
    )
    checkpoint = load_checkpoint(second.checkpoint)
    # Two calls replayed, one made (its second request hung): each in the journal once.
    assert [c.id for c in checkpoint.trajectory.model_calls] == ["fc-1:m0", "fc-1:m1", "fc-1:m2"]
    assert checkpoint.trajectory.resumed_from is not None
    assert checkpoint.trajectory.resumed_from.replayed_model_calls == ["fc-1:m0", "fc-1:m1"]
    _resume_into(second, third)
    result = _run(third, _input(server, weather_url, "fc", "fc-2", resume={"previous_rollout_id": "fc-1"}))
    assert server.requests.get("fc-2", 0) == CALLS - 3
    assert len(result.trajectory.model_calls) == CALLS
    final = load_checkpoint(third.checkpoint)
    assert [c.id for c in final.trajectory.model_calls] == [f"fc-2:m{i}" for i in range(CALLS)]
    assert final.output == [i for i in final.output]  # well formed
    assert sum(c.usage.output_tokens or 0 for c in final.trajectory.model_calls) == (
        result.response.usage.output_tokens if result.response is not None else None
    )


def test_codeact_resume_reruns_cells_and_answers_agent_tool_calls_from_the_journal(
    policy: Callable[..., PolicyServer],
    dirs: Callable[[str], RolloutDir],
    weather_url: str,
    baselines: dict[str, WorkerResult],
) -> None:
    server = policy(("rollout=ca-0:call=3:kind=hang",))
    result, _ = _kill_then_resume(server, dirs, weather_url, "ca", 3)
    assert _comparable(result) == _comparable(baselines["ca"])
    assert server.requests.get("ca-1", 0) == 1
    resumed = result.trajectory.resumed_from
    assert resumed is not None
    assert resumed.rerun_cells == ["cell-0-0", "cell-1-0"]
    assert resumed.replayed_tool_calls == ["bridge-0-1"]


def test_a_divergent_replay_falls_back_to_a_fresh_start_and_says_why(
    policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], weather_url: str
) -> None:
    server = policy(("rollout=nd-0:call=3:kind=hang",))
    result, second = _kill_then_resume(server, dirs, weather_url, "nd", 3)
    assert result.trajectory.resumed_from is None
    refused = result.trajectory.resume_refused
    assert refused is not None and "call_1_0" in refused and "diverged" in refused
    assert server.requests.get("nd-1", 0) == 4  # a fresh start: every call sent
    assert result.response is not None and result.response.output_text == "done"
    # The fresh start's journal holds it once: no replayed boundary was kept.
    folded = load_checkpoint(second.checkpoint).trajectory
    assert [c.id for c in folded.model_calls] == [f"nd-1:m{i}" for i in range(4)]
    assert [c.call_id for c in folded.tool_calls] == ["call_0_0", "call_1_0", "call_2_0"]
    assert folded.resumed_from is None


def _journal(path: Path, records: list[dict[str, Any]]) -> None:
    """Write records as the worker does (checksummed lines): the content, not the framing, is bad."""

    async def write() -> None:
        async with CheckpointJournal(path) as journal:
            for record in records:
                await journal.append(record)

    asyncio.run(write())


_START = {"kind": "start", "at": 1.0, "schema_version": 2, "rollout_id": "fc-0"}
_TURN = {"index": 0, "id": "fc-0:t0", "model_call_id": "fc-0:m0", "started_at": 1.0, "input": []}


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda p: None, "empty"),
        (lambda p: p.write_bytes(b""), "empty"),
        (lambda p: _journal(p, [{**_START, "rollout_id": "other"}]), "written by attempt"),
        (lambda p: p.write_bytes(b"garbage\n" * 3), "unusable"),
        (lambda p: _journal(p, [_START, {"kind": "bogus", "at": 1.0}]), "unusable"),
        (lambda p: _journal(p, [{**_START, "schema_version": 1}]), "unusable"),
        (
            lambda p: _journal(p, [_START, {"kind": "turn_start", "at": 1.0, "turn": {**_TURN, "id": "x"}}]),
            "order",
        ),
        (
            lambda p: _journal(p, [_START, {"kind": "turn_start", "at": 1.0, "turn": _TURN}]),
            "nothing to resume",
        ),
        (lambda p: os.mkfifo(p), "cannot be read"),
    ],
    ids=[
        "missing",
        "empty",
        "other-attempt",
        "damaged",
        "not-a-boundary",
        "old-schema",
        "bad-ids",
        "no-call",
        "fifo",
    ],
)
def test_an_unusable_journal_starts_fresh_with_the_reason(
    make: Callable[[Path], None],
    reason: str,
    policy: Callable[..., PolicyServer],
    dirs: Callable[[str], RolloutDir],
    weather_url: str,
) -> None:
    server = policy()
    rd = dirs("try1")
    make(rd.root / "resume.jsonl")
    result = _run(rd, _input(server, weather_url, "fc", "fc-1", resume={"previous_rollout_id": "fc-0"}))
    assert result.response is not None and result.response.output_text == "x=12"
    assert result.trajectory.resume_refused is not None and reason in result.trajectory.resume_refused
    assert server.requests.get("fc-1", 0) == CALLS


def _rename_call_ids(record: dict[str, Any]) -> None:
    if record.get("kind") == "model_call":
        for item in record["model_call"]["output"]:
            if item.get("type") == "function_call":
                item["call_id"] = "call_0_0"  # every call claims the first call's id


def _move_tool_to_no_call(record: dict[str, Any]) -> None:
    for tool in record.get("tool_calls", []):
        tool["turn"] = 99


def _rename_model_call(record: dict[str, Any]) -> None:
    if record.get("kind") == "model_call" and record["model_call"]["index"] == 1:
        record["model_call"]["id"] = "elsewhere:m1"


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (_rename_call_ids, "tool-call ids"),
        (_move_tool_to_no_call, "belongs to no model call"),
        (_rename_model_call, "out of order"),
    ],
    ids=["duplicate-tool-ids", "orphan-tool", "foreign-call-id"],
)
def test_an_inconsistent_journal_from_a_real_run_starts_fresh(
    mutate: Callable[[dict[str, Any]], None],
    reason: str,
    policy: Callable[..., PolicyServer],
    dirs: Callable[[str], RolloutDir],
    weather_url: str,
) -> None:
    """Well-framed lines, checksums right, content the loop never writes: evidence that is refused."""
    server = policy(("rollout=fc-0:call=4:kind=hang",))
    first, second = dirs("try0"), dirs("try1")
    _kill_at(first, server, _input(server, weather_url, "fc", "fc-0"), 4)
    records = [{k: v for k, v in r.items() if k != "seq"} for r in first.records()]
    for record in records:
        mutate(record)
    _journal(second.root / "resume.jsonl", records)
    result = _run(second, _input(server, weather_url, "fc", "fc-1", resume={"previous_rollout_id": "fc-0"}))
    assert result.response is not None and result.response.output_text == "x=12"
    assert result.trajectory.resume_refused is not None and reason in result.trajectory.resume_refused
    assert server.requests.get("fc-1", 0) == CALLS


def test_a_sibling_call_the_journal_holds_ended_is_not_resent_when_another_was_in_flight(
    policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], weather_url: str
) -> None:
    server = policy()
    first, second = dirs("try0"), dirs("try1")
    first.write_input(_input(server, weather_url, "par", "par-0"))
    first.start()
    # The weather call ended (journaled) while the cell still sleeps: kill then.
    wait_for(
        lambda: any(
            t["call_id"] == "call_0_1"
            for r in first.records()
            for t in r.get("tool_calls", [])
            if t["status"] == "completed"
        ),
        what="the weather call's end in the journal",
    )
    assert first.proc is not None
    os.killpg(first.proc.pid, signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    _resume_into(first, second)
    result = _run(
        second, _input(server, weather_url, "par", "par-1", resume={"previous_rollout_id": "par-0"})
    )
    resumed = result.trajectory.resumed_from
    assert resumed is not None
    # The cell that was in flight ran for real; its sibling was answered from the journal.
    assert resumed.replayed_tool_calls == ["call_0_1"] and resumed.rerun_cells == []
    assert [c.status for c in result.trajectory.tool_calls] == ["completed", "completed"]
    assert server.requests.get("par-1", 0) == 1


@pytest.mark.parametrize("make", ["garbage", "diverges"])
def test_a_strict_resume_a_branch_asks_for_ends_with_the_reason_never_a_fresh_start(
    make: str, policy: Callable[..., PolicyServer], dirs: Callable[[str], RolloutDir], weather_url: str
) -> None:
    server = policy(("rollout=nd-0:call=3:kind=hang",))
    rd = dirs("try1")
    if make == "garbage":
        (rd.root / "resume.jsonl").write_bytes(b"garbage\n" * 3)
    else:
        first = dirs("try0")
        _kill_at(first, server, _input(server, weather_url, "nd", "nd-0"), 3)
        _resume_into(first, rd)
    rd.write_input(
        _input(server, weather_url, "nd", "nd-1", resume={"previous_rollout_id": "nd-0", "strict": True})
    )
    assert rd.run() != 0, rd.log_text()
    result = rd.result_model()
    assert result.error is not None and (result.error.kind, result.error.type) == (
        "transient",
        "BranchReplayError",
    )
    assert ("unusable" if make == "garbage" else "diverged") in result.error.message
    assert result.trajectory.resume_refused is not None and not result.trajectory.model_calls
    assert server.requests.get("nd-1", 0) == 0  # nothing was asked: no fresh start
