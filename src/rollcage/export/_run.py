"""``rollcage export RUN``: a run's rollouts as ATIF trajectories or as NeMo Gym rollout JSONL.

What is exported: each sample's final attempt (the last record of each task and
sample in ``rollouts.jsonl``) whose ``result.json`` is valid. NeMo Gym's rollout
JSONL holds rollouts with a reward (graded, unmasked), as ``ng_collect_rollouts``'
main file does; ATIF holds every final trajectory, its outcome and reward beside it.
Everything skipped is counted with the reason. Output is published atomically: a
JSONL file, or one ``<rollout_id>.json`` per trajectory in a directory.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import orjson
from pydantic import ValidationError

from rollcage.controller import load_records
from rollcage.durable import publish_bytes, publish_json, read_bounded
from rollcage.errors import ConfigError
from rollcage.export._atif import to_atif
from rollcage.export._nemo import to_nemo_gym_row
from rollcage.protocol import RolloutRecord, WorkerInput, WorkerResult, describe_validation_error

__all__ = ["ExportFormat", "ExportReport", "default_destination", "export_run"]

ExportFormat = Literal["atif", "nemo-gym"]
"""``atif``: one ATIF v1.7 trajectory per rollout; ``nemo-gym``: NeMo Gym's rollout JSONL."""

_MAX_ARTIFACT_BYTES = 1 << 30


@dataclass
class ExportReport:
    """What an export wrote and what it left out.

    Attributes:
        destination: The file (nemo-gym) or directory (atif) written.
        exported: Rollouts written.
        skipped: Final attempts left out, by reason.
    """

    destination: Path
    exported: int = 0
    skipped: Counter[str] = field(default_factory=Counter)


def default_destination(run_dir: Path, format: ExportFormat) -> Path:
    """``RUN/export/atif/`` or ``RUN/export/nemo-gym.jsonl``."""
    return run_dir / "export" / ("atif" if format == "atif" else "nemo-gym.jsonl")


def export_run(run_dir: Path, format: ExportFormat, destination: Path | None = None) -> ExportReport:
    """Export a run's final rollouts (blocking: it reads and writes files).

    Args:
        run_dir: The run directory (``rollouts.jsonl`` and ``rollouts/``).
        format: ``atif`` or ``nemo-gym``.
        destination: Where to write; ``None``: ``default_destination``.

    Raises:
        ConfigError: ``run_dir`` has no ``rollouts.jsonl`` or it is damaged.
        DurableWriteError: The output could not be written (nothing partial is left).
    """
    log = run_dir / "rollouts.jsonl"
    if not log.is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it has no rollouts.jsonl")
    finals: dict[tuple[str, int], RolloutRecord] = {}
    load_records(
        log, lambda record: finals.__setitem__((record.task_id, record.sample), record), repair=False
    )
    target = destination if destination is not None else default_destination(run_dir, format)
    report = ExportReport(destination=target)
    task_index: dict[str, int] = {}
    lines: list[bytes] = []
    if format == "atif":
        target.mkdir(parents=True, exist_ok=True)
    for record in finals.values():
        index = task_index.setdefault(record.task_id, len(task_index))
        loaded = _load(run_dir, record)
        if isinstance(loaded, str):
            report.skipped[loaded] += 1
            continue
        result, spec = loaded
        if format == "atif":
            publish_json(target / f"{record.rollout_id}.json", to_atif(record, result, spec), mode=0o644)
        elif record.reward is None or record.masked:
            report.skipped["no reward (not graded, or masked)"] += 1
            continue
        else:
            lines.append(orjson.dumps(to_nemo_gym_row(record, result, spec, task_index=index)) + b"\n")
        report.exported += 1
    if format == "nemo-gym":
        target.parent.mkdir(parents=True, exist_ok=True)
        publish_bytes(target, b"".join(lines), mode=0o644)
    return report


def _load(run_dir: Path, record: RolloutRecord) -> tuple[WorkerResult, WorkerInput] | str:
    """The attempt's result and input, or why there are none to export."""
    if not record.receipt.result_valid:
        return "no valid result.json"
    directory = Path(record.rollout_dir)
    if not directory.is_absolute() or not directory.is_dir():
        directory = run_dir / "rollouts" / directory.name  # a run moved since it was written
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
