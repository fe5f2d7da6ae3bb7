"""Finding and reading the artifacts the viewer shows, tolerantly.

The viewer is used most on rollouts that went wrong, so a damaged artifact is
something to *show*, never a reason to show nothing: every artifact that fails
to read is named in ``RolloutView.problems`` and the rest is still shown.
Paths the viewer cannot make sense of at all raise ``ViewerError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rollcage.durable import open_regular, read_bounded
from rollcage.errors import ViewerError
from rollcage.protocol import (
    Checkpoint,
    FileSeal,
    HealthFinding,
    RolloutRecord,
    RunMetrics,
    SupervisorReceipt,
    WorkerResult,
    describe_validation_error,
)
from rollcage.viewer._capture import CaptureComparison, compare_capture

__all__ = [
    "RecordReader",
    "RolloutView",
    "ViewTarget",
    "ViewerError",
    "enclosing_run",
    "find_record",
    "load_metrics",
    "load_rollout",
    "read_checkpoint",
    "resolve_target",
]

RESULT_NAME = "result.json"
CHECKPOINT_NAME = "checkpoint.jsonl"
RECEIPT_NAME = "receipt.json"
INPUT_NAME = "input.json"
CAPTURE_NAME = "model_capture.jsonl"
LOG_NAME = "worker.log"
DIFF_NAME = "workspace.diff"
RECORDS_NAME = "rollouts.jsonl"
METRICS_NAME = "metrics.json"

_M = TypeVar("_M", bound=BaseModel)

_ROLLOUT_FILES = (RESULT_NAME, CHECKPOINT_NAME, RECEIPT_NAME, INPUT_NAME)
MAX_ARTIFACT_BYTES = 1 << 30
"""The largest JSON artifact the viewer reads whole; only regular files are read (never a FIFO or device)."""
_LOG_TAIL_BYTES = 4096
DIFF_SHOWN_BYTES = 64 * 1024
"""How much of ``workspace.diff`` a view holds (the file itself may be larger)."""


@dataclass(frozen=True, slots=True)
class ViewTarget:
    """What a user-supplied path points at."""

    kind: Literal["rollout", "run"]
    """``rollout``: one rollout directory (or a file in one); ``run``: a run directory."""
    path: Path
    """The rollout or run directory."""
    prefer: Literal["result", "checkpoint"] | None = None
    """The artifact the user named explicitly; ``None``: the directory was named, show the best one."""
    file: Path | None = None
    """The file the user named, when it was a file."""


@dataclass(slots=True)
class RolloutView:
    """Everything read from one rollout directory, with what could not be read."""

    directory: Path
    """The rollout directory."""
    rollout_id: str
    """From the result, checkpoint, receipt or record, else the directory name."""
    task_id: str | None = None
    """From the result, input or record."""
    result: WorkerResult | None = None
    """``result.json``, if present and valid."""
    checkpoint: Checkpoint | None = None
    """The folded journal, read when there is no valid result or it was asked for."""
    receipt: SupervisorReceipt | None = None
    """``receipt.json``, else the receipt in the run's record."""
    record: RolloutRecord | None = None
    """This attempt's line in the run's ``rollouts.jsonl``, when the rollout sits in a run."""
    task_input: str | list[Any] | None = None
    """The model-visible input from ``input.json`` (read loosely: only this and the instructions)."""
    instructions: str | None = None
    """The system instructions from ``input.json``."""
    capture: CaptureComparison | None = None
    """``model_capture.jsonl`` compared with the trajectory; ``None`` without a capture."""
    log_tail: str | None = None
    """The last few KiB of ``worker.log``."""
    workspace_diff: str | None = None
    """The start of ``workspace.diff`` (what the rollout changed), at most ``DIFF_SHOWN_BYTES``."""
    run_findings: dict[str, HealthFinding] = field(default_factory=dict)
    """The run's health findings (from ``metrics.json``) that name this rollout."""
    problems: list[str] = field(default_factory=list)
    """Artifacts that were missing where expected or failed to read, in words."""

    @property
    def partial(self) -> bool:
        """Shown from a checkpoint only: evidence, never graded."""
        return self.result is None and self.checkpoint is not None


