"""`rollcage serve-policy`: not built yet (see the open issues)."""

from __future__ import annotations

import typer

__all__ = ["command"]


def command() -> None:
    """Not built yet."""
    typer.echo("rollcage serve-policy: not built yet; see the open issues", err=True)
    raise typer.Exit(2)
