"""rollcage export on hostile input: damaged, copied and edited runs, and outputs it must not write.

Every case ends with an exit code and one clear line, never a traceback; the run's
own files are byte-identical afterwards; nothing partial is left at the output; and
nothing outside the run is ever read (a decoy rollout directory beside the run
holds ``DECOY``, which would show up in the output).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcage import durable
from rollcage.errors import ConfigError
from rollcage.export import export_run
from tests.helpers.formats import AtifTrajectory
from tests.helpers.hostile_runs import (
    DAMAGES,
    DECOY,
    OUTPUTS,
    Done,
    device_node,
    edit_json,
    edit_record,
    held_socket,
    make_output,
    short_tempdir,
    snapshot,
    verb,
)
from tests.helpers.viewer_fixtures import write_run

FORMATS = ("atif", "nemo-gym")

# case -> (exit code, words of its one line): an export takes what is readable and says what it left out.
DAMAGED_EXPECTED: dict[str, tuple[int, str]] = {
    "torn_last_line": (0, "wrote"),
    "torn_middle_line": (2, "line 3 is damaged"),
    "non_utf8_line": (2, "line 2 is damaged"),
    "records_empty": (0, "wrote 0 rollout(s)"),
    "records_fifo": (2, "not a regular file"),
    "records_directory": (2, "not a regular file"),
    "record_huge_ints": (0, "not exportable"),
    "record_huge_reward": (0, "wrote"),
    "missing_rollout_dir": (0, "unreadable rollout directory"),
    "missing_rollouts_tree": (0, "unreadable rollout directory"),
    "result_missing": (0, "unreadable rollout directory"),
    "result_truncated": (0, "invalid artifact"),
    "result_non_utf8": (0, "invalid artifact"),
    "result_fifo": (0, "unreadable rollout directory"),
    "result_huge_token_ids": (0, "wrote"),  # skipped where the format carries token ids (ATIF here)
    "result_huge_usage": (0, "not exportable"),
    "result_far_timestamp": (0, "not exportable"),
    "receipt_corrupt": (0, "wrote"),
    "checkpoint_corrupt": (0, "wrote"),
    "capture_corrupt": (0, "wrote"),
    "input_corrupt": (0, "invalid artifact"),
    "metrics_corrupt": (0, "wrote"),
    "metrics_huge": (0, "wrote"),
    "record_absolute_elsewhere": (0, "1 record(s) named a rollout directory outside this run"),
    "record_dotdot": (0, "1 record(s) named a rollout directory outside this run"),
    "record_id_traversal": (0, "rollout directory refused"),
    "record_id_nul": (0, "rollout directory refused"),
    "rollout_dir_symlink_out": (0, "rollout directory refused"),
    "copied_original_deleted": (0, "5 record(s) named a rollout directory outside this run"),
    "copied_original_different": (0, "5 record(s) named a rollout directory outside this run"),
}
assert set(DAMAGED_EXPECTED) == set(DAMAGES)


def _no_temporaries(root: Path) -> list[str]:
    return [str(path) for path in root.rglob(".*.tmp")]


def _assert_clean_failure(done: Done, words: str) -> None:
    assert "Traceback" not in done.err, done.err
    lines = done.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollcage export: "), done.err
    assert words in lines[0], lines[0]


def _exported_texts(destination: Path) -> list[str]:
    if destination.is_dir():
        return [path.read_text() for path in sorted(destination.iterdir())]
    return destination.read_text().splitlines() if destination.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("format", FORMATS)
@pytest.mark.parametrize("case", sorted(DAMAGES))
def test_a_damaged_or_copied_run_exports_what_it_can_and_says_what_it_left(
    tmp_path: Path, case: str, format: str
) -> None:
    run = write_run(tmp_path / "run").path
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    DAMAGES[case](run, scratch)
    before = snapshot(run)
    out = tmp_path / "out" / ("atif" if format == "atif" else "rows.jsonl")
    code, words = DAMAGED_EXPECTED[case]

    done = verb("export", str(run), "--format", format, "--out", str(out))

    assert done.code == code, (done.out, done.err)
    assert snapshot(run) == before
    assert _no_temporaries(tmp_path) == []
    if code:
        _assert_clean_failure(done, words)
        assert not out.exists()
        return
    assert done.err == "" and words in done.out, (done.out, done.err)
    texts = _exported_texts(out)
    for text in texts:
        json.loads(text)  # every document is whole, valid JSON
        assert DECOY not in text
    if format == "atif":
        for path in out.iterdir():
            AtifTrajectory.model_validate_json(path.read_bytes())


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory with a short path (for a Unix socket)."""
    with short_tempdir() as path:
        yield path


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "format"),
    # A directory of other files is an output only the directory format (atif) could take.
    [(c, f) for c in sorted(OUTPUTS) for f in FORMATS if c != "a_dir_of_other_files" or f == "atif"],
)
def test_an_output_that_is_not_a_plain_new_file_or_is_the_runs_own_is_refused_untouched(
    tmp_path: Path, short_dir: Path, case: str, format: str
) -> None:
    run = write_run(tmp_path / "run").path
    scratch = short_dir
    if case == "socket":
        with held_socket(scratch / "sock") as target:
            done = _refused(run, scratch, target, format)
        assert "socket" in done.err
        return
    target = make_output(case, directory=format == "atif", run=run, scratch=scratch)
    done = _refused(run, scratch, target, format)
    words = OUTPUTS[case] or ("not a directory" if format == "atif" else "is a directory")
    if case == "a_dir_of_other_files":
        words = "which no ATIF export wrote"
    assert words in done.err, done.err