def resolve_target(path: Path) -> ViewTarget:
    """Decide whether ``path`` is a rollout (directory or artifact) or a run directory.

    Raises:
        ViewerError: ``path`` does not exist or is none of these.
    """
    if not path.exists():
        raise ViewerError(f"{path}: no such file or directory")
    if path.is_dir():
        if (path / RECORDS_NAME).is_file() or (path / METRICS_NAME).is_file():
            return ViewTarget("run", path)
        if any((path / name).exists() for name in _ROLLOUT_FILES):
            return ViewTarget("rollout", path)
        raise ViewerError(
            f"{path}: not a rollout directory (no {', '.join(_ROLLOUT_FILES)}) "
            f"and not a run directory (no {RECORDS_NAME} or {METRICS_NAME})"
        )
    name = path.name
    if name in (RECORDS_NAME, METRICS_NAME):
        return ViewTarget("run", path.parent, file=path)
    if name == CHECKPOINT_NAME:
        return ViewTarget("rollout", path.parent, prefer="checkpoint", file=path)
    if name == RESULT_NAME:
        return ViewTarget("rollout", path.parent, prefer="result", file=path)
    # Any other name must prove what it is by its content.
    if path.suffix == ".json" and _parses(path, WorkerResult):
        return ViewTarget("rollout", path.parent, prefer="result", file=path)
    if path.suffix == ".jsonl":
        try:
            read_checkpoint(path)
        except Exception:  # any failure at all means "not a journal"
            pass
        else:
            return ViewTarget("rollout", path.parent, prefer="checkpoint", file=path)
    raise ViewerError(
        f"{path}: not a file the viewer knows (expected {RESULT_NAME}, {CHECKPOINT_NAME}, "
        f"a rollout directory or a run directory)"
    )


def _parses(path: Path, model: type[BaseModel]) -> bool:
    try:
        model.model_validate_json(read_bounded(path, limit=MAX_ARTIFACT_BYTES))
    except (OSError, ValidationError, ValueError):
        return False
    return True


def read_checkpoint(path: Path) -> Checkpoint:
    """Fold a ``checkpoint.jsonl`` journal with ``rollcage.load_checkpoint``.

    The journal format (sequence numbers, checksums, torn-line rules) belongs to
    ``rollcage.checkpoint``; the viewer reuses it rather than reading the journal
    a second, possibly different, way.

    Raises:
        ViewerError: the journal cannot be read or folded (the message says why).
    """
    from rollcage.checkpoint import load_checkpoint

    try:
        return load_checkpoint(path)
    except (OSError, ValueError) as exc:
        raise ViewerError(f"{path}: cannot read the checkpoint journal: {exc}") from exc


def load_rollout(
    path: Path,
    *,
    prefer: Literal["result", "checkpoint"] | None = None,
    record: RolloutRecord | None = None,
    metrics: RunMetrics | None = None,
    run_dir: Path | None = None,
    file: Path | None = None,
) -> RolloutView:
    """Read one rollout directory.

    Args:
        path: the rollout directory.
        prefer: ``checkpoint`` shows the journal even when a result exists;
            ``result``/``None`` show the result, falling back to the journal.
        record: this attempt's run record, if the caller has it already (the
            report streams them); otherwise it is looked up in ``run_dir``, or in
            the run that encloses ``path``.
        metrics: the run's metrics, for health findings naming this rollout.
        run_dir: the run directory to look the record up in.
        file: the artifact the user named (a result or a journal), which may
            have a name other than ``result.json``/``checkpoint.jsonl``.

    Never raises for damaged artifacts: they are listed in ``problems``.
    """
    view = RolloutView(directory=path, rollout_id=path.name)
    view.record = record if record is not None else _look_up_record(path, run_dir, view.problems)
    _read_input(view, path / INPUT_NAME)
    _read_trajectory(view, path, prefer, file)
    view.receipt = _read_model(path / RECEIPT_NAME, SupervisorReceipt, view.problems)
    if view.receipt is None and view.record is not None:
        view.receipt = view.record.receipt
    _name(view, path)
    trajectory = (
        view.result.trajectory if view.result else view.checkpoint.trajectory if view.checkpoint else None
    )
    capture_path = path / CAPTURE_NAME
    if trajectory is not None and capture_path.is_file():
        try:
            view.capture = compare_capture(trajectory, capture_path)
        except OSError as exc:
            view.problems.append(f"{CAPTURE_NAME}: cannot read: {exc}")
    view.log_tail = _read_tail(path / LOG_NAME, view.problems)
    seal = view.record.workspace_diff if view.record is not None else None
    view.workspace_diff = _read_diff(path / DIFF_NAME, seal, view.problems)
    if metrics is not None:
        view.run_findings = {
            name: finding for name, finding in metrics.health.items() if view.rollout_id in finding.rollouts
        }
    if view.result is None and view.checkpoint is None and not (path / CHECKPOINT_NAME).exists():
        view.problems.append(f"no {RESULT_NAME} and no {CHECKPOINT_NAME}: nothing of the trajectory survived")
    return view


