"""rollcage show and rollcage report on hostile input: damaged, copied and edited runs, odd outputs.

The same damages as the export table (``tests.helpers.hostile_runs``). Every case
ends with an exit code and one clear line (or the view, its problems named), never
a traceback; the run's own files are byte-identical afterwards; the report is
whole or absent; and nothing outside the run is read on a record's word (a decoy
rollout directory beside the run holds ``DECOY``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.hostile_runs import (
    DAMAGES,
    DECOY,
    OUTPUTS,
    Done,
    held_socket,
    make_output,
    short_tempdir,
    snapshot,
    verb,
)
from tests.helpers.viewer_fixtures import write_run

ROLLOUT = "calc-1-s0-t0"
"""The rollout most damages spoil; ``show`` is also asked about it directly."""

# case -> words the report's summary says (besides the view of each rollout, its problems named).
REPORT_NOTICES: dict[str, str] = {
    "torn_last_line": "the last line of rollouts.jsonl is torn",
    "torn_middle_line": "damaged lines skipped: [3]",
    "non_utf8_line": "damaged lines skipped: [2]",
    "records_fifo": "no rollouts.jsonl",
    "records_directory": "no rollouts.jsonl",
    "metrics_corrupt": "cannot read run metrics",
    "record_absolute_elsewhere": "1 record(s) name a rollout directory outside this run",
    "record_dotdot": "1 record(s) name a rollout directory outside this run",
    "copied_original_deleted": "6 record(s) name a rollout directory outside this run",
    "copied_original_different": "6 record(s) name a rollout directory outside this run",
}

# case -> (exit code, words) of ``show RUN/rollouts/calc-1-s0-t0``; other cases show it with exit 0.
SHOW_ROLLOUT: dict[str, tuple[int, str]] = {
    "missing_rollout_dir": (2, "no such file or directory"),
    "missing_rollouts_tree": (2, "no such file or directory"),
    "result_missing": (0, "nothing of the trajectory"),
    "result_truncated": (0, "result.json: not a valid WorkerResult"),
    "result_non_utf8": (0, "result.json: not a valid WorkerResult"),
    "result_fifo": (0, "not a regular file"),
    "receipt_corrupt": (0, "receipt.json: not a valid SupervisorReceipt"),
    "input_corrupt": (0, "input.json: cannot read"),
    "capture_corrupt": (0, "model_capture.jsonl"),
}


def _damaged(tmp_path: Path, case: str) -> Path:
    run = write_run(tmp_path / "run").path
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    DAMAGES[case](run, scratch)
    return run


def _assert_no_traceback(done: Done, verb_name: str) -> None:
    assert "Traceback" not in done.err and "Traceback" not in done.out, done.err
    if done.code:
        lines = done.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"rollcage {verb_name}: "), done.err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_show_of_a_damaged_or_copied_run_and_its_rollout_names_what_is_wrong(
    tmp_path: Path, case: str
) -> None:
    run = _damaged(tmp_path, case)
    before = snapshot(run)

    listed = verb("show", str(run), "--limit", "0")
    _assert_no_traceback(listed, "show")
    assert listed.code == 0, listed.err
    assert DECOY not in listed.out

    shown = verb("show", str(run / "rollouts" / ROLLOUT))
    _assert_no_traceback(shown, "show")
    code, words = SHOW_ROLLOUT.get(case, (0, ""))
    assert shown.code == code, (shown.out, shown.err)
    assert words in (shown.err if code else shown.out), (shown.out, shown.err)
    if case != "rollout_dir_symlink_out":  # there the user named the link: its target is what was asked for
        assert DECOY not in shown.out
    assert snapshot(run) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_report_of_a_damaged_or_copied_run_is_whole_and_reads_only_the_run(tmp_path: Path, case: str) -> None:
    run = _damaged(tmp_path, case)
    before = snapshot(run)
    out = tmp_path / "out" / "report.html"

    done = verb("report", str(run), "-o", str(out))

    _assert_no_traceback(done, "report")
    assert done.code == 0, done.err
    assert snapshot(run) == before
    html = out.read_text()
    assert html.endswith("</body></html>\n")
    assert DECOY not in html
    assert REPORT_NOTICES.get(case, "") in html
    if case in ("record_id_traversal", "record_id_nul", "rollout_dir_symlink_out"):
        assert ("viewer_error" in html and "not read" in html) or "symbolic link" in html
    assert [path.name for path in out.parent.iterdir()] == ["report.html"]  # no temporary left


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (for a Unix socket)."""
    with short_tempdir() as path:
        yield path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(set(OUTPUTS) - {"a_dir_of_other_files"}))
def test_a_report_output_that_is_not_a_plain_file_or_is_the_runs_own_is_refused_untouched(
    tmp_path: Path, short_dir: Path, case: str
) -> None:
    run = write_run(tmp_path / "run").path
    before_run = snapshot(run)
    if case == "socket":
        with held_socket(short_dir / "sock") as target:
            done = verb("report", str(run), "-o", str(target))
            assert os.path.exists(target)
        words = OUTPUTS[case]
    else:
        target = make_output(case, directory=False, run=run, scratch=short_dir)
        before_scratch = snapshot(short_dir)
        kind = os.lstat(target).st_mode if os.path.lexists(target) else None
        done = verb("report", str(run), "-o", str(target))
        assert snapshot(short_dir) == before_scratch
        if kind is not None:
            assert os.lstat(target).st_mode == kind
        words = OUTPUTS[case] or "is a directory"
    _assert_no_traceback(done, "report")
    assert done.code == 2, (done.out, done.err)
    assert words in done.err, done.err
    assert snapshot(run) == before_run


def test_the_report_reads_a_copied_runs_own_artifacts_not_the_originals(tmp_path: Path) -> None:
    """Issue 35 item 6 for ``report``: a copy must not show what its original now holds."""
    run = _damaged(tmp_path, "copied_original_different")
    done = verb("report", str(run))
    assert done.code == 0, done.err
    html = (run / "report.html").read_text()
    assert DECOY not in html and "The answer is 4." in html


@pytest.mark.timeout(120)
def test_show_into_a_full_device_or_a_closed_pipe_ends_in_one_line_at_most(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run").path
    command = [sys.executable, "-m", "rollcage", "show", str(run), "--limit", "0"]
    with open("/dev/full", "wb") as full:
        done = subprocess.run(
            command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, check=False
        )
    assert done.returncode == 1 and "No space left on device" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    reader = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert reader.stdout is not None and reader.stderr is not None
        reader.stdout.read(1)
        reader.stdout.close()  # the reader went away after one byte, as `| head -c1` does
        errors = reader.stderr.read().decode()
        assert reader.wait(timeout=120) in (0, 1)
    finally:
        reader.kill()
        reader.wait()
    assert "Traceback" not in errors and len(errors.strip().splitlines()) <= 1
