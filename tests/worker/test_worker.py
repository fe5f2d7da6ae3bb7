"""The worker as a real subprocess against the scripted policy and a real resource server on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage import load_checkpoint
from rollcage import worker as worker_module
from rollcage.durable import read_journal
from rollcage.environments.calc_weather import create_app
from rollcage.policy import PolicyServer
from rollcage.worker import EXIT_CANCELLED, EXIT_INVALID_INPUT, EXIT_OK, EXIT_STOPPED_BEFORE_START
from tests.helpers.worker_env import RolloutDir, serve_asgi, wait_for, worker_input

SMOKE_FC = [
    {
        "tool_calls": [
            {"name": "get_weather", "arguments": {"city": "Oslo"}},
            {"name": "python", "arguments": {"code": "print(sum([40, 2]))"}},
        ]
    },
    {"text": "cold;sum=42"},
]
SMOKE_CODEACT = [
    {"code": "w = get_weather('Oslo')\nprint(w)\ns = sum([40, 2])\ns"},
    {"code": "import json\nsubmit(f\"{json.loads(w)['condition']};sum={s}\")"},
]

PolicyFactory = Callable[..., Any]


@pytest.fixture
def weather_url() -> Iterator[str]:
    with serve_asgi(create_app()) as url:
        yield url


@pytest.fixture
def policy(serve_policy: Callable[..., PolicyServer]) -> PolicyFactory:
    def start(tasks: dict[str, Any], faults: tuple[str, ...] = ()) -> PolicyServer:
        return serve_policy({"tasks": tasks}, faults=list(faults), keep_bodies=True)

    return start


def _no_temp_files(rd: RolloutDir) -> None:
    leftovers = [n for n in rd.listing() if n.endswith(".tmp") or n.startswith(".")]
    assert leftovers == [], leftovers


@pytest.mark.parametrize("mode", ["function_calling", "codeact"])
def test_smoke_task_answers_cold_sum_42(
    mode: str, policy: PolicyFactory, weather_url: str, rollout: RolloutDir
) -> None:
    server = policy({"smoke": SMOKE_FC if mode == "function_calling" else SMOKE_CODEACT})
    rollout.write_input(
        worker_input(model_url=server.base_url, task_id="smoke", resource_url=weather_url, mode=mode)
    )
    assert rollout.run() == EXIT_OK, rollout.log_text()
    result = rollout.result_model()
    assert result.error is None
    assert result.termination_reason == "completed"
    assert result.response is not None and result.response.output_text == "cold;sum=42"
    tools = {c.name: c for c in result.trajectory.tool_calls}
    assert tools["get_weather"].status == "completed"
    assert json.loads(tools["get_weather"].output or "")["condition"] == "cold"
    assert any("42" in (c.output or "") for c in result.trajectory.tool_calls if c.name == "python")
    # The resource's session cookie was kept and reported.
    assert "cw_session" in result.resource_cookies
    assert oct(rollout.result.stat().st_mode & 0o777) == oct(0o600)
    # The journal holds every boundary: start, each model call, each tool completion.
    kinds = [r["kind"] for r in rollout.records()]
    assert kinds.count("model_call") == len(result.trajectory.model_calls) == 2
    assert kinds.count("tool_call") == len(result.trajectory.tool_calls)
    _no_temp_files(rollout)


def test_result_mode_is_configurable(policy: PolicyFactory, rollout: RolloutDir) -> None:
    server = policy({"t": [{"text": "done"}]})
    rollout.write_input({**worker_input(model_url=server.base_url, task_id="t"), "result_mode": 0o640})
    assert rollout.run() == EXIT_OK, rollout.log_text()
    assert rollout.result.stat().st_mode & 0o777 == 0o640


def test_sigterm_while_model_hangs_publishes_cancelled_result_without_response(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    server = policy({"t": [{"text": "never"}]}, faults=("call=1:kind=hang",))
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    rollout.start()
    wait_for(lambda: server.faults_injected, what="the model request to arrive")
    rollout.signal(signal.SIGTERM)
    assert rollout.wait() == EXIT_CANCELLED
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "cancelled"
    assert "SIGTERM" in result.error.message
    assert result.response is None
    assert result.termination_reason == "cancelled"
    _no_temp_files(rollout)


def _start_with_a_sleeping_cell(policy: PolicyFactory, rollout: RolloutDir) -> tuple[int, int]:
    """Start the worker on a cell that sleeps; once the cell runs: (the worker's PID, the cell's)."""
    code = "import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(600)"
    server = policy({"t": [{"tool_calls": [{"name": "python", "arguments": {"code": code}}]}, {"text": "x"}]})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    worker = rollout.start()
    pid_file = rollout.root / "workspace" / "pid"
    cell = wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the cell to start")
    return worker.pid, int(cell)


def test_sigterm_while_tool_runs_cancels_tool_and_stops_executor(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    _, pid = _start_with_a_sleeping_cell(policy, rollout)
    rollout.signal(signal.SIGTERM)
    assert rollout.wait() == EXIT_CANCELLED
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "cancelled"
    (call,) = result.trajectory.tool_calls
    assert call.status == "cancelled"
    assert result.response is not None
    outputs = [i for i in result.response.output if i["type"] == "function_call_output"]
    assert [o["status"] for o in outputs] == ["incomplete"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_the_worker_waits_for_its_executor_without_a_thread_of_its_own(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    # Python 3.11's default child watcher parks a thread in waitpid() for every subprocess.
    worker, _ = _start_with_a_sleeping_cell(policy, rollout)
    tasks = Path(f"/proc/{worker}/task")
    waiting = [t.name for t in tasks.iterdir() if (t / "wchan").read_text().strip() == "do_wait"]
    rollout.signal(signal.SIGTERM)
    assert rollout.wait() == EXIT_CANCELLED
    assert waiting == [], f"threads of the worker blocked in wait(): {waiting}"


def test_the_worker_runs_its_rollout_on_one_thread(policy: PolicyFactory, rollout: RolloutDir) -> None:
    # The rollout waits for each boundary and each blocking call (the executor's sweep, the result
    # published): a thread hop for each cost it more CPU than the call, so the journal writes inline
    # and rollcage.procs runs them on the loop's thread. By the time the second cell runs, the worker
    # has journaled its boundaries and swept the first cell's dead executor.
    sleep = "import os, time\nopen('pid', 'w').write(str(os.getpid()))\ntime.sleep(600)"
    cells = ["import os\nos._exit(3)", sleep]
    turns: list[dict[str, Any]] = [
        {"tool_calls": [{"name": "python", "arguments": {"code": c}}]} for c in cells
    ]
    server = policy({"t": [*turns, {"text": "x"}]})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    worker = rollout.start().pid
    pid_file = rollout.root / "workspace" / "pid"
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), what="the second cell to start")
    threads = sorted(int(t.name) for t in Path(f"/proc/{worker}/task").iterdir())
    rollout.signal(signal.SIGTERM)
    assert rollout.wait() == EXIT_CANCELLED
    assert threads == [worker], f"the worker runs {len(threads)} threads"
    kinds = [r["kind"] for r in read_journal(rollout.root / "checkpoint.jsonl")]
    assert kinds[:4] == ["start", "turn_start", "model_call", "tool_call"], kinds


def test_stop_file_cancels_a_running_rollout(policy: PolicyFactory, rollout: RolloutDir) -> None:
    server = policy({"t": [{"text": "never"}]}, faults=("call=1:kind=hang",))
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    rollout.start()
    wait_for(lambda: server.faults_injected, what="the model request to arrive")
    (rollout.root / "stop").write_text("")
    assert rollout.wait() == EXIT_CANCELLED
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "cancelled"
    assert "stop file" in result.error.message


def test_stop_file_present_at_start_does_nothing(rollout: RolloutDir) -> None:
    rollout.write_input(worker_input(model_url="http://127.0.0.1:9/v1", task_id="t"))
    (rollout.root / "stop").write_text("")
    assert rollout.run() == EXIT_STOPPED_BEFORE_START
    assert not rollout.result.exists()
    assert not rollout.checkpoint.exists()


def test_sigkill_after_k_boundaries_leaves_exactly_those_in_the_checkpoint(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    turns = [
        {"tool_calls": [{"name": "python", "arguments": {"code": "x = 1"}}]},
        {"tool_calls": [{"name": "python", "arguments": {"code": "x += 1\nx"}}]},
        {"text": "never reached"},
    ]
    # The third model request hangs, so the journal is still when we kill:
    # start + 2 x (turn start + model + tool) + the third turn's start = 8.
    server = policy({"t": turns}, faults=("call=3:kind=hang",))
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    rollout.start()
    wait_for(lambda: server.faults_injected, what="the third model request")
    wait_for(lambda: len(rollout.records()) == 8, what="eight durable boundaries")
    assert rollout.proc is not None
    os.killpg(rollout.proc.pid, signal.SIGKILL)
    assert rollout.wait() == -signal.SIGKILL
    assert not rollout.result.exists()
    checkpoint = load_checkpoint(rollout.checkpoint)
    assert checkpoint.partial is True and checkpoint.seq == 8
    assert [c.index for c in checkpoint.trajectory.model_calls] == [0, 1]
    # The call in flight when the worker died left its turn's start: the journal says it was sent.
    turns_seen = checkpoint.trajectory.turns
    assert [t.resolution for t in turns_seen] == ["acted", "acted", "pending"]
    assert turns_seen[2].model_calls == [] and turns_seen[2].input[0]["type"] == "function_call_output"
    assert [c.status for c in checkpoint.trajectory.tool_calls] == ["completed", "completed"]
    assert "2" in (checkpoint.trajectory.tool_calls[1].output or "")
    assert [i["type"] for i in checkpoint.output].count("function_call_output") == 2
    _no_temp_files(rollout)


@pytest.mark.parametrize(
    ("mutate", "named"),
    [
        (lambda d: d.update(expected_answer="cold;sum=42"), "expected_answer"),
        (lambda d: d["agent"].update(max_policy_calls="many"), "agent.max_policy_calls"),
        (lambda d: d.update(surprise=1), "surprise"),
    ],
)
def test_invalid_input_publishes_fatal_result_naming_the_field(
    mutate: Callable[[dict[str, Any]], None], named: str, rollout: RolloutDir
) -> None:
    data = worker_input(model_url="http://127.0.0.1:9/v1", task_id="t")
    mutate(data)
    rollout.write_input(data)
    assert rollout.run() == EXIT_INVALID_INPUT
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "fatal"
    assert named in result.error.message
    assert result.rollout_id == "t-r0"
    assert result.response is None


def test_unparseable_input_publishes_fatal_result(rollout: RolloutDir) -> None:
    rollout.write_input(b"{not json")
    assert rollout.run() == EXIT_INVALID_INPUT
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "fatal"
    assert "input.json" in result.error.message


def test_unreachable_model_is_a_transient_error(rollout: RolloutDir) -> None:
    rollout.write_input(worker_input(model_url="http://127.0.0.1:9/v1", task_id="t"))
    assert rollout.run() == 1
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "transient"
    assert [c.status for c in result.trajectory.model_calls] == ["failed"]


def test_unreachable_resource_is_a_transient_error_not_the_agents(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    server = policy({"smoke": SMOKE_FC})
    rollout.write_input(
        worker_input(model_url=server.base_url, task_id="smoke", resource_url="http://127.0.0.1:9")
    )
    assert rollout.run() == 1, rollout.log_text()
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "transient"
    assert result.error.type == "ResourceUnavailableError"
    weather = next(c for c in result.trajectory.tool_calls if c.name == "get_weather")
    assert weather.status == "incomplete"


def test_failing_checkpoint_appends_do_not_stop_the_run(
    policy: PolicyFactory, rollout: RolloutDir, tmp_path: Path
) -> None:
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)]).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk to test against")
    try:
        # Fill the disk so every append hits ENOSPC.
        with contextlib.suppress(OSError), (mount / "filler").open("wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        server = policy(
            {"t": [{"tool_calls": [{"name": "python", "arguments": {"code": "1 + 1"}}]}, {"text": "2"}]}
        )
        rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
        assert rollout.run("--checkpoint", str(mount / "checkpoint.jsonl")) == EXIT_OK, rollout.log_text()
        result = rollout.result_model()
        assert result.error is None and result.response is not None
        assert result.response.output_text == "2"
        assert result.checkpoint_failures > 0
        assert "checkpoint" in rollout.log_text() and "continuing" in rollout.log_text()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_parallel_tool_calls_each_have_their_own_id_timing_and_output(
    policy: PolicyFactory, weather_url: str, rollout: RolloutDir
) -> None:
    turns = [
        {
            "tool_calls": [
                {"name": "get_weather", "arguments": {"city": "Oslo"}},
                {"name": "get_weather", "arguments": {"city": "Atlantis"}},  # a failing sibling (404)
                {"name": "python", "arguments": {"code": "raise ValueError('boom')"}},
                {"name": "python", "arguments": {"code": "6 * 7"}},
            ]
        },
        {"text": "done"},
    ]
    server = policy({"t": turns})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t", resource_url=weather_url))
    assert rollout.run() == EXIT_OK, rollout.log_text()
    calls = rollout.result_model().trajectory.tool_calls
    assert len({c.call_id for c in calls}) == 4
    assert all(c.ended_at is not None and c.duration_s is not None for c in calls)
    by_output = [c.output or "" for c in calls]
    assert "cold" in by_output[0]
    assert "404" in by_output[1] or "Atlantis" in by_output[1]
    assert "ValueError" in by_output[2] and calls[2].status == "failed"
    assert "42" in by_output[3] and calls[3].status == "completed"
    # The HTTP calls overlapped (run concurrently), the cells took turns on the one executor.
    assert calls[0].started_at < calls[1].ended_at and calls[1].started_at < calls[0].ended_at  # type: ignore[operator]
    assert calls[3].started_at >= calls[2].ended_at  # type: ignore[operator]


def test_model_visible_history_round_trips_through_the_result(
    policy: PolicyFactory, weather_url: str, rollout: RolloutDir
) -> None:
    server = policy({"smoke": SMOKE_FC})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="smoke", resource_url=weather_url))
    assert rollout.run() == EXIT_OK, rollout.log_text()
    from rollcage.protocol import WorkerResult

    result = WorkerResult.model_validate_json(json.dumps(json.loads(rollout.result.read_bytes())))
    sent = [c.request for c in result.trajectory.model_calls]
    received = [r.body for r in server.request_log]
    assert sent == received
    # The second request's history ends with both tool outputs, as the model saw them.
    tail = sent[1]["messages"][-2:]
    assert [m["role"] for m in tail] == ["tool", "tool"]


def test_model_that_never_stops_calling_tools_ends_at_max_policy_calls(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    server = policy({"t": [{"tool_calls": [{"name": "python", "arguments": {"code": "1"}}], "repeat": True}]})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t", max_policy_calls=3))
    assert rollout.run() == EXIT_OK, rollout.log_text()
    result = rollout.result_model()
    assert result.termination_reason == "max_policy_calls"
    assert len(result.trajectory.model_calls) == 3
    assert result.response is not None and result.response.status == "incomplete"
    outputs = [i for i in result.response.output if i["type"] == "function_call_output"]
    assert len(outputs) == len([i for i in result.response.output if i["type"] == "function_call"]) == 3


def test_malformed_tool_arguments_end_as_invalid_policy_output(
    policy: PolicyFactory, rollout: RolloutDir
) -> None:
    server = policy(
        {"t": [{"tool_calls": [{"name": "python", "arguments_raw": "{bad json"}], "repeat": True}]}
    )
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t", max_invalid_outputs=1))
    assert rollout.run() == EXIT_OK, rollout.log_text()
    result = rollout.result_model()
    assert result.termination_reason == "invalid_policy_output"
    assert len(result.trajectory.model_calls) == 2
    assert all(
        c.status == "failed" and "not valid JSON" in (c.output or "") for c in result.trajectory.tool_calls
    )


def _after_warm_up(probe: str) -> str:
    """What ``probe`` prints, run in a fresh interpreter after the template's warm-up."""
    script = f"import sys\nfrom rollcage.worker import warm_up\nwarm_up()\n{probe}"
    return subprocess.run(
        [sys.executable, "-I", "-c", script], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_after_the_templates_warm_up_a_first_http_exchange_costs_what_any_later_one_does() -> None:
    # What h11 builds on first use (typing's unions it casts events to) is built by the template once,
    # not again by every worker it forks: counted in Python calls, the first exchange is a steady one.
    counted = _after_warm_up(
        "from rollcage.http import exchange_in_memory\n"
        "def calls():\n"
        "    n = 0\n"
        "    def count(frame, event, arg):\n"
        "        nonlocal n\n"
        "        n += event == 'call'\n"
        "    sys.setprofile(count)\n"
        "    exchange_in_memory()\n"
        "    sys.setprofile(None)\n"
        "    return n\n"
        "print(calls(), calls())"
    )
    first, later = map(int, counted.split())
    assert first == later > 0, counted


def test_the_templates_warm_up_carries_nothing_its_workers_do_not_run_into_its_forks() -> None:
    # A warm template's heap is copied (its page tables, then the pages written) into every worker:
    # no command-line code, and no httpcore or anyio (plain HTTP to the proxy goes through h11 alone).
    loaded = _after_warm_up(
        "heavy = {'rich', 'click', 'pygments', 'typer', 'yaml', 'starlette', 'uvicorn'}\n"
        "heavy |= {'httpcore', 'anyio'}\n"
        "print(sorted(heavy & {name.split('.')[0] for name in sys.modules}))"
    )
    assert loaded.strip() == "[]"


# A sitecustomize the worker subprocess imports first: it breaks rollcage's own machinery the way a
# record no serialiser can write does (orjson's TypeError for an integer beyond 64 bits).
_SABOTAGE = """
import os

from rollcage import durable, worker

_WHAT = os.environ["ROLLCAGE_TEST_SABOTAGE"]
_append = durable.CheckpointJournal.append
_boundary = worker._Session._boundary


async def append(self, record):
    if record.get("kind") == "model_call":
        raise TypeError("journal record is not JSON-serialisable: Integer exceeds 64-bit range")
    return await _append(self, record)


async def boundary(self, record):
    if record.kind == "model_call" and record.model_call.index == 1:
        raise TypeError("Integer exceeds 64-bit range")
    return await _boundary(self, record)


if _WHAT == "journal":
    durable.CheckpointJournal.append = append
else:
    worker._Session._boundary = boundary
"""


def _sabotaged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SABOTAGE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ROLLCAGE_TEST_SABOTAGE", what)


def test_a_boundary_the_journal_cannot_serialise_is_a_checkpoint_failure_and_the_rollout_goes_on(
    policy: PolicyFactory, rollout: RolloutDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sabotaged(tmp_path, monkeypatch, "journal")
    server = policy(
        {"t": [{"tool_calls": [{"name": "python", "arguments": {"code": "1 + 1"}}]}, {"text": "2"}]}
    )
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    assert rollout.run() == EXIT_OK, rollout.log_text()
    result = rollout.result_model()
    assert result.error is None and result.response is not None and result.response.output_text == "2"
    assert result.checkpoint_failures == 2  # the two model calls' boundaries; the rest are journaled
    assert "not JSON-serialisable" in rollout.log_text() and "Traceback" not in rollout.log_text()
    assert [r["kind"] for r in rollout.records()].count("model_call") == 0


def test_an_unexpected_failure_inside_the_worker_is_infrastructure_never_the_policys(
    policy: PolicyFactory, rollout: RolloutDir, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollcage.supervisor.outcome import OutcomeEvidence, classify_outcome

    _sabotaged(tmp_path, monkeypatch, "boundary")
    server = policy(
        {"t": [{"tool_calls": [{"name": "python", "arguments": {"code": "1 + 1"}}]}, {"text": "2"}]}
    )
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    assert rollout.run() != EXIT_OK
    result = rollout.result_model()
    # After a model response, so a fatal error would have been graded as the policy's agent_error.
    assert result.error is not None and result.error.kind == "transient", result.error
    assert "not the policy's" in result.error.message
    assert len(result.trajectory.model_calls) >= 1
    evidence = OutcomeEvidence(result_present=True, result=result, exit_code=1)
    assert classify_outcome(evidence)[0] == "infra_failure"


def test_the_workers_loop_checks_a_signal_without_an_enum_of_every_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # asyncio's own check calls signal.valid_signals(), which makes a Signals member of each of the
    # platform's signals at every handler added or removed: four a rollout, ~0.35 ms in all.
    def refused() -> set[signal.Signals]:
        raise AssertionError("signal.valid_signals() was called")

    monkeypatch.setattr(signal, "valid_signals", refused)
    loop = worker_module._WorkerLoop()
    try:
        loop.add_signal_handler(signal.SIGUSR1, lambda: None)
        assert loop.remove_signal_handler(signal.SIGUSR1)
        with pytest.raises(ValueError, match="invalid signal number 0"):
            loop.add_signal_handler(0, lambda: None)
        with pytest.raises(TypeError, match="sig must be an int"):
            loop.add_signal_handler("SIGUSR1", lambda: None)  # type: ignore[arg-type]
    finally:
        loop.close()


def test_the_worker_runs_its_rollout_on_its_own_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran_on: list[type[asyncio.AbstractEventLoop]] = []

    async def amain(paths: object) -> int:
        loop = asyncio.get_running_loop()
        # The policy's loop too, as under asyncio.run: Python 3.11's child watcher attaches to that one.
        assert asyncio.get_event_loop_policy().get_event_loop() is loop
        ran_on.append(type(loop))
        return 7

    # Process-wide settings the real worker takes (a child watcher, blocking calls inline): not here.
    monkeypatch.setattr(worker_module, "wait_for_children_by_pidfd", lambda: None)
    monkeypatch.setattr(worker_module, "run_blocking_inline", lambda: None)
    monkeypatch.setattr(worker_module, "_amain", amain)
    assert worker_module.worker_main([str(tmp_path / "input.json"), str(tmp_path / "result.json")]) == 7
    assert ran_on == [worker_module._WorkerLoop]
