"""``--resume-rollouts`` end to end: real supervisor, bubblewrap, worker and the scripted policy.

An infra_failure retry, and a rollout a SIGKILLed controller interrupted, continue from the
earlier attempt's journal: the model is asked only what the journal does not hold, the records
link the attempts, and the run's metrics count resumes and saved calls without counting a
token twice.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.checkpoint import load_checkpoint
from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
from rollcage.controller._ids import rollout_id
from rollcage.durable import read_journal
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord, RunMetrics
from rollcage.trajectory import project_output
from tests.helpers.waiting import wait_for

SANDBOX: Any = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")
pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(300),
]

CALLS = 5
SCRIPT = {
    "tasks": {
        "*": [
            {"tool_calls": [{"name": "python", "arguments": {"code": "x = 6\nprint(x)"}}]},
            {"tool_calls": [{"name": "python", "arguments": {"code": "x = x * 7\nprint(x)"}}]},
            {"tool_calls": [{"name": "python", "arguments": {"code": "open('x.txt', 'w').write(str(x))"}}]},
            {"tool_calls": [{"name": "python", "arguments": {"code": "print(open('x.txt').read())"}}]},
            {"text": "42"},
        ]
    }
}


def _dataset(directory: Path, tasks: int, **extra: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [
        {
            "id": f"t{i}",
            "input": "6*7?",
            "tools": ["python"],
            "model": {"max_retries": 0, "timeout_s": 30},
            "expected": "42",
            **extra,
        }
        for i in range(tasks)
    ]
    path = directory / "dataset.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(
    tmp_path: Path, server: PolicyServer, *, row: dict[str, Any] | None = None, **run: Any
) -> RunConfig:
    """One task on ``server``, retried at once after an infra_failure."""
    return RunConfig(
        dataset=_dataset(tmp_path / "data", 1, **(row or {})),
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url=server.base_url, model_name="scripted"),
        sandbox=SANDBOX,
        deadline_s=60,
        retry_backoff_s=0,
        **run,
    )


def _records(out: Path) -> list[RolloutRecord]:
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[PolicyServer]:
    faults = getattr(request, "param", [])
    with PolicyServer(SCRIPT, faults=faults) as srv:
        yield srv


FAILS_AT = 4
FIRST = rollout_id("t0", 0, 0)
RETRY = rollout_id("t0", 0, 1)


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:status=503"]], indirect=True)
async def test_an_infra_failure_retry_resumes_and_the_records_say_so(
    tmp_path: Path, server: PolicyServer
) -> None:
    config = _config(tmp_path, server, resume_rollouts=True)
    summary = await Controller(config).run()
    first, retry = _records(config.out)
    assert (first.rollout_id, first.outcome) == (FIRST, "infra_failure")
    assert (retry.rollout_id, retry.outcome, retry.reward) == (RETRY, "completed", 1.0)
    saved = FAILS_AT - 1
    # The policy server was asked only what the journal did not hold.
    assert server.requests[RETRY] == CALLS - saved
    link = retry.resume
    assert link is not None and link.resumed and link.reason is None
    assert (link.previous_rollout_id, link.previous_dir) == (FIRST, first.rollout_dir)
    assert link.replayed_model_calls == saved
    assert retry.receipt.resumed_from == FIRST
    assert link.boundary == read_journal(Path(first.rollout_dir) / "checkpoint.jsonl")[-1]["seq"]
    # Exactly once: the retry's metrics hold only the calls it made, so the run's token sum is each
    # call's tokens once.
    assert (retry.metrics.model_calls, retry.metrics.replayed_model_calls) == (CALLS - saved, saved)
    result = retry.result()
    assert result is not None and result.trajectory.resumed_from is not None
    replayed = set(result.trajectory.resumed_from.replayed_model_calls)
    made = [c for c in result.trajectory.model_calls if c.id not in replayed]
    assert retry.metrics.total_tokens == sum(c.usage.total_tokens or 0 for c in made)
    # Tool calls answered from the journal were made, and are counted, by the earlier attempt; re-run
    # cells were made again.
    from_journal = set(result.trajectory.resumed_from.replayed_tool_calls)
    assert result.trajectory.resumed_from.rerun_cells
    assert retry.metrics.tool_calls == len(result.trajectory.tool_calls) - len(from_journal)
    m = summary.metrics
    assert (m.resumed_rollouts, m.model_calls_saved, m.retries) == (1, saved, 1)
    assert m.tokens.total_tokens == sum(r.metrics.total_tokens or 0 for r in (first, retry))
    assert retry.health.findings == {}
    # The retry's journal folds to its result (checkpoint and result projections agree).
    checkpoint = load_checkpoint(Path(retry.rollout_dir) / "checkpoint.jsonl")
    assert [c.id for c in checkpoint.trajectory.model_calls] == [c.id for c in result.trajectory.model_calls]
    assert checkpoint.trajectory.resumed_from == result.trajectory.resumed_from
    assert checkpoint.output == project_output(result.trajectory, partial=True)
    assert project_output(result.trajectory, partial=False) == result.response.output  # type: ignore[union-attr]
    # The earlier attempt's directory is intact evidence; the retry's workspace was rebuilt by its cells.
    assert (Path(first.rollout_dir) / "result.json").exists()
    assert (Path(retry.rollout_dir) / "workspace" / "x.txt").read_text() == "42"


@pytest.mark.parametrize(
    ("flag", "row", "resumed"), [(False, None, False), (True, False, False), (False, True, True)]
)
@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:status=503"]], indirect=True)
async def test_the_row_setting_overrides_the_runs(
    tmp_path: Path, server: PolicyServer, flag: bool, row: bool | None, resumed: bool
) -> None:
    config = _config(tmp_path, server, row={} if row is None else {"resume": row}, resume_rollouts=flag)
    summary = await Controller(config).run()
    _, retry = _records(config.out)
    assert retry.outcome == "completed"
    assert (retry.resume is not None and retry.resume.resumed) is resumed
    assert server.requests[RETRY] == (CALLS - (FAILS_AT - 1) if resumed else CALLS)
    assert summary.metrics.resumed_rollouts == int(resumed)


def _in_flight_at(out: Path, rollout: str, calls: int) -> bool:
    try:
        records = read_journal(out / "rollouts" / rollout / "checkpoint.jsonl")
    except (OSError, ValueError):
        return False
    return sum(r.get("kind") == "model_call" for r in records) >= calls and any(
        r.get("kind") == "turn_start" and r["turn"]["index"] == calls for r in records
    )


def _kill_mid_rollout_then_rerun(
    tmp_path: Path,
    server: PolicyServer,
    *,
    change_task: bool,
    between: Callable[[Path], None] | None = None,
    rerun_fails: bool = False,
) -> Path:
    """Run two tasks with ``--resume-rollouts``, SIGKILL the controller while t0's 4th model call hangs,
    then run the same command again (after changing t0's prompt, with ``change_task``; after
    ``between`` does to the output directory what it does)."""
    dataset = _dataset(tmp_path / "data", 2)
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "rollcage", "run", str(dataset), "--out", str(out), "--quiet",
        "--model", server.base_url, "--model-name", "scripted", "--sandbox", SANDBOX,
        "--resume-rollouts", "--concurrency", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # The hung request reached the server (so the rerun's is not the one that hangs), after its
        # turn's start was journaled.
        wait_for(lambda: server.faults_injected, what="the hung model call of t0")
        wait_for(lambda: _in_flight_at(out, FIRST, FAILS_AT - 1), what="its turn's start in the journal")
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    if change_task:
        rows = [json.loads(line) for line in dataset.read_text().splitlines()]
        rows[0]["input"] = "7*6?"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    if between is not None:
        between(out)
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=240)
    if rerun_fails:
        assert rerun.returncode == 1, rerun.stdout + rerun.stderr
        (out / "rerun.log").write_text(rerun.stdout + rerun.stderr)
    else:
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    return out


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:kind=hang"]], indirect=True)
def test_a_rollout_interrupted_by_a_controller_sigkill_continues_on_rerun(
    tmp_path: Path, server: PolicyServer
) -> None:
    out = _kill_mid_rollout_then_rerun(tmp_path, server, change_task=False)
    got = _records(out)
    assert len(got) == 2, [(r.rollout_id, r.outcome, r.receipt.outcome_reason[:300]) for r in got]
    resumed = {r.task_id: r for r in got}["t0"]
    assert (resumed.rollout_id, resumed.outcome, resumed.reward) == (FIRST, "completed", 1.0)
    link = resumed.resume
    assert link is not None and link.resumed, link
    assert Path(link.previous_dir).parent == out / "interrupted"
    assert link.replayed_model_calls == FAILS_AT - 1
    # Asked FAILS_AT times by the killed run (the last one hung), then only the rest.
    assert server.requests[FIRST] == FAILS_AT + CALLS - (FAILS_AT - 1)
    metrics = RunMetrics.model_validate_json((out / "metrics.json").read_bytes())
    assert metrics.resumed_rollouts >= 1 and metrics.model_calls_saved >= FAILS_AT - 1


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:kind=hang"]], indirect=True)
def test_a_task_changed_since_the_interrupted_attempt_starts_fresh(
    tmp_path: Path, server: PolicyServer
) -> None:
    out = _kill_mid_rollout_then_rerun(tmp_path, server, change_task=True)
    fresh = {r.task_id: r for r in _records(out)}["t0"]
    assert fresh.outcome == "completed"
    link = fresh.resume
    assert link is not None and not link.resumed
    assert link.reason is not None and "task changed" in link.reason and "'input'" in link.reason
    assert server.requests[FIRST] == FAILS_AT + CALLS  # every call asked again
    assert not (Path(fresh.rollout_dir) / "resume.jsonl").exists()


def test_a_journal_that_is_a_symbolic_link_is_not_followed(tmp_path: Path) -> None:
    """Staging copies the earlier journal into the new directory: a link must not pull in another file."""
    from rollcage.controller._unit import ResumeSource, lay_out
    from rollcage.protocol import WorkerInput

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    secret = tmp_path / "secret.jsonl"
    secret.write_text("not for the sandbox\n")
    (earlier / "checkpoint.jsonl").symlink_to(secret)
    worker_input = WorkerInput.model_validate(
        {
            "rollout_id": "t0-s0-t1",
            "task_id": "t0",
            "input": "6*7?",
            "model": {"base_url": "http://x/v1", "model": "m"},
        }
    )
    (earlier / "input.json").write_text(
        worker_input.model_copy(update={"rollout_id": "t0-s0-t0"}).model_dump_json()
    )
    link = lay_out(
        tmp_path / "new", worker_input, 0o644, ResumeSource(rollout_id="t0-s0-t0", directory=str(earlier))
    )
    assert link is not None and not link.resumed
    assert link.reason is not None and "symbolic link" in link.reason
    assert not (tmp_path / "new" / "resume.jsonl").exists()
    assert WorkerInput.model_validate_json((tmp_path / "new" / "input.json").read_bytes()).resume is None


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call=3:kind=hang"]], indirect=True)
def test_a_retry_killed_before_its_replay_ended_is_passed_over_for_the_attempt_before(
    tmp_path: Path, server: PolicyServer
) -> None:
    """A resumed attempt journals its replay only once the replay is over: killed before, its journal
    holds nothing to resume, and the attempt before it is the evidence to continue from."""
    import asyncio

    from rollcage.controller._unit import ResumeSource, lay_out
    from rollcage.durable import CheckpointJournal
    from rollcage.protocol import WorkerInput
    from tests.helpers.worker_env import RolloutDir, worker_input

    def task_input(rollout: str) -> WorkerInput:
        data = worker_input(model_url=server.base_url, task_id="t0")
        return WorkerInput.model_validate({**data, "rollout_id": rollout})

    before = RolloutDir(tmp_path / FIRST)
    try:
        before.write_input(task_input(FIRST).model_dump(mode="json"))
        before.start()
        wait_for(lambda: server.faults_injected, what="the third model request")
        wait_for(
            lambda: any(r.get("kind") == "turn_start" and r["turn"]["index"] == 2 for r in before.records())
        )
    finally:
        before.kill()
    killed = tmp_path / RETRY
    killed.mkdir()
    (killed / "input.json").write_text(task_input(RETRY).model_dump_json())

    async def start_only() -> None:
        async with CheckpointJournal(killed / "checkpoint.jsonl") as journal:
            await journal.append({"kind": "start", "at": 1.0, "schema_version": 2, "rollout_id": RETRY})

    asyncio.run(start_only())
    third = rollout_id("t0", 0, 2)
    source = ResumeSource(rollout_id=FIRST, directory=str(before.root)).then(RETRY, str(killed))
    link = lay_out(tmp_path / third, task_input(third), 0o644, source)
    assert link is not None and link.reason is None
    assert (link.previous_rollout_id, link.previous_dir) == (FIRST, str(before.root))
    assert (tmp_path / third / "resume.jsonl").read_bytes() == before.checkpoint.read_bytes()
    # The worker resumes from it: two calls replayed, three asked.
    rd = RolloutDir(tmp_path / third)
    try:
        assert rd.run() == 0, rd.log_text()
    finally:
        rd.kill()
    result = rd.result_model()
    assert result.trajectory.resumed_from is not None
    assert result.trajectory.resumed_from.previous_rollout_id == FIRST
    assert server.requests[third] == CALLS - 2


@pytest.mark.parametrize("harness", [{"type": "nooa"}, {"type": "command", "argv": ["cli-agent"]}])
def test_a_harness_rollout_is_not_resumed(tmp_path: Path, harness: dict[str, Any]) -> None:
    """A harness cannot replay recorded answers: its retry starts fresh, and the link says why."""
    from rollcage.controller._unit import ResumeSource, lay_out
    from rollcage.protocol import WorkerInput

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    worker_input = WorkerInput.model_validate(
        {
            "rollout_id": "t0-s0-t1",
            "task_id": "t0",
            "input": "6*7?",
            "model": {"base_url": "http://x/v1", "model": "m"},
            "agent": {"harness": harness},
        }
    )
    (earlier / "input.json").write_text(
        worker_input.model_copy(update={"rollout_id": "t0-s0-t0"}).model_dump_json()
    )
    (earlier / "checkpoint.jsonl").write_text("")
    link = lay_out(
        tmp_path / "new", worker_input, 0o644, ResumeSource(rollout_id="t0-s0-t0", directory=str(earlier))
    )
    assert link is not None and not link.resumed
    assert link.reason is not None and "harness" in link.reason
    assert not (tmp_path / "new" / "resume.jsonl").exists()
    assert WorkerInput.model_validate_json((tmp_path / "new" / "input.json").read_bytes()).resume is None


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:kind=hang"]], indirect=True)
def test_an_interrupted_attempt_that_cannot_be_set_aside_stops_the_run_and_is_kept(
    tmp_path: Path, server: PolicyServer
) -> None:
    """A stale directory that cannot be moved (here a mount point: rename gives EBUSY) stops the rerun
    with a message naming it; its journal stays, and once freed the next run continues from it."""
    if os.geteuid() != 0:
        pytest.skip("optional: a bind mount needs root")
    stale = tmp_path / "out" / "rollouts" / FIRST

    def pinned(out: Path) -> None:
        subprocess.run(["mount", "--bind", str(stale), str(stale)], check=True)

    try:
        out = _kill_mid_rollout_then_rerun(
            tmp_path, server, change_task=False, between=pinned, rerun_fails=True
        )
        assert f"cannot set aside the unfinished rollout directory {stale}" in (out / "rerun.log").read_text()
        journal = (stale / "checkpoint.jsonl").read_bytes()
        assert journal and FIRST not in {r.rollout_id for r in _records(out)}
    finally:
        subprocess.run(["umount", str(stale)], check=False)
    args = [
        sys.executable, "-m", "rollcage", "run", str(_dataset(tmp_path / "data", 2)), "--out", str(out),
        "--quiet", "--model", server.base_url, "--model-name", "scripted", "--sandbox", SANDBOX,
        "--resume-rollouts", "--concurrency", "2",
    ]  # fmt: skip
    rerun = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    resumed = {r.task_id: r for r in _records(out)}["t0"]
    assert resumed.outcome == "completed" and resumed.resume is not None and resumed.resume.resumed


@pytest.mark.parametrize("server", [[f"rollout={FIRST}:call={FAILS_AT}:kind=hang"]], indirect=True)
def test_an_attempt_killed_while_staged_again_is_passed_over_for_the_one_that_ran(
    tmp_path: Path, server: PolicyServer
) -> None:
    """A run killed while staging an interrupted attempt again leaves a directory that never ran (no
    input.json); the next run sets it aside too, and continues from the attempt before it, which ran."""
    from rollcage.controller._unit import set_aside
    from rollcage.supervisor import kill_leftovers

    def killed_while_staging(out: Path) -> None:
        # What a second run does before it is killed: release, set aside, stage again (not finished).
        kill_leftovers(out / "rollouts" / FIRST)
        assert set_aside(out / "rollouts" / FIRST, out / "interrupted") is not None
        (out / "rollouts" / FIRST / "workspace").mkdir(parents=True)

    out = _kill_mid_rollout_then_rerun(tmp_path, server, change_task=False, between=killed_while_staging)
    resumed = {r.task_id: r for r in _records(out)}["t0"]
    assert (resumed.rollout_id, resumed.outcome, resumed.reward) == (FIRST, "completed", 1.0)
    link = resumed.resume
    assert link is not None and link.resumed and link.reason is None, link
    assert (Path(link.previous_dir) / "input.json").exists()
    assert link.replayed_model_calls == FAILS_AT - 1
    assert server.requests[FIRST] == FAILS_AT + CALLS - (FAILS_AT - 1)
    # The half-prepared directory was set aside as it was, never resumed from.
    aside = [p for p in (out / "interrupted").iterdir() if p.name.startswith(f"{FIRST}.")]
    assert len(aside) == 2 and sum(not (p / "input.json").exists() for p in aside) == 1


def test_an_attempt_that_never_ran_is_named_as_such_when_nothing_else_is_there(tmp_path: Path) -> None:
    from rollcage.controller._unit import ResumeSource, lay_out
    from rollcage.protocol import WorkerInput

    unprepared = tmp_path / "interrupted" / "t0-s0-t0.20260101T000000Z"
    (unprepared / "workspace").mkdir(parents=True)
    worker_input = WorkerInput.model_validate(
        {
            "rollout_id": "t0-s0-t0",
            "task_id": "t0",
            "input": "6*7?",
            "model": {"base_url": "http://x/v1", "model": "m"},
        }
    )
    link = lay_out(
        tmp_path / "new", worker_input, 0o644, ResumeSource(rollout_id="t0-s0-t0", directory=str(unprepared))
    )
    assert link is not None and not link.resumed and link.reason is not None
    assert "interrupted while it was being prepared" in link.reason and "task changed" not in link.reason
