"""``rollcage export RUN``: a run's rollouts as ATIF trajectories or as NeMo Gym rollout JSONL.

What is exported: each sample's final attempt (the last record of each task and
sample in ``rollouts.jsonl``) whose ``result.json`` is valid. NeMo Gym's rollout
JSONL holds rollouts with a reward (graded, unmasked), as ``ng_collect_rollouts``'
main file does; ATIF holds every final trajectory, its outcome and reward beside it.
Everything skipped is counted with the reason: a rollout whose artifacts are
missing, damaged, or hold values JSON cannot carry (an integer beyond 64 bits) is
left out, never a reason to stop the export.

Artifacts are read from the run's own ``rollouts/<rollout_id>/`` only
(``rollcage.runfiles.locate_rollout``): a record's ``rollout_dir`` is never
followed. The output is checked first (``rollcage.runfiles.check_output``: never
a device, FIFO, socket or link, never the run's own files) and published whole:
the JSONL file atomically, the ATIF directory (one ``<rollout_id>.json`` per
trajectory) staged beside its target and swapped in at the end, so an earlier
export is replaced entirely or not at all.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson
from pydantic import ValidationError

from rollcage.controller import load_records
from rollcage.durable import StagedDirectory, open_regular, publish_bytes, read_bounded
from rollcage.errors import ConfigError, DurableWriteError
from rollcage.export._atif import read_workspace_diff, to_atif
from rollcage.export._nemo import to_nemo_gym_row
from rollcage.protocol import RolloutRecord, WorkerInput, WorkerResult, describe_validation_error
from rollcage.runfiles import check_output, file_name_problem, locate_rollout

__all__ = ["ExportFormat", "ExportReport", "default_destination", "export_run"]

ExportFormat = Literal["atif", "nemo-gym"]
"""``atif``: one ATIF v1.7 trajectory per rollout; ``nemo-gym``: NeMo Gym's rollout JSONL."""

_MAX_ARTIFACT_BYTES = 1 << 30
_ATIF_HEAD = b'{"schema_version":"ATIF-'
"""How every document an ATIF export writes begins (any ATIF version): what tells an earlier export from
other files in a directory it is asked to replace."""


@dataclass
class ExportReport:
    """What an export wrote and what it left out.

    Attributes:
        destination: The file (nemo-gym) or directory (atif) written.
        exported: Rollouts written.
        skipped: Final attempts left out, by reason.
        relocated: Records whose ``rollout_dir`` named a directory outside the run
            (a moved or copied run, or an edited record); read from the run's own.
    """

    destination: Path
    exported: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    relocated: int = 0


def default_destination(run_dir: Path, format: ExportFormat) -> Path:
    """``RUN/export/atif/`` or ``RUN/export/nemo-gym.jsonl``."""
    return run_dir / "export" / ("atif" if format == "atif" else "nemo-gym.jsonl")