def _look_up_record(path: Path, run_dir: Path | None, problems: list[str]) -> RolloutRecord | None:
    """The rollout's record in ``run_dir``, or in the run that encloses ``path``; ``None`` if none."""
    run = run_dir if run_dir is not None else enclosing_run(path)
    if run is None:
        return None
    try:
        return find_record(run, path.name)
    except OSError as exc:
        problems.append(f"{RECORDS_NAME}: cannot read: {exc}")
        return None


def _read_input(view: RolloutView, path: Path) -> None:
    """What the model was asked (``input.json``), read leniently: a damaged field is left out."""
    raw_input = _read_json_object(path, view.problems, required=False)
    if raw_input is None:
        return
    task_input = raw_input.get("input")
    if isinstance(task_input, str | list):
        view.task_input = task_input
    instructions = raw_input.get("instructions")
    view.instructions = instructions if isinstance(instructions, str) else None
    task_id = raw_input.get("task_id")
    view.task_id = task_id if isinstance(task_id, str) else None


def _read_trajectory(
    view: RolloutView, path: Path, prefer: Literal["result", "checkpoint"] | None, file: Path | None
) -> None:
    """The result, else (or, with ``prefer="checkpoint"``, instead) the journal folded."""
    if prefer != "checkpoint":
        result_path = file if file is not None and prefer == "result" else path / RESULT_NAME
        view.result = _read_model(result_path, WorkerResult, view.problems)
    journal = file if file is not None and prefer == "checkpoint" else path / CHECKPOINT_NAME
    if view.result is None and journal.exists():
        try:
            view.checkpoint = read_checkpoint(journal)
        except ViewerError as exc:
            view.problems.append(str(exc))


def _name(view: RolloutView, path: Path) -> None:
    """The rollout and task ids: the first the artifacts agree on, most trusted first."""
    record = view.record
    view.rollout_id = _first_str(
        view.result.rollout_id if view.result else None,
        view.checkpoint.rollout_id if view.checkpoint else None,
        view.receipt.rollout_id if view.receipt else None,
        record.rollout_id if record else None,
        path.name,
    )
    view.task_id = _first_str(
        view.result.task_id if view.result else None, view.task_id, record.task_id if record else None
    )


def _first_str(*values: str | None) -> str:
    return next((value for value in values if value), "")


def _read_model(path: Path, model: type[_M], problems: list[str]) -> _M | None:
    if not path.exists():
        return None
    try:
        return model.model_validate_json(read_bounded(path, limit=MAX_ARTIFACT_BYTES))
    except OSError as exc:
        problems.append(f"{path.name}: cannot read: {exc}")
    except ValidationError as exc:
        problem = describe_validation_error(exc, limit=1)
        problems.append(f"{path.name}: not a valid {model.__name__}: {problem}")
    return None


def _read_json_object(path: Path, problems: list[str], *, required: bool) -> dict[str, Any] | None:
    if not path.exists():
        if required:
            problems.append(f"{path.name}: missing")
        return None
    try:
        value = orjson.loads(read_bounded(path, limit=MAX_ARTIFACT_BYTES))
    except (OSError, orjson.JSONDecodeError) as exc:
        problems.append(f"{path.name}: cannot read: {exc}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return value


def _read_tail(path: Path, problems: list[str]) -> str | None:
    if not path.exists():
        return None
    try:
        with open_regular(path) as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - _LOG_TAIL_BYTES))
            data = handle.read()
    except OSError as exc:
        problems.append(f"{path.name}: cannot read: {exc}")
        return None
    text = data.decode("utf-8", errors="replace")
    if size > _LOG_TAIL_BYTES:
        # Start at a line boundary so the first line shown is not a fragment.
        newline = text.find("\n")
        text = f"… [{size - _LOG_TAIL_BYTES + newline + 1:,} earlier bytes]\n{text[newline + 1 :]}"
    return text


