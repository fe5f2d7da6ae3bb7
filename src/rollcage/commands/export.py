"""``rollcage export RUN --format atif|nemo-gym``: a run's rollouts in other projects' formats."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["command"]


class _Format(enum.StrEnum):
    atif = "atif"
    nemo_gym = "nemo-gym"


def command(
    run_dir: Annotated[
        Path, typer.Argument(metavar="RUN", help="The run directory (rollouts.jsonl, rollouts/).")
    ],
    format: Annotated[
        _Format,
        typer.Option(
            "--format", help="atif: one ATIF v1.7 trajectory per rollout; nemo-gym: NeMo Gym's rollout JSONL."
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Where to write; default RUN/export/atif/ or RUN/export/nemo-gym.jsonl. Never a device, "
            "FIFO, socket or symbolic link, nor the run's own files; an existing ATIF directory is replaced "
            "whole, and only if it holds nothing but an earlier ATIF export."
        ),
    ] = None,
) -> None:
    """Export each sample's final rollout as ATIF trajectories or NeMo Gym rollout JSONL."""
    from rollcage.commands import fail
    from rollcage.errors import ConfigError, DurableWriteError
    from rollcage.export import export_run

    try:
        report = export_run(run_dir, format.value, out)
    except ConfigError as exc:
        fail("export", str(exc))
    except (DurableWriteError, OSError) as exc:
        fail("export", str(exc), code=1)
    skipped = ", ".join(f"{count} {reason}" for reason, count in sorted(report.skipped.items()))
    relocated = (
        f"; {report.relocated} record(s) named a rollout directory outside this run (a moved or copied "
        "run, or an edited record): read from the run's own rollouts/ instead"
        if report.relocated
        else ""
    )
    typer.echo(
        f"wrote {report.exported} rollout(s) to {report.destination}"
        + (f"; skipped {skipped}" if skipped else "")
        + relocated
    )