def export_run(run_dir: Path, format: ExportFormat, destination: Path | None = None) -> ExportReport:
    """Export a run's final rollouts (blocking: it reads and writes files).

    Args:
        run_dir: The run directory (``rollouts.jsonl`` and ``rollouts/``).
        format: ``atif`` or ``nemo-gym``.
        destination: Where to write; ``None``: ``default_destination``. An
            existing ATIF directory is replaced only if it is empty or holds an
            earlier ATIF export and nothing else.

    Raises:
        ConfigError: ``run_dir`` has no ``rollouts.jsonl``, it cannot be read or is
            damaged, or ``destination`` may not be written (see ``check_output``).
        DurableWriteError: The output could not be written (nothing partial is left).
    """
    log = run_dir / "rollouts.jsonl"
    if not log.exists():
        raise ConfigError(f"{run_dir} is not a run directory: it has no rollouts.jsonl")
    if not log.is_file():
        # A FIFO would hang the reader and a device never end: only a regular file is a run's records.
        raise ConfigError(f"{log} is not a regular file; it cannot be a run's records")
    target = destination if destination is not None else default_destination(run_dir, format)
    check_output(target, run_dir=run_dir, kind="directory" if format == "atif" else "file", what="the export")
    if format == "atif":
        _check_replaceable(target)
    finals: dict[tuple[str, int], RolloutRecord] = {}
    try:
        load_records(
            log, lambda record: finals.__setitem__((record.task_id, record.sample), record), repair=False
        )
    except OSError as exc:
        raise ConfigError(f"cannot read {log}: {exc.strerror or exc}") from exc
    report = ExportReport(destination=target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DurableWriteError(f"cannot create {target.parent}: {exc.strerror or exc}") from exc
    if format == "atif":
        with StagedDirectory(target) as staged:
            for document in _documents(run_dir, finals.values(), format, report):
                staged.add(*document)
    else:
        lines = [data for _, data in _documents(run_dir, finals.values(), format, report)]
        publish_bytes(target, b"".join(lines), mode=0o644)
    return report


def _documents(
    run_dir: Path, finals: Iterable[RolloutRecord], format: ExportFormat, report: ExportReport
) -> Iterator[tuple[str, bytes]]:
    """Each exportable rollout as (file name, bytes), one at a time; what is left out counts in ``report``."""
    task_index: dict[str, int] = {}
    names: set[str] = set()
    for record in finals:
        first_seen = task_index.setdefault(record.task_id, len(task_index))
        # The dataset row the controller recorded; records from before it did get their first-seen order.
        index = record.task_index if record.task_index is not None else first_seen
        name = f"{record.rollout_id}.json"
        loaded = _load(run_dir, record, report)
        if isinstance(loaded, str):
            report.skipped[loaded] += 1
            continue
        if format == "nemo-gym" and (record.reward is None or record.masked):
            report.skipped["no reward (not graded, or masked)"] += 1
            continue
        if format == "atif" and name in names:
            report.skipped["a rollout id used twice"] += 1
            continue
        if format == "atif" and file_name_problem(name) is not None:
            report.skipped["a rollout id that is no file name"] += 1
            continue
        result, spec = loaded
        try:
            if format == "atif":
                diff = read_workspace_diff(locate_rollout(run_dir, record).directory, record.workspace_diff)
                document = to_atif(record, result, spec, workspace_diff=diff)
                data = orjson.dumps(document, option=orjson.OPT_APPEND_NEWLINE)
            else:
                data = orjson.dumps(
                    to_nemo_gym_row(record, result, spec, task_index=index), option=orjson.OPT_APPEND_NEWLINE
                )
        except Exception as exc:  # one damaged rollout (a 2**70 token id, a year-10**300 time) is skipped
            report.skipped[f"not exportable ({_brief(exc)})"] += 1
            continue
        names.add(name)
        report.exported += 1
        yield name, data


def _load(
    run_dir: Path, record: RolloutRecord, report: ExportReport
) -> tuple[WorkerResult, WorkerInput] | str:
    """The attempt's result and input, from the run's own rollout directory, or why there are none."""
    if not record.receipt.result_valid:
        return "no valid result.json"
    location = locate_rollout(run_dir, record)
    if location.directory is None:
        return "rollout directory refused (an id that is no file name, or a link out of the run)"
    if location.relocated:
        report.relocated += 1
    directory = location.directory
    try:
        result = WorkerResult.model_validate_json(
            read_bounded(directory / "result.json", limit=_MAX_ARTIFACT_BYTES)
        )
        spec = WorkerInput.model_validate_json(
            read_bounded(directory / "input.json", limit=_MAX_ARTIFACT_BYTES)
        )
    except OSError as exc:
        return f"unreadable rollout directory ({exc.strerror or type(exc).__name__})"
    except ValidationError as exc:
        return f"invalid artifact ({describe_validation_error(exc, limit=1)})"
    return result, spec


def _check_replaceable(target: Path) -> None:
    """An existing ATIF target is replaced whole, so it may hold only an earlier ATIF export's documents."""
    try:
        names = os.listdir(target)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot write the export to {target}: {exc.strerror or exc}") from exc
    for name in names:
        path = target / name
        try:
            if not name.endswith(".json") or path.is_symlink():
                raise OSError
            with open_regular(path) as handle:
                head = handle.read(len(_ATIF_HEAD))
        except OSError:
            head = b""
        if head != _ATIF_HEAD:
            raise ConfigError(
                f"{target} holds {name!r}, which no ATIF export wrote; an export replaces its directory "
                "whole: give a new or empty directory"
            )


def _brief(exc: BaseException) -> str:
    """An exception in a few words, for a skip reason (counted, so it must not carry per-rollout detail)."""
    return type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {str(exc)[:80]}"