def _refused(run: Path, scratch: Path, target: Path, format: str) -> Done:
    before_run, before_scratch = snapshot(run), snapshot(scratch)
    kind = os.lstat(target).st_mode if os.path.lexists(target) else None
    done = verb("export", str(run), "--format", format, "--out", str(target))
    assert done.code == 2, (done.out, done.err)
    _assert_clean_failure(done, "")
    assert snapshot(run) == before_run
    assert snapshot(scratch) == before_scratch
    if kind is not None:
        assert os.lstat(target).st_mode == kind  # a device is still a device, a FIFO a FIFO
    assert not (run / "export").exists()
    return done


def test_the_issue_cases_end_as_one_line_on_the_real_command_line(tmp_path: Path) -> None:
    """``--out`` a device node and ``--out RUN/rollouts.jsonl``, through the console script."""
    run = write_run(tmp_path / "run").path
    records = (run / "rollouts.jsonl").read_bytes()
    for target in (device_node(tmp_path / "null"), run / "rollouts.jsonl"):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollcage",
                "export",
                str(run),
                "--format",
                "nemo-gym",
                "--out",
                str(target),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)
    assert (run / "rollouts.jsonl").read_bytes() == records


def test_an_atif_export_replaces_an_earlier_one_whole(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run").path
    out = tmp_path / "atif"
    assert verb("export", str(run), "--format", "atif", "--out", str(out)).code == 0
    # A superseded export's document for a rollout that is no longer final.
    (out / "calc-9-s0-t0.json").write_bytes((out / "calc-1-s0-t0.json").read_bytes())
    edit_json(run / "rollouts" / "calc-1-s1-t0" / "result.json", lambda value: value.update(started_at=1e308))
    done = verb("export", str(run), "--format", "atif", "--out", str(out))
    assert done.code == 0 and "skipped" in done.out, done.out
    assert sorted(path.name for path in out.iterdir()) == [
        "calc-1-s0-t0.json",
        "calc-2-s0-t0.json",
        "calc-4-s0-t0.json",
        "calc-5-s0-t0.json",
    ]
    assert _no_temporaries(tmp_path) == []


@pytest.mark.parametrize("format", FORMATS)
def test_a_disk_failure_midway_leaves_the_earlier_export_whole_and_nothing_else(
    tmp_path: Path, format: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = write_run(tmp_path / "run").path
    out = tmp_path / ("atif" if format == "atif" else "rows.jsonl")
    assert verb("export", str(run), "--format", format, "--out", str(out)).code == 0
    earlier = snapshot(out) if format == "atif" else out.read_bytes()
    # The next export differs from the first from its first document on.
    for rollout in ("calc-1-s0-t0", "calc-1-s1-t0", "calc-5-s0-t0"):
        edit_json(run / "rollouts" / rollout / "result.json", lambda value: value.update(started_at=1.0))
    real = durable._write_all
    writes = []

    def failing(fd: int, data: bytes) -> None:
        writes.append(len(data))
        if len(writes) == 3 or format == "nemo-gym":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(durable, "_write_all", failing)
    done = verb("export", str(run), "--format", format, "--out", str(out))
    assert done.code == 1, (done.out, done.err)
    _assert_clean_failure(done, "No space left on device")
    assert (snapshot(out) if format == "atif" else out.read_bytes()) == earlier
    assert _no_temporaries(tmp_path) == []


def test_the_issues_2_to_the_70_token_id_is_skipped_not_a_half_written_export(tmp_path: Path) -> None:
    """Issue 35: ``export --format atif`` wrote some files, then failed; nemo-gym printed a traceback."""
    run = write_run(tmp_path / "run").path

    def huge(value: dict[str, Any]) -> None:
        call = value["trajectory"]["model_calls"][1]
        call["tokens"].update(
            prompt_token_ids=[2**70], generation_token_ids=[5], generation_log_probs=[-0.1], status="observed"
        )
        call["usage"]["input_tokens"] = 2**70  # what NeMo Gym rows carry of every call

    edit_json(run / "rollouts" / "calc-1-s1-t0" / "result.json", huge)
    for format, out in (("atif", tmp_path / "atif"), ("nemo-gym", tmp_path / "rows.jsonl")):
        done = verb("export", str(run), "--format", format, "--out", str(out))
        # Skipped with its reason: as data no JSON writer carries, or (validated at the wire and
        # on reading) as a result whose token ids are out of range.
        assert done.code == 0 and ("1 not exportable" in done.out or "skipped 1 invalid" in done.out), (
            done.out,
            done.err,
        )
        documents = [json.loads(text) for text in _exported_texts(out)]
        ids = [document.get("session_id") or document.get("_ng_rollout_id") for document in documents]
        assert "calc-1-s1-t0" not in ids and len(ids) == (4 if format == "atif" else 2)


_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(exclude_categories=()), max_size=40),
    st.binary(max_size=40).map(lambda data: data.decode("utf-8", "surrogateescape")),
    st.sampled_from(
        ["", ".", "..", "../../x", "a/b", "\x00", "\u2028", "\ud800", "x" * 300, "café", "日本-1"]
    ),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rollout_id=_TEXT, task_id=_TEXT, tool_name=_TEXT, output=_TEXT)
