"""The supervisor: one deadline, stops, process-tree reaping, result collection, receipts and outcomes.

Real processes and real files throughout; the worker is the fake in
``tests/helpers/fake_worker.py`` (or the real one, where the test says so).
Tests wait on files and processes, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rollcage.durable import is_temp_artifact
from rollcage.errors import ConfigError, SandboxError
from rollcage.procs import PidHandle, ensure_subreaper, is_subreaper, read_proc
from rollcage.protocol import RunnerError, SupervisorReceipt, WorkerResult
from rollcage.supervisor import (
    BwrapSandbox,
    NoSandbox,
    OutcomeEvidence,
    SupervisorConfig,
    classify_outcome,
    kill_leftovers,
    supervise,
)
from tests.helpers.supervisor_env import (
    HELPERS,
    config,
    fake,
    make_rollout,
    processes_with_token,
    requires_bwrap,
)
from tests.helpers.waiting import alive, processes_mentioning, wait_for, wait_for_async

SANDBOXES = [
    pytest.param("none", id="none"),
    pytest.param("bwrap", id="bwrap", marks=[requires_bwrap(), pytest.mark.bwrap]),
]
DESIGN_FILES = {
    "checkpoint.jsonl",
    "input.json",
    "model_capture.jsonl",
    "receipt.json",
    "result.json",
    "worker.log",
}


async def wait_file(path: Path, within_s: float = 30.0) -> None:
    """Wait until ``path`` exists (polling a file is the only way to hear from a sandboxed process)."""
    await wait_for_async(path.exists, within_s=within_s, what=f"{path} to exist")


def wait_started(root: Path, proc: subprocess.Popen[str]) -> None:
    """Wait until the fake worker has started; fail at once if the supervisor exited instead."""

    def started() -> bool:
        assert proc.poll() is None, "the supervisor exited before the worker started"
        return (root / "workspace" / "started").exists()

    wait_for(started, what="the worker to start")


def receipt_on_disk(root: Path) -> SupervisorReceipt:
    return SupervisorReceipt.model_validate_json((root / "receipt.json").read_bytes())


@pytest.fixture(autouse=True)
def _no_strays() -> Any:
    """Every test must leave no supervised process behind."""
    yield
    assert processes_with_token() == [], "a supervised process outlived its test"


# --------------------------------------------------------------------------- outcome rules (pure)


def _result(*, error: RunnerError | None, responses: int = 0) -> WorkerResult:
    calls = [
        {
            "id": f"r:m{i}",
            "index": i,
            "turn": i,
            "api": "chat",
            "request": {},
            "response": {"id": str(i)},
            "status": "completed",
            "attempts": [{"index": 0, "status": "completed", "started_at": 1.0, "ended_at": 2.0}],
            "started_at": 1.0,
            "ended_at": 2.0,
        }
        for i in range(responses)
    ]
    return WorkerResult.model_validate(
        {
            "rollout_id": "r",
            "task_id": "t",
            "response": None,
            "trajectory": {"model_calls": calls},
            "termination_reason": "completed" if error is None else "error",
            "error": None if error is None else error.model_dump(),
            "started_at": 1.0,
            "ended_at": 2.0,
        }
    )


FATAL = RunnerError(kind="fatal", type="FatalModelError", message="401 from the endpoint")
TRANSIENT = RunnerError(kind="transient", type="TransientModelError", message="503")
CANCELLED = RunnerError(kind="cancelled", type="CancelledError", message="SIGTERM")


@pytest.mark.parametrize(
    ("evidence", "outcome", "words"),
    [
        pytest.param(
            OutcomeEvidence(exit_code=0, result_present=True, result=_result(error=None)),
            "completed",
            "valid result",
            id="valid-result-completed",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=1, result_present=True, result=_result(error=FATAL, responses=1)),
            "agent_error",
            "after 1 model response",
            id="fatal-after-response-agent-error",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=1, result_present=True, result=_result(error=FATAL)),
            "infra_failure",
            "before the first model response: FatalModelError: 401 from the endpoint",
            id="fatal-before-response-infra-with-message",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=1, result_present=True, result=_result(error=TRANSIENT, responses=3)),
            "infra_failure",
            "transient",
            id="transient-infra",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=143, result_present=True, result=_result(error=CANCELLED)),
            "infra_failure",
            "without a stop from the supervisor",
            id="self-cancelled-infra",
        ),
        pytest.param(
            # Under bwrap the worker's own exit with 128 + SIGTERM, after its result, reads as the signal.
            OutcomeEvidence(
                stop_cause="stop",
                exit_signal="SIGTERM",
                signals_sent=("SIGTERM",),
                result_present=True,
                result=_result(error=CANCELLED),
            ),
            "cancelled",
            "stopped on request; its result (error kind 'cancelled') is kept",
            id="stop-with-a-published-cancelled-result-cancelled",
        ),
        pytest.param(
            OutcomeEvidence(exit_signal="SIGTERM", result_present=True, result=_result(error=CANCELLED)),
            "infra_failure",
            "SIGTERM, which the supervisor did not send (OOM killer, preemption, another process); "
            "its result (error kind 'cancelled') is kept",
            id="foreign-sigterm-with-a-published-cancelled-result-infra",
        ),
        pytest.param(
            OutcomeEvidence(stop_cause="deadline", deadline_s=5, exit_code=143, signals_sent=("SIGTERM",)),
            "timeout",
            "deadline of 5s",
            id="deadline-timeout",
        ),
        pytest.param(
            OutcomeEvidence(
                stop_cause="deadline",
                exit_code=0,
                result_present=True,
                result=_result(error=None, responses=1),
            ),
            "timeout",
            "not graded",
            id="deadline-beats-a-valid-result",
        ),
        pytest.param(
            OutcomeEvidence(stop_cause="stop", exit_signal="SIGKILL", signals_sent=("SIGTERM", "SIGKILL")),
            "cancelled",
            "stopped on request",
            id="stop-cancelled",
        ),
        pytest.param(
            OutcomeEvidence(exit_signal="SIGKILL", result_present=True, result=_result(error=None)),
            "infra_failure",
            "SIGKILL, which the supervisor did not send",
            id="foreign-sigkill-infra-even-with-result",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=0),
            "infra_failure",
            "protocol violation",
            id="exit-0-no-result-protocol-violation",
        ),
        pytest.param(
            OutcomeEvidence(
                exit_code=0,
                result_present=True,
                result_problem="result.json could not be kept: no space left",
                budget_exceeded="workspace_bytes: ...",
                journal_responses=3,
                evidence_problem="the workspace could not be copied back (the disk is full: ...)",
            ),
            "infra_failure",
            "infrastructure failure after the worker ended: the workspace could not be copied back",
            id="evidence-not-kept-is-infra-not-the-workers",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=2, log_tail="Traceback: boom"),
            "infra_failure",
            "no result.json: the worker exited with code 2; worker.log ends with: Traceback: boom",
            id="no-result-nonzero",
        ),
        pytest.param(
            OutcomeEvidence(exit_code=0, result_present=True, result_problem="not JSON"),
            "infra_failure",
            "invalid (not JSON)",
            id="invalid-result",
        ),
        pytest.param(
            OutcomeEvidence(setup_failure="the worker was not started: input.json is invalid"),
            "infra_failure",
            "input.json is invalid",
            id="setup-failure",
        ),
    ],
)
def test_outcome_rules(evidence: OutcomeEvidence, outcome: str, words: str) -> None:
    got, reason = classify_outcome(evidence)
    assert got == outcome, reason
    assert words in reason


def test_a_checkpoint_alone_is_never_a_result() -> None:
    # Whatever the journal holds, no result.json means no gradable outcome.
    for code in (0, 1, None):
        outcome, _ = classify_outcome(OutcomeEvidence(exit_code=code, result_present=False))
        assert outcome == "infra_failure"


# --------------------------------------------------------------------------- lifecycle


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_completed_rollout_collects_result_and_writes_receipt_last(
    tmp_path: Path, sandbox: str
) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config(sandbox, *fake("ok")))
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt == receipt_on_disk(root)
    assert {p.name for p in root.iterdir()} == DESIGN_FILES | {"workspace"}
    assert WorkerResult.model_validate_json((root / "result.json").read_bytes()).error is None
    assert receipt.result_present and receipt.result_valid and receipt.cleanup_confirmed
    assert receipt.last_checkpoint_seq == 1
    assert receipt.sandbox == sandbox and receipt.exit_code == 0 and receipt.signals_sent == []
    assert receipt.model_calls_captured == 0
    last = max(p.stat().st_mtime_ns for p in root.iterdir() if p.name != "receipt.json")
    assert (root / "receipt.json").stat().st_mtime_ns >= last
    assert is_subreaper()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
@pytest.mark.parametrize("ignore_term", [False, True], ids=["daemon", "daemon-ignoring-sigterm"])
async def test_detached_daemon_does_not_outlive_the_rollout(
    tmp_path: Path, sandbox: str, ignore_term: bool
) -> None:
    root = make_rollout(tmp_path)
    args = ("ignore-term",) if ignore_term else ()
    receipt = await supervise(root, config(sandbox, *fake("daemon", *args)))
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.cleanup_confirmed
    assert processes_with_token() == []
    if sandbox == "none":
        # Not a child of the worker any more (setsid + double fork): found through the subreaper.
        pid = int((root / "workspace" / "daemon.pid").read_text())
        info = read_proc(pid)
        assert info is None or not info.alive
        assert receipt.descendants_killed == 1
        assert [(s.signal, s.target, s.reason) for s in receipt.signals_sent] == [
            ("SIGKILL", "descendants", "cleanup")
        ]


@pytest.mark.timeout(60)
async def test_deadline_while_the_model_hangs_times_out_and_keeps_the_cancelled_result(
    tmp_path: Path,
) -> None:
    """The real worker, the scripted policy hanging on its first call, under bwrap where it is usable."""
    from rollcage.policy import PolicyServer
    from tests.helpers.supervisor_env import bwrap_usable
    from tests.helpers.worker_env import worker_input

    sandbox = BwrapSandbox() if bwrap_usable() is None else NoSandbox()
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        root = tmp_path / "r"
        root.mkdir()
        (root / "workspace").mkdir()
        (root / "input.json").write_text(json.dumps(worker_input(model_url=server.base_url, task_id="t")))
        deadline, grace = 10.0, 5.0
        cfg = SupervisorConfig(deadline_s=deadline, grace_s=grace, sandbox=sandbox)
        started = time.monotonic()
        receipt = await supervise(root, cfg)
        took = time.monotonic() - started
        assert server.faults_injected, "the model request never arrived: the worker did not get that far"
    assert receipt.outcome == "timeout", receipt.outcome_reason
    assert receipt.deadline_fired and not receipt.stop_requested
    assert deadline <= took <= deadline + grace + 3.0
    assert [(s.signal, s.target, s.reason) for s in receipt.signals_sent] == [
        ("SIGTERM", "group", "deadline")
    ]
    result = WorkerResult.model_validate_json((root / "result.json").read_bytes())
    assert result.error is not None and result.error.kind == "cancelled" and result.response is None
    assert receipt.result_valid and receipt.result_error == result.error
    assert receipt.cleanup_confirmed
    assert receipt.model_calls_captured == 1
    (capture,) = [json.loads(line) for line in (root / "model_capture.jsonl").read_text().splitlines()]
    assert capture["route"] == "model" and capture["status"] is None and "closed" in capture["error"]


@pytest.mark.timeout(60)
@pytest.mark.bwrap
@requires_bwrap()
async def test_the_deadline_signal_does_not_wait_for_a_blocked_thread_pool(tmp_path: Path) -> None:
    """Slow fsyncs can fill the default executor; the deadline's SIGTERM must not queue behind them."""
    root = make_rollout(tmp_path)
    job = asyncio.ensure_future(supervise(root, config("bwrap", *fake("hang"), deadline_s=3, grace_s=5)))
    release = threading.Event()
    loop = asyncio.get_running_loop()
    try:
        await wait_file(root / "workspace" / "started")
        # More blocked calls than the default executor has threads: nothing else runs there.
        blockers = [loop.run_in_executor(None, release.wait, 60) for _ in range(64)]
        # The hang worker publishes its cancelled result when SIGTERM arrives, in its staged /rollout.
        private = Path(json.loads((root / ".sandbox" / "budgets.json").read_text())["private_dir"])
        await wait_file(private / "root" / "result.json", within_s=20)
    finally:
        release.set()
    await asyncio.gather(*blockers)
    receipt = await job
    assert receipt.outcome == "timeout" and receipt.result_valid
    assert [(s.signal, s.target, s.reason) for s in receipt.signals_sent] == [
        ("SIGTERM", "group", "deadline")
    ]


