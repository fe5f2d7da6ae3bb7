"""``rollcage report DIR``: one self-contained HTML report of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["command"]


def command(
    run_dir: Annotated[
        Path, typer.Argument(metavar="DIR", help="The run directory (rollouts.jsonl, metrics.json).")
    ],
    output: Annotated[
        Path | None,
        typer.Option(
            "-o",
            "--output",
            help="Where to write the report; default DIR/report.html. Never a device, FIFO, socket or "
            "symbolic link, nor the run's own files.",
        ),
    ] = None,
) -> None:
    """Write a static HTML report of a run: summary, charts, a filterable table, every trajectory."""
    from rollcage.commands import fail
    from rollcage.errors import ConfigError
    from rollcage.viewer import write_report

    try:
        written = write_report(run_dir, output)
    except ConfigError as exc:
        fail("report", str(exc))
    except OSError as exc:
        fail("report", f"cannot write the report: {exc}", code=1)
    size = written.stat().st_size
    shown = f"{size / 1_048_576:.1f} MiB" if size >= 1_048_576 else f"{size / 1024:.0f} KiB"
    typer.echo(f"wrote {written} ({shown}); open it in a browser (no network needed)")
