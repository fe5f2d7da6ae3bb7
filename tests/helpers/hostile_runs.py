"""Damaged, copied and edited run directories, and hostile output paths, for the verbs that read runs.

``export``, ``show`` and ``report`` share these tables: each damage is a function
that spoils one thing in a run written by ``write_run`` (a torn or non-UTF-8
record line, a missing or corrupt artifact, a 2**70 token id, a record whose
``rollout_dir`` or id points out of the run, a copied run whose original is gone
or different), and each output is a path the verb must refuse (a device node, a
FIFO, a socket, a link, the run's own files). A decoy rollout directory outside
the run holds ``DECOY``: a verb that follows a record out of its run shows it.

``verb`` runs the real command line in this process (``rollcage.cli._dispatch``,
what ``rollcage`` runs) and returns its exit code and output; an exception that
escapes it is what a user would see as a traceback, so it fails the test.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers.viewer_fixtures import completed_result, receipt, write_rollout_dir

__all__ = [
    "DAMAGES",
    "DECOY",
    "OUTPUTS",
    "Done",
    "Snapshot",
    "decoy_rollout",
    "device_node",
    "edit_json",
    "edit_record",
    "held_socket",
    "make_output",
    "short_tempdir",
    "snapshot",
    "verb",
]

DECOY = "DECOY-ARTIFACT-FROM-OUTSIDE-THE-RUN"
"""The answer of the decoy rollout: it appears in a verb's output only if the verb left the run."""

Snapshot = dict[str, tuple[str, bytes | str | None]]


def snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` (links not followed): its kind and, for files and links, its content."""
    entries: Snapshot = {}
    if not os.path.lexists(root):
        return entries
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(directory, name)
            mode = os.lstat(path).st_mode
            key = str(path.relative_to(root))
            if stat.S_ISLNK(mode):
                entries[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(mode):
                entries[key] = ("file", path.read_bytes())
            else:
                entries[key] = (stat.filemode(mode)[0], None)
    return entries


@dataclass
class Done:
    """What a command line did."""

    code: int
    out: str
    err: str


def verb(*argv: str) -> Done:
    """Run ``rollcage ARGV`` as the console script does, in this process; its code, stdout and stderr."""
    from rollcage.cli import _dispatch

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = _dispatch(list(argv))
    return Done(code, out.getvalue(), err.getvalue())


def decoy_rollout(scratch: Path, rollout_id: str = "calc-1-s0-t0") -> Path:
    """A rollout directory outside any run under test, whose answer is ``DECOY``."""
    result = completed_result(rollout_id, "calc-1", answer=DECOY, tool_output=DECOY)
    return write_rollout_dir(
        scratch / "decoy" / "rollouts" / rollout_id,
        result=result,
        receipt_model=receipt(rollout_id, "completed"),
        task_input=DECOY,
    )


def edit_json(path: Path, edit: Callable[[Any], None]) -> None:
    """Rewrite the JSON file at ``path`` with ``edit`` applied to its value (ints of any size kept)."""
    import json

    value = json.loads(path.read_bytes())
    edit(value)
    path.write_text(json.dumps(value))


def edit_record(run_dir: Path, index: int, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite record ``index`` of ``rollouts.jsonl`` with ``edit`` applied (other lines byte-identical)."""
    import json

    path = run_dir / "rollouts.jsonl"
    lines = path.read_bytes().split(b"\n")
    value = json.loads(lines[index])
    edit(value)
    lines[index] = json.dumps(value).encode()
    path.write_bytes(b"\n".join(lines))


def _insert_line(run_dir: Path, at: int, line: bytes) -> None:
    path = run_dir / "rollouts.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines.insert(at, line)
    path.write_bytes(b"\n".join(lines))


def _replace(path: Path, data: bytes | None) -> None:
    """Put ``data`` at ``path`` (``None``: a FIFO) in place of whatever was there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if data is None:
        os.mkfifo(path)
    else:
        path.write_bytes(data)


def _rollout(run_dir: Path, rollout_id: str = "calc-1-s0-t0") -> Path:
    return run_dir / "rollouts" / rollout_id


def _first_call(value: dict[str, Any]) -> dict[str, Any]:
    call: dict[str, Any] = value["trajectory"]["model_calls"][0]
    return call


def _huge_tokens(value: dict[str, Any]) -> None:
    _first_call(value)["tokens"] = {
        "prompt_token_ids": [1, 2**70],
        "generation_token_ids": [2**70],
        "generation_log_probs": [-0.5],
        "status": "observed",
        "missing": [],
    }


def _huge_usage(value: dict[str, Any]) -> None:
    _first_call(value)["usage"]["input_tokens"] = 2**70
    _first_call(value)["usage"]["total_tokens"] = 10**400


def _huge_record(value: dict[str, Any]) -> None:
    value["sample"] = 2**70
    value["try_index"] = 10**30
    value["metrics"]["total_tokens"] = 10**400
    value["metrics"]["model_calls"] = 2**64


def _copy_run(run_dir: Path, scratch: Path, *, keep_original: bool) -> None:
    """Make ``run_dir`` a copy of a run written elsewhere, whose records name the original's directories.

    The original is deleted, or kept with different (decoy) artifacts.
    """
    original = scratch / "decoy"
    for index in range(6):
        edit_record(
            run_dir,
            index,
            lambda value: value.__setitem__("rollout_dir", str(original / "rollouts" / value["rollout_id"])),
        )
    if keep_original:
        decoy_rollout(scratch)
    else:
        shutil.rmtree(original, ignore_errors=True)


def _damages() -> dict[str, Callable[[Path, Path], None]]:
    """Name -> function(run_dir, scratch) that spoils a run written by ``write_run``."""
    calc1 = "calc-1-s0-t0"
    return {
        # rollouts.jsonl
        "torn_last_line": lambda run, _: None,  # write_run leaves a torn tail already
        "torn_middle_line": lambda run, _: _insert_line(run, 2, b'{"schema_version":2,"rollout_id":"calc-9'),
        "non_utf8_line": lambda run, _: _insert_line(run, 1, b'\xff\xfe{"rollout_id": "\xc3\x28"}'),
        "records_empty": lambda run, _: _replace(run / "rollouts.jsonl", b""),
        "records_fifo": lambda run, _: _replace(run / "rollouts.jsonl", None),
        "records_directory": lambda run, _: (
            (run / "rollouts.jsonl").unlink(),
            (run / "rollouts.jsonl").mkdir(),
        ),
        # huge numbers in records (an older version wrote them)
        "record_huge_ints": lambda run, _: edit_record(run, 0, _huge_record),
        "record_huge_reward": lambda run, _: (
            edit_record(run, 0, lambda value: value.__setitem__("reward", 1e308)),
            edit_record(run, 1, lambda value: value.__setitem__("reward", 1e308)),
            edit_record(run, 5, lambda value: value.__setitem__("reward", -1e308)),
        ),
        # rollout directories and their artifacts
        "missing_rollout_dir": lambda run, _: shutil.rmtree(_rollout(run)),
        "missing_rollouts_tree": lambda run, _: shutil.rmtree(run / "rollouts"),
        "result_missing": lambda run, _: (_rollout(run) / "result.json").unlink(),
        "result_truncated": lambda run, _: _replace(
            _rollout(run) / "result.json", (_rollout(run) / "result.json").read_bytes()[:300]
        ),
        "result_non_utf8": lambda run, _: _replace(
            _rollout(run) / "result.json", b'{"rollout_id": "\xff\xfe"}'
        ),
        "result_fifo": lambda run, _: _replace(_rollout(run) / "result.json", None),
        "result_huge_token_ids": lambda run, _: edit_json(_rollout(run) / "result.json", _huge_tokens),
        "result_huge_usage": lambda run, _: edit_json(_rollout(run) / "result.json", _huge_usage),
        "result_far_timestamp": lambda run, _: edit_json(
            _rollout(run) / "result.json", lambda value: value.__setitem__("started_at", 1e308)
        ),
        "receipt_corrupt": lambda run, _: _replace(_rollout(run) / "receipt.json", b'{"rollout_id": 1'),
        "checkpoint_corrupt": lambda run, _: _replace(
            _rollout(run, "calc-3-s0-t0") / "checkpoint.jsonl", b'{"seq": 1, "kind"\n\xff\xfe\n'
        ),
        "capture_corrupt": lambda run, _: _replace(
            _rollout(run) / "model_capture.jsonl", b'{"seq": 1,\n\xff\xfe\n{"seq": 2}\n'
        ),
        "input_corrupt": lambda run, _: _replace(_rollout(run) / "input.json", b"[\xff"),
        "metrics_corrupt": lambda run, _: _replace(run / "metrics.json", b'{"rollouts": \xff'),
        "metrics_huge": lambda run, _: edit_json(
            run / "metrics.json",
            lambda value: value.update(
                rollouts=2**70, mean_reward=1e308, tokens={"input_tokens": 2**70, "total_tokens": 10**400}
            ),
        ),
        # records that point out of the run
        "record_absolute_elsewhere": lambda run, scratch: edit_record(
            run, 0, lambda value: value.__setitem__("rollout_dir", str(decoy_rollout(scratch)))
        ),
        "record_dotdot": lambda run, scratch: (
            decoy_rollout(scratch),
            edit_record(
                run,
                0,
                lambda value: value.__setitem__(
                    "rollout_dir", str(Path("rollouts", "..", "..", scratch.name, "decoy", "rollouts", calc1))
                ),
            ),
        ),
        "record_id_traversal": lambda run, scratch: (
            decoy_rollout(scratch),
            edit_record(
                run,
                0,
                lambda value: value.update(
                    rollout_id=f"../../{scratch.name}/decoy/rollouts/{calc1}",
                    rollout_dir=str(scratch / "decoy" / "rollouts" / calc1),
                ),
            ),
        ),
        "record_id_nul": lambda run, _: edit_record(
            run, 0, lambda value: value.update(rollout_id="calc\x00-1")
        ),
        "rollout_dir_symlink_out": lambda run, scratch: (
            shutil.rmtree(_rollout(run)),
            _rollout(run).symlink_to(decoy_rollout(scratch), target_is_directory=True),
        ),
        # copied runs
        "copied_original_deleted": lambda run, scratch: _copy_run(run, scratch, keep_original=False),
        "copied_original_different": lambda run, scratch: _copy_run(run, scratch, keep_original=True),
    }


DAMAGES = _damages()
"""Name -> function(run_dir, scratch) that spoils a run written by ``write_run``."""


def device_node(path: Path) -> Path:
    """A character device node at ``path`` made like ``/dev/null`` (skips the test without CAP_MKNOD)."""
    import pytest

    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # what /dev/null is
    except PermissionError:
        pytest.skip("making a device node needs CAP_MKNOD")
    return path


@contextlib.contextmanager
def short_tempdir() -> Iterator[Path]:
    """A temporary directory with a short path (a Unix socket's path is at most 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="rc-", dir="/tmp") as name:
        yield Path(name)


OUTPUTS: dict[str, str] = {  # case -> words of the refusal
    "device": "character device",
    "fifo": "FIFO",
    "socket": "socket",
    "symlink_to_a_file": "symbolic link",
    "symlink_to_the_records": "run's own rollouts.jsonl",
    "the_records": "run's own rollouts.jsonl",
    "the_metrics": "run's own metrics.json",
    "inside_a_rollout_dir": "run's own rollouts/",
    "the_rollouts_tree": "run's own rollouts/",
    "the_run_dir": "is or contains the run directory",
    "a_dir_containing_the_run": "is or contains the run directory",
    "through_a_linked_parent": "run's own rollouts.jsonl",
    "under_a_file": "is not a directory",
    "wrong_kind": "",  # a directory for a file, a file for a directory
    "a_dir_of_other_files": "",  # ATIF only: never replaces a directory it did not write
}


def make_output(case: str, *, directory: bool, run: Path, scratch: Path) -> Path:
    """Make the hostile output ``case`` in ``scratch`` (or name it in ``run``); the path to write to.

    ``directory``: the verb writes a directory (an ATIF export), else a file. ``socket``
    is made by ``held_socket``, not here.
    """
    atif = directory
    if case == "device":
        return device_node(scratch / "null")
    if case == "fifo":
        os.mkfifo(scratch / "fifo")
        return scratch / "fifo"
    if case == "symlink_to_a_file":
        (scratch / "precious.txt").write_text("precious")
        (scratch / "link").symlink_to(scratch / "precious.txt")
        return scratch / "link"
    if case == "symlink_to_the_records":
        (scratch / "link").symlink_to(run / "rollouts.jsonl")
        return scratch / "link"
    if case == "the_records":
        return run / "rollouts.jsonl"
    if case == "the_metrics":
        return run / "metrics.json"
    if case == "inside_a_rollout_dir":
        return run / "rollouts" / "calc-1-s0-t0" / ("atif" if atif else "result.json")
    if case == "the_rollouts_tree":
        return run / "rollouts"
    if case == "the_run_dir":
        return run
    if case == "a_dir_containing_the_run":
        return run.parent
    if case == "through_a_linked_parent":
        (scratch / "linked").symlink_to(run, target_is_directory=True)
        return scratch / "linked" / "rollouts.jsonl"
    if case == "under_a_file":
        (scratch / "file.txt").write_text("a file")
        return scratch / "file.txt" / "out"
    if case == "wrong_kind":
        if atif:
            (scratch / "file.json").write_text("{}")
            return scratch / "file.json"
        (scratch / "dir").mkdir()
        return scratch / "dir"
    assert case == "a_dir_of_other_files"
    (scratch / "mine").mkdir()
    (scratch / "mine" / "notes.txt").write_text("my notes")
    (scratch / "mine" / "data.json").write_text('{"mine": true}')
    return scratch / "mine"


@contextlib.contextmanager
def held_socket(path: Path) -> Iterator[Path]:
    """A listening Unix socket bound at ``path`` (at most 107 bytes), closed and removed on exit."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(path))
        server.listen(1)
        yield path
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