def test_a_process_group_is_signalled_whole_through_its_leaders_pidfd() -> None:
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 60 & sleep 60 & wait"], start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        members = wait_for(
            lambda: [p for p in processes_in_group(leader.pid) if p != leader.pid] or None,
            what="the group's members",
        )
        info = read_proc(leader.pid)
        assert info is not None
        handle = PidHandle.open(info)
        assert handle is not None
        try:
            sent = handle.send_group(signal.SIGTERM)
        finally:
            handle.close()
        if sent is None:
            pytest.skip("optional: pidfd_send_signal(PIDFD_SIGNAL_PROCESS_GROUP) needs Linux 6.9")
        assert sent is True
        assert leader.wait(timeout=10) == -signal.SIGTERM
        wait_for(lambda: not any(alive(pid) for pid in members), what="every member to die")
    finally:
        if leader.poll() is None:
            os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()


def processes_in_group(pgid: int) -> list[int]:
    from rollcage.procs import scan_processes

    return [info.pid for info in scan_processes().values() if info.pgid == pgid and info.alive]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path, sandbox: str) -> None:
    root = make_rollout(tmp_path)
    # A worker that ignores SIGTERM and never exits by itself (its cwd is the workspace).
    command = ["/bin/sh", "-c", "trap '' TERM; : > started; while :; do sleep 1; done", "sh"]
    stop = asyncio.Event()
    task = asyncio.create_task(supervise(root, config(sandbox, *command, grace_s=0.5), stop=stop))
    await wait_file(root / "workspace" / "started")
    stop.set()
    receipt = await asyncio.wait_for(task, 30)
    assert receipt.outcome == "cancelled", receipt.outcome_reason
    assert [(s.signal, s.reason) for s in receipt.signals_sent] == [
        ("SIGTERM", "stop"),
        ("SIGKILL", "grace_expired"),
    ]
    assert receipt.exit_signal == "SIGKILL" and receipt.cleanup_confirmed
    sigterm, sigkill = receipt.signals_sent
    assert sigkill.at - sigterm.at >= 0.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_worker_killed_by_someone_else_is_infra_failure_and_the_checkpoint_is_kept(
    tmp_path: Path, sandbox: str
) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config(sandbox, *fake("self-kill")))
    assert receipt.outcome == "infra_failure"
    assert "SIGKILL, which the supervisor did not send" in receipt.outcome_reason
    assert receipt.exit_signal == "SIGKILL" and receipt.signals_sent == []
    assert not receipt.result_present
    assert receipt.last_checkpoint_seq == 2
    assert (root / "checkpoint.jsonl").read_text().count("\n") == 2


