"""The CLI verbs, one module each; heavy imports happen inside each command's body.

Errors a user causes end as one line and exit 2 (see ``rollcage.cli``): a verb
either raises ``typer.BadParameter``/``ConfigError`` or calls ``fail``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    import typer

__all__ = ["fail", "finite", "one_line", "register"]


_OTHER_VERBS = frozenset(
    {"worker", "supervise", "serve-policy", "show", "report", "schema", "export", "harness", "images"}
    | {"branch"}
)


def register(app: typer.Typer, *, verb: str | None = None) -> None:
    """Attach every verb to ``app``.

    Args:
        app: The application.
        verb: The verb about to run, where known: another verb than ``run`` leaves ``run`` out,
            whose options are made from ``RunConfig`` and so import the controller (half a second).
    """
    from rollcage.commands import (
        branch,
        export,
        harness,
        images,
        report,
        schema,
        serve_policy,
        show,
        supervise,
        worker,
    )

    if verb not in _OTHER_VERBS:
        from rollcage.commands import run

        app.command("run")(run.command)
    app.command("worker")(worker.command)
    app.command("supervise")(supervise.command)
    app.command("serve-policy")(serve_policy.command)
    app.command("show")(show.command)
    app.command("report")(report.command)
    app.command("schema")(schema.command)
    app.command("export")(export.command)
    app.command("branch")(branch.command)
    app.add_typer(harness.app, name="harness")
    app.add_typer(images.app, name="images")


def one_line(message: str, *, limit: int = 2000) -> str:
    """A message as one line (each run of whitespace becomes one space), at most ``limit`` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def fail(verb: str, message: str, code: int = 2) -> NoReturn:
    """Print ``rollcage VERB: message`` as one line on stderr; exit with ``code`` (2: a wrong command)."""
    import typer

    typer.echo(f"rollcage {verb}: {one_line(message)}", err=True)
    raise typer.Exit(code)


def finite(value: float | None) -> float | None:
    """A typer callback: refuse ``inf`` and ``nan``, which click's float type accepts (and no range stops)."""
    import typer

    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value