def _read_diff(path: Path, seal: FileSeal | None, problems: list[str]) -> str | None:
    """The start of ``workspace.diff``; checked whole against the record's seal where there is one.

    The controller does not sync the file (it is derived), so after a machine crash it may be
    missing, empty or torn beside a record that reached the disk: such a file is a problem, never
    shown as the diff.
    """
    if seal is None:
        return _read_head(path, problems)
    try:
        data = read_bounded(path, limit=seal.size)
    except OSError as exc:
        torn = " (a machine crash before it reached the disk?)"
        problems.append(f"{path.name}: cannot read the file its record seals: {exc}{torn}; not shown")
        return None
    if not seal.matches(data):
        problems.append(
            f"{path.name}: torn: it does not match its record's seal (a machine crash before it reached "
            "the disk?); not shown"
        )
        return None
    return _shown(path, data[:DIFF_SHOWN_BYTES], len(data))


def _read_head(path: Path, problems: list[str]) -> str | None:
    if not path.exists():
        return None
    try:
        with open_regular(path) as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(0)
            data = handle.read(DIFF_SHOWN_BYTES)
    except OSError as exc:
        problems.append(f"{path.name}: cannot read: {exc}")
        return None
    return _shown(path, data, size)


def _shown(path: Path, data: bytes, size: int) -> str:
    """``data``, the start of the file at ``path`` (``size`` bytes), as shown: cut at a line, with a note."""
    text = data.decode("utf-8", errors="replace")
    if size > DIFF_SHOWN_BYTES:
        # End at a line boundary so the last line shown is not a fragment.
        text = text[: text.rfind("\n") + 1] + f"… [{size - len(data):,} more bytes in {path.name}]\n"
    return text


def enclosing_run(rollout_dir: Path) -> Path | None:
    """The run directory holding ``rollout_dir`` (``RUN/rollouts/<id>/``), if it is in one."""
    parent = rollout_dir.resolve().parent
    if parent.name == "rollouts" and (parent.parent / RECORDS_NAME).is_file():
        return parent.parent
    return None


def find_record(run_dir: Path, rollout_id: str) -> RolloutRecord | None:
    """The last record of ``rollout_id`` in the run's ``rollouts.jsonl`` (streamed, not loaded whole)."""
    found: RolloutRecord | None = None
    # Only lines that mention the id are parsed. A writer may escape non-ASCII or
    # quote characters differently, so the pre-filter is used for plain ids only.
    plain = rollout_id.isascii() and rollout_id.isprintable() and not any(c in rollout_id for c in '"\\')
    needle = rollout_id.encode() if plain else None
    reader = RecordReader(run_dir / RECORDS_NAME, needle=needle)
    for record in reader:
        if record.rollout_id == rollout_id:
            found = record
    return found


def load_metrics(run_dir: Path) -> RunMetrics | None:
    """``metrics.json`` of a run; ``None`` if there is none yet.

    Raises:
        ViewerError: it exists but cannot be read or is not a ``RunMetrics``.
    """
    path = run_dir / METRICS_NAME
    if not path.exists():
        return None
    try:
        return RunMetrics.model_validate_json(read_bounded(path, limit=MAX_ARTIFACT_BYTES))
    except (OSError, ValidationError) as exc:
        raise ViewerError(f"{path}: cannot read run metrics: {exc}") from exc


class RecordReader:
    """Streams ``rollouts.jsonl`` one record at a time.

    The controller appends and fsyncs one line per attempt, so a crash can leave
    a torn last line: it is skipped and noted in ``torn_tail``. A damaged line
    elsewhere is skipped and its number kept in ``invalid_lines``.
    """

    def __init__(self, path: Path, *, needle: bytes | None = None) -> None:
        """Read ``path``; with ``needle``, parse only lines containing those bytes (a fast pre-filter)."""
        self.path = path
        self.needle = needle
        self.torn_tail = False
        self.invalid_lines: list[int] = []

    def __iter__(self) -> Iterator[RolloutRecord]:
        """Yield each intact record in file order.

        Raises:
            OSError: the file cannot be opened or read.
        """
        with open_regular(self.path) as handle:
            previous: tuple[int, bytes] | None = None
            for number, line in enumerate(handle, start=1):
                if previous is not None:
                    record = self._parse(*previous, last=False)
                    if record is not None:
                        yield record
                previous = (number, line)
            if previous is not None:
                record = self._parse(*previous, last=True)
                if record is not None:
                    yield record

    def _parse(self, number: int, line: bytes, *, last: bool) -> RolloutRecord | None:
        if not line.strip():
            return None
        if self.needle is not None and self.needle not in line:
            return None
        try:
            return RolloutRecord.model_validate_json(line)
        except ValidationError:
            if last:
                self.torn_tail = True
            else:
                self.invalid_lines.append(number)
            return None