@pytest.mark.timeout(60)
async def test_worker_sigkilled_from_outside_is_infra_failure(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    task = asyncio.create_task(supervise(root, config("none", *fake("hang"))))
    started = root / "workspace" / "started"
    await wait_file(started)
    os.kill(int(started.read_text()), signal.SIGKILL)
    receipt = await asyncio.wait_for(task, 30)
    assert receipt.outcome == "infra_failure" and receipt.exit_signal == "SIGKILL"
    assert not receipt.deadline_fired and not receipt.stop_requested


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["no-result", "truncated", "not-json", "wrong-schema"])
@pytest.mark.parametrize("code", [0, 1])
async def test_missing_or_malformed_result_is_infra_failure_with_the_reason(
    tmp_path: Path, mode: str, code: int
) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config("none", *fake(mode, str(code))))
    assert receipt.outcome == "infra_failure"
    assert receipt.exit_code == code
    assert ("protocol violation" in receipt.outcome_reason) == (code == 0)
    if mode == "no-result":
        assert not receipt.result_present and "no result.json" in receipt.outcome_reason
    else:
        assert receipt.result_present and not receipt.result_valid
        assert "result.json is invalid" in receipt.outcome_reason


@requires_bwrap()
@pytest.mark.bwrap
@pytest.mark.timeout(60)
async def test_malformed_result_under_bwrap_is_moved_out_and_classified(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config("bwrap", *fake("truncated", "0")))
    assert receipt.outcome == "infra_failure" and "protocol violation" in receipt.outcome_reason
    assert receipt.result_present and not receipt.result_valid
    assert (root / "result.json").exists() and not (root / ".sandbox").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_temp_file_left_between_fsync_and_rename_is_swept_and_counted(
    tmp_path: Path, sandbox: str
) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config(sandbox, *fake("temp-then-die")))
    assert receipt.outcome == "infra_failure"
    assert not receipt.result_present and not (root / "result.json").exists()
    assert receipt.temp_files_swept == 1
    assert not [p for p in root.rglob("*") if is_temp_artifact(p.name)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "outcome", "words"),
    [
        (
            "fatal-early",
            "infra_failure",
            "before the first model response: ExecutorError: the kernel never started",
        ),
        ("transient", "infra_failure", "transient"),
    ],
)
async def test_worker_errors_are_classified_and_carried(
    tmp_path: Path, mode: str, outcome: str, words: str
) -> None:
    root = make_rollout(tmp_path)
    receipt = await supervise(root, config("none", *fake(mode)))
    assert receipt.outcome == outcome and words in receipt.outcome_reason
    assert receipt.result_error is not None


