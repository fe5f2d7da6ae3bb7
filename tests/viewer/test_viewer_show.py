"""``rollcage show``: the terminal views of a rollout and a run, read as rendered text."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollcage.cli import _build_app
from rollcage.protocol import Checkpoint, Trajectory
from rollcage.runfiles import locate_rollout
from rollcage.viewer import (
    PARTIAL_LABEL,
    RolloutView,
    load_rollout,
    render_rollout,
    render_run,
    render_text,
)
from rollcage.viewer._load import ViewerError, resolve_target
from tests.helpers.viewer_fixtures import (
    RunFixture,
    cancelled_result,
    completed_result,
    model_call,
    partial_journal,
    receipt,
    tool_call,
    trajectory_of,
    write_rollout_dir,
    write_run,
)


@pytest.fixture
def run(tmp_path: Path) -> RunFixture:
    return write_run(tmp_path / "run")


def show(path: Path) -> str:
    return render_text(render_rollout(load_rollout(path)), width=160)


def test_completed_rollout_shows_turns_tool_calls_outcome_reward_and_receipt(run: RunFixture) -> None:
    text = show(run.path / "rollouts" / "calc-1-s0-t0")
    assert "rollout calc-1-s0-t0" in text
    assert "turn 0 model call completed · 120 in → 30 out tokens · 800 ms" in text
    assert "Let me compute that with Python." in text
    assert "tool python [call_py_1] completed · 50 ms" in text
    assert 'arguments {"code": "print(2+2)"}' in text
    assert "output 4" in text
    assert "turn 1 model call completed" in text
    assert "answer The answer is 4." in text
    assert "outcome completed — valid result, no error" in text
    assert "reward 1" in text  # from the enclosing run's rollouts.jsonl
    assert "receipt sandbox bwrap · exit 0" in text
    assert "cleanup confirmed" in text
    assert "capture agrees · 2 model exchange(s) captured" in text
    assert PARTIAL_LABEL not in text


def test_reasoning_is_folded_to_an_excerpt(tmp_path: Path) -> None:
    result = completed_result().model_copy(deep=True)
    long = "step " * 2000
    calls = [model_call(0, reasoning=long, text="done"), *result.trajectory.model_calls[1:]]
    result = result.model_copy(update={"trajectory": Trajectory(model_calls=calls)})
    text = show(write_rollout_dir(tmp_path / "r", result=result))
    assert "reasoning (10,000 chars, folded)" in text
    assert "more characters]" in text
    assert long.strip() not in text


def test_cancelled_rollout_shows_the_cancellation_and_the_incomplete_tool_call(run: RunFixture) -> None:
    text = show(run.path / "rollouts" / "calc-2-s0-t0")
    assert "calc-2-s0-t0" in text and "cancelled" in text
    assert "error (cancelled) Cancelled: SIGTERM received: the run was cancelled" in text
    assert "tool get_weather [call_w_1] incomplete" in text
    assert "termination cancelled" in text
    assert "reward — (not graded)" in text
    assert "stop requested" in text
    assert "sent SIGTERM → group (stop)" in text
    assert "incomplete_tool_calls" in text
    assert "SIGTERM received" in text  # the worker.log tail of a rollout that did not complete


def test_partial_checkpoint_is_marked_not_graded(run: RunFixture) -> None:
    text = show(run.path / "rollouts" / "calc-3-s0-t0")
    assert PARTIAL_LABEL == "partial — not graded"
    assert PARTIAL_LABEL in text
    assert "journal up to seq 3" in text
    assert "Running the calculation now." in text
    assert "tool python [call_py_9] pending" in text
    assert "output — (none yet)" in text
    assert "reward — (checkpoints are never graded)" in text
    assert "infra_failure" in text


def test_partial_checkpoint_model_renders_without_a_journal(tmp_path: Path) -> None:
    call = model_call(0, text="half way", calls=[("c1", "python", "print(1)")])
    pending = tool_call("c1", "python", "print(1)", 0, output=None, status="pending", duration=None)
    checkpoint = Checkpoint(
        rollout_id="r-1", seq=7, trajectory=Trajectory(model_calls=[call], tool_calls=[pending])
    )
    view = RolloutView(directory=tmp_path, rollout_id="r-1", checkpoint=checkpoint)
    text = render_text(render_rollout(view), width=160)
    assert PARTIAL_LABEL in text
    assert "journal up to seq 7" in text
    assert "half way" in text
    assert "arguments print(1)" in text  # a code cell is shown exactly as written


def test_naming_the_journal_shows_it_even_when_a_result_exists(tmp_path: Path) -> None:
    directory = write_rollout_dir(
        tmp_path / "calc-3-s0-t0", result=completed_result("calc-3-s0-t0"), journal=partial_journal()
    )
    target = resolve_target(directory / "checkpoint.jsonl")
    text = render_text(render_rollout(load_rollout(target.path, prefer=target.prefer, file=target.file)))
    assert PARTIAL_LABEL in text
    assert "The answer is 4." not in text


def test_damaged_result_is_named_and_the_journal_shown_instead(tmp_path: Path) -> None:
    directory = write_rollout_dir(
        tmp_path / "calc-3-s0-t0",
        raw_result=b'{"rollout_id": "calc-3-s0-t0", "trunc',
        journal=partial_journal(),
        receipt_model=receipt("calc-3-s0-t0", "infra_failure"),
    )
    text = show(directory)
    assert "result.json: not a valid WorkerResult" in text
    assert PARTIAL_LABEL in text


def test_capture_disagreement_is_shown_as_a_diff(run: RunFixture) -> None:
    text = show(run.path / "rollouts" / "calc-5-s0-t0")
    assert "capture DISAGREES · 3 model exchange(s) captured, 2 attempt(s)" in text
    assert "model call 1 (attempt 1) and captured exchange 1 sent different requests" in text
    assert '+ "temperature": 0.7' in text
    assert "captured exchange 2 matches no model call in the trajectory" in text
    assert "trajectory_capture_accounting" in text


def test_terminal_controls_and_markup_in_agent_output_are_shown_inert(tmp_path: Path) -> None:
    hostile = "\x1b[2J\x1b]0;pwned\x07[bold red]not markup[/] done"
    result = completed_result(tool_output=hostile)
    text = show(write_rollout_dir(tmp_path / "r", result=result))
    assert "\x1b" not in text and "\x07" not in text
    assert "␛[2J" in text
    assert "[bold red]not markup[/] done" in text


def test_run_shows_summary_and_every_rollout_with_outcome_and_reward(run: RunFixture) -> None:
    text = render_text(render_run(run.path), width=160)
    assert "summary (metrics.json)" in text
    assert "mean reward" in text and "0.333" in text
    assert "pass@2" in text and "0.500" in text
    assert (
        "records by outcome: completed 2 · agent_error 1 · timeout 1 · cancelled 1 · infra_failure 1" in text
    )
    for rec in run.records:
        assert rec.rollout_id in text
    assert "showing 6 of 6 rollout(s)" in text
    assert "torn" in text  # the torn last line is skipped and said so
    assert "health: trajectory_capture_accounting" in text


def test_run_filters_by_outcome(run: RunFixture) -> None:
    text = render_text(render_run(run.path, outcome="infra_failure"), width=160)
    assert "calc-3-s0-t0" in text
    for other in ("calc-1-s0-t0", "calc-2-s0-t0", "calc-4-s0-t0", "calc-5-s0-t0"):
        assert other not in text
    assert "showing 1 of 1 rollout(s) with outcome infra_failure (6 in the run)" in text


def test_run_limit_counts_what_it_leaves_out(run: RunFixture) -> None:
    text = render_text(render_run(run.path, limit=2), width=160)
    assert "showing 2 of 6 rollout(s)" in text and "--limit 0 shows all" in text
    assert "calc-5-s0-t0" not in text


def test_unknown_outcome_is_an_error(run: RunFixture) -> None:
    with pytest.raises(ViewerError, match="unknown outcome 'bogus'"):
        render_run(run.path, outcome="bogus")


def test_cli_shows_a_rollout_and_a_run(run: RunFixture) -> None:
    runner = CliRunner()
    rollout = runner.invoke(
        _build_app(), ["show", str(run.path / "rollouts" / "calc-1-s0-t0" / "result.json")]
    )
    assert rollout.exit_code == 0, rollout.output
    assert "Let me compute that with Python." in rollout.output
    listed = runner.invoke(
        _build_app(), ["show", str(run.path), "--outcome", "cancelled"], env={"COLUMNS": "200"}
    )
    assert listed.exit_code == 0, listed.output
    assert "calc-2-s0-t0" in listed.output and "calc-1-s0-t0" not in listed.output


@pytest.mark.parametrize("kind", ["missing", "unrecognised_dir", "unrecognised_file"])
def test_cli_names_a_path_it_cannot_show_and_exits_2(tmp_path: Path, kind: str) -> None:
    if kind == "missing":
        path = tmp_path / "no-such-rollout"
    elif kind == "unrecognised_dir":
        path = tmp_path
    else:
        path = tmp_path / "notes.txt"
        path.write_text("hello")
    outcome = CliRunner().invoke(_build_app(), ["show", str(path)])
    assert outcome.exit_code == 2
    assert str(path) in outcome.output


def test_cli_rejects_outcome_filter_on_one_rollout(run: RunFixture) -> None:
    outcome = CliRunner().invoke(
        _build_app(), ["show", str(run.path / "rollouts" / "calc-2-s0-t0"), "--outcome", "cancelled"]
    )
    assert outcome.exit_code == 2
    assert "--outcome" in outcome.output


def test_cancelled_rollout_without_a_run_says_it_has_no_reward(tmp_path: Path) -> None:
    directory = write_rollout_dir(
        tmp_path / "calc-2-s0-t0",
        result=cancelled_result(),
        receipt_model=receipt("calc-2-s0-t0", "cancelled"),
    )
    assert "reward — (not in a run)" in show(directory)


def test_a_moved_run_still_finds_its_rollout_directories(run: RunFixture) -> None:
    moved = run.records[0].model_copy(update={"rollout_dir": "/gone/away/rollouts/calc-1-s0-t0"})
    location = locate_rollout(run.path, moved)
    assert location.directory == run.path / "rollouts" / "calc-1-s0-t0" and location.relocated


def test_local_health_findings_use_the_controllers_check_names(tmp_path: Path) -> None:
    calls = [
        model_call(0, status="failed", tokens=(None, None), attempts=3),
        model_call(1, text="ok", tokens=(100, None), start=2.0),
        model_call(2, status="incomplete", incomplete_reason="length", text="", start=4.0),
    ]
    result = completed_result().model_copy(update={"trajectory": trajectory_of(calls, [])})
    text = show(write_rollout_dir(tmp_path / "r", result=result))
    assert "model_call_failed: 1 — model calls with an HTTP error status or an error" in text
    # NeMo Gym's rule counts the failed call's missing counts too.
    assert "model_call_missing_token_counts: 2 — model calls without input or output token" in text
    assert "model_call_runaway_generation: 1 — model calls cut at the output length limit whose" in text
    # A bare rollout directory has no receipt: the capture check says so rather than passing.
    assert "unobserved (no receipt.json): trajectory_capture_accounting" in text
    assert "3 attempts" in text and "HTTP 500" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["result.json", "receipt.json", "input.json", "worker.log"])
def test_an_artifact_that_is_a_fifo_is_a_problem_shown_not_a_hang(run: RunFixture, name: str) -> None:
    directory = run.path / "rollouts" / "calc-1-s0-t0"
    (directory / name).unlink()
    os.mkfifo(directory / name)
    view = load_rollout(directory)
    assert any(name in problem and "not a regular file" in problem for problem in view.problems), (
        view.problems
    )
