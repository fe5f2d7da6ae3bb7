"""The CLI verbs, one module each; heavy imports happen inside each command's body."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    """Attach every verb to ``app``."""
    from rollcage.commands import report, run, schema, serve_policy, show, supervise, worker

    app.command("run")(run.command)
    app.command("worker")(worker.command)
    app.command("supervise")(supervise.command)
    app.command("serve-policy")(serve_policy.command)
    app.command("show")(show.command)
    app.command("report")(report.command)
    app.command("schema")(schema.command)