# --------------------------------------------------------------------------- stops


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_stop_event_cancels_the_rollout(tmp_path: Path, sandbox: str) -> None:
    root = make_rollout(tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(supervise(root, config(sandbox, *fake("hang")), stop=stop))
    await wait_file(root / "workspace" / "started")
    stop.set()
    receipt = await asyncio.wait_for(task, 30)
    assert receipt.outcome == "cancelled" and receipt.stop_requested and not receipt.deadline_fired
    assert [(s.signal, s.target, s.reason) for s in receipt.signals_sent] == [("SIGTERM", "group", "stop")]
    result = WorkerResult.model_validate_json((root / "result.json").read_bytes())
    assert result.error is not None and result.error.kind == "cancelled"


@pytest.mark.timeout(60)
async def test_stop_file_cancels_the_rollout(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    task = asyncio.create_task(supervise(root, config("none", *fake("hang"), stop_poll_s=0.05)))
    await wait_file(root / "workspace" / "started")
    (root / "stop").touch()
    receipt = await asyncio.wait_for(task, 30)
    assert receipt.outcome == "cancelled" and receipt.stop_requested


async def test_stop_file_at_start_means_the_worker_never_runs(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    (root / "stop").touch()
    receipt = await supervise(root, config("none", *fake("ok")))
    assert receipt.outcome == "cancelled" and not receipt.result_present
    assert not (root / "worker.log").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_cancelling_supervise_stops_the_worker_and_still_writes_the_receipt(
    tmp_path: Path, sandbox: str
) -> None:
    root = make_rollout(tmp_path)
    task = asyncio.create_task(supervise(root, config(sandbox, *fake("hang"))))
    await wait_file(root / "workspace" / "started")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    receipt = receipt_on_disk(root)
    assert receipt.outcome == "cancelled" and receipt.stop_requested and receipt.cleanup_confirmed


@pytest.mark.timeout(60)
async def test_a_second_cancellation_skips_the_rest_of_the_grace_period(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    # Notes SIGTERM in a file and carries on: only SIGKILL ends it.
    command = ["/bin/sh", "-c", "trap ': > term' TERM; : > started; while :; do sleep 0.1; done", "sh"]
    task = asyncio.create_task(supervise(root, config("none", *command, grace_s=60)))
    await wait_file(root / "workspace" / "started")
    task.cancel()
    await wait_file(root / "workspace" / "term")
    cancelled_again = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert time.monotonic() - cancelled_again < 15  # not the 60 s grace
    receipt = receipt_on_disk(root)
    assert receipt.outcome == "cancelled" and receipt.cleanup_confirmed
    assert [(s.signal, s.reason) for s in receipt.signals_sent] == [
        ("SIGTERM", "stop"),
        ("SIGKILL", "grace_expired"),
    ]


# --------------------------------------------------------------------------- refusals and set-up failures


async def test_invalid_input_is_infra_failure_without_starting_the_worker(tmp_path: Path) -> None:
    root = make_rollout(tmp_path, expected_answer="42")
    receipt = await supervise(root, config("none", *fake("ok")))
    assert receipt.outcome == "infra_failure"
    assert "input.json is invalid" in receipt.outcome_reason and "expected_answer" in receipt.outcome_reason
    assert receipt.rollout_id == "r1"
    assert not (root / "worker.log").exists()


async def test_a_used_rollout_directory_is_refused(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    (root / "receipt.json").write_text("{}")
    with pytest.raises(ConfigError, match="fresh rollout directory"):
        await supervise(root, config("none", *fake("ok")))


async def test_missing_bubblewrap_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    cfg = SupervisorConfig(sandbox=BwrapSandbox(bwrap_path="/nonexistent/bwrap"), worker_command=fake("ok"))
    with pytest.raises(SandboxError, match="--sandbox none"):
        await supervise(root, cfg)
    assert sorted(p.name for p in root.iterdir()) == ["input.json", "workspace"]


@pytest.fixture
def slow_bwrap() -> Any:
    """A bwrap whose self-check hangs while a ``slow`` file lies beside it (world-readable: run_as)."""
    import shutil
    import tempfile

    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("needs bubblewrap")
    directory = Path(tempfile.mkdtemp(prefix="rc-bwrap-"))
    directory.chmod(0o755)
    wrapper = directory / "bwrap"
    wrapper.write_text(
        f'#!/bin/sh\n[ "$1" != --version ] && [ -e {directory}/slow ] && exec sleep 60\nexec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    (directory / "slow").touch()
    try:
        yield wrapper
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.bwrap
@requires_bwrap()
def test_a_slow_bwrap_self_check_says_it_timed_out_and_is_tried_again(
    slow_bwrap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The self-check lives with the cage it checks (rollcage.cage).
    monkeypatch.setattr("rollcage.cage._bwrap._SELF_CHECK_TIMEOUTS_S", (0.2, 0.4))
    launcher = BwrapSandbox(bwrap_path=str(slow_bwrap)).launcher()
    with pytest.raises(SandboxError, match=r"did not finish within 0.2 s, then 0.4 s") as caught:
        launcher.check()
    assert "did not refuse" in str(caught.value) and "namespaces" not in str(caught.value)
    assert processes_mentioning(str(slow_bwrap.parent)) == []  # the hung check was killed, whole
    (slow_bwrap.parent / "slow").unlink()
    launcher.check()  # a timeout is no answer: it was not kept, and the check now passes


async def test_missing_credential_variable_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ROLLCAGE_TEST_NO_SUCH_KEY", raising=False)
    root = make_rollout(tmp_path)
    with pytest.raises(ConfigError, match="ROLLCAGE_TEST_NO_SUCH_KEY"):
        await supervise(root, config("none", *fake("ok"), api_key_env="ROLLCAGE_TEST_NO_SUCH_KEY"))


def test_config_refuses_to_pass_the_credential_to_the_worker() -> None:
    with pytest.raises(ValueError, match="must not be passed to the worker"):
        SupervisorConfig(api_key_env="OPENAI_API_KEY", env_allow=["OPENAI_API_KEY"])


def test_config_is_a_tagged_union_that_forbids_unknown_fields() -> None:
    cfg = SupervisorConfig.model_validate({"sandbox": {"type": "none"}, "deadline_s": 5})
    assert isinstance(cfg.sandbox, NoSandbox)
    with pytest.raises(ValueError):
        SupervisorConfig.model_validate({"sandbox": {"type": "bwrap", "bogus": 1}})


# --------------------------------------------------------------------------- many rollouts, one loop


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sandbox", SANDBOXES)
async def test_concurrent_rollouts_in_one_loop_are_kept_apart(tmp_path: Path, sandbox: str) -> None:
    modes = {"d1": ("daemon",), "d2": ("daemon", "ignore-term"), "ok": ("ok",), "hang": ("hang",)}
    roots = {name: make_rollout(tmp_path, name) for name in modes}
    receipts = await asyncio.gather(
        *(
            supervise(roots[name], config(sandbox, *fake(*mode), deadline_s=2 if name == "hang" else 20))
            for name, mode in modes.items()
        )
    )
    got = dict(zip(modes, receipts, strict=True))
    assert {name: r.outcome for name, r in got.items()} == {
        "d1": "completed",
        "d2": "completed",
        "ok": "completed",
        "hang": "timeout",
    }
    assert all(r.cleanup_confirmed for r in receipts)
    if sandbox == "none":
        # Each rollout killed exactly its own daemon: the token tells reparented orphans apart.
        # (Under bwrap the daemon dies with the sandbox's PID namespace, sometimes before the sweep.)
        assert [got[name].descendants_killed for name in ("d1", "d2", "ok", "hang")] == [1, 1, 0, 0]


# --------------------------------------------------------------------------- PID reuse


def test_a_pid_handle_refuses_a_process_that_is_not_the_one_found() -> None:
    with subprocess.Popen(["sleep", "30"]) as proc:
        try:
            info = read_proc(proc.pid)
            assert info is not None
            stale = type(info)(**{**info.__dict__, "starttime": info.starttime - 1})
            assert PidHandle.open(stale) is None  # same PID, another start time: a reused PID
            handle = PidHandle.open(info)
            assert handle is not None
            try:
                assert handle.send(signal.SIGKILL)
            finally:
                handle.close()
        finally:
            proc.kill()


# --------------------------------------------------------------------------- the command


def _cli(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rollcage", "supervise", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def test_cli_exit_codes_follow_the_outcome() -> None:
    from rollcage.commands.supervise import EXIT_CODES

    assert {outcome for outcome, code in EXIT_CODES.items() if code == 0} == {"completed", "agent_error"}
    assert all(EXIT_CODES[o] != 0 for o in ("infra_failure", "timeout", "cancelled"))


@pytest.mark.timeout(60)
def test_cli_prints_receipt_and_outcome(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    with _cli(str(root), "--sandbox", "none", "--worker-command", " ".join(fake("no-result", "1"))) as proc:
        try:
            out, err = proc.communicate(timeout=50)
        finally:
            proc.kill()
    assert proc.returncode == 1, err
    assert f"receipt: {root / 'receipt.json'}" in out and "outcome: infra_failure" in out
    assert "SANDBOX DISABLED" in err


@pytest.mark.timeout(60)
def test_cli_sigterm_is_a_stop(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    with _cli(str(root), "--sandbox", "none", "--worker-command", " ".join(fake("hang"))) as proc:
        try:
            wait_started(root, proc)
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=30)
        finally:
            proc.kill()
    assert proc.returncode == 4 and "outcome: cancelled" in out
    assert receipt_on_disk(root).stop_requested


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_nothing_outlives_a_supervisor_that_is_sigkilled(tmp_path: Path, sandbox: str) -> None:
    # Whatever the killed supervisor leaves is reparented to this process (a subreaper), so the
    # token search below sees it; with the worker in a sandbox, its stages run as other users.
    ensure_subreaper()
    root = make_rollout(tmp_path)
    command = " ".join(fake("hang"))
    with _cli(
        str(root), "--sandbox", sandbox, "--worker-command", command, "--ro-path", str(HELPERS)
    ) as proc:
        try:
            wait_started(root, proc)
            assert processes_with_token(), "the test cannot see the supervised processes"
            proc.kill()
            proc.wait(timeout=10)
        finally:
            proc.kill()
    wait_for(lambda: not processes_with_token(), timeout=10, what="every supervised process to be gone")
    # What the supervisor made for the rollout (bounded mounts, cgroups) is released the next run's way.
    kill_leftovers(root)
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        assert str(tmp_path) not in file.read(), "a mount of the killed supervisor's rollout was left"