def test_any_text_in_ids_tool_names_and_outputs_exports_as_valid_json_or_is_skipped(
    tmp_path_factory: pytest.TempPathFactory, rollout_id: str, task_id: str, tool_name: str, output: str
) -> None:
    base = tmp_path_factory.mktemp("prop")
    run = write_run(base / "run", torn_tail=False).path

    def hostile_result(value: dict[str, object]) -> None:
        trajectory = value["trajectory"]
        assert isinstance(trajectory, dict)
        for tool in trajectory["tool_calls"]:
            tool.update(name=tool_name, output=output)
        value.update(rollout_id=rollout_id, task_id=task_id)

    # JSON escapes every string, lone surrogates included: the files hold what a careless writer would.
    edit_json(run / "rollouts" / "calc-1-s0-t0" / "result.json", hostile_result)
    edit_record(run, 0, lambda value: value.update(rollout_id=rollout_id, task_id=task_id))
    before = snapshot(run)
    for format in FORMATS:
        out = base / f"out-{format}"
        try:
            report = export_run(run, format, out)  # type: ignore[arg-type]
        except ConfigError as exc:
            # A record line JSON cannot decode (a lone surrogate) is a damaged run: refused in words.
            assert "rollouts.jsonl line 1 is damaged" in str(exc)
            assert not out.exists()
            continue
        assert report.exported + sum(report.skipped.values()) == 6
        for text in _exported_texts(out):
            json.loads(text)
        if format == "atif":
            assert all(path.parent == out for path in out.rglob("*"))  # an id never leaves the directory
    assert snapshot(run) == before
    assert _no_temporaries(base) == []


@pytest.mark.timeout(60)
def test_a_record_read_back_from_a_copied_run_gives_the_copys_result_not_the_originals(
    tmp_path: Path,
) -> None:
    """``RolloutRecord.result(run_dir)`` follows the same rule as export: the run's own rollouts/<id>."""
    from rollcage.controller import load_records

    run = write_run(tmp_path / "run").path
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    DAMAGES["copied_original_different"](run, scratch)
    records: list[Any] = []
    load_records(run / "rollouts.jsonl", records.append, repair=False)
    first = records[0]
    assert first.rollout_id == "calc-1-s0-t0" and "decoy" in first.rollout_dir  # names the original
    result = first.result(run)
    assert result is not None and result.trajectory.tool_calls[0].output == "4"  # the copy's, not DECOY
    (run / "rollouts" / "calc-1-s1-t0" / "result.json").unlink()
    os.mkfifo(run / "rollouts" / "calc-1-s1-t0" / "result.json")
    assert records[1].result(run) is None
