"""``rollcage harness install nooa``: make a harness's own Python environment, once.

``rollcage run`` never downloads anything; it uses what this made (or what
``--harness-env PATH`` names). Exit codes: 0 ready (made now or before); 1 the
install failed (pip's last lines are printed); 2 no suitable interpreter, or a
wrong command line.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["app"]

app = typer.Typer(
    name="harness",
    help="Harness environments: NOOA's own Python (>= 3.12), made once, mounted read-only in every sandbox.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class _Kind(enum.StrEnum):
    nooa = "nooa"


@app.command("install")
def install(
    kind: Annotated[_Kind, typer.Argument(help="The harness (nooa).")],
    python: Annotated[
        str | None,
        typer.Option(
            help="Interpreter to make it from (NOOA: Python 3.12 or 3.13); default: found on the machine."
        ),
    ] = None,
    directory: Annotated[
        Path | None,
        typer.Option("--dir", help="Where to make it; default: $ROLLCAGE_HARNESS_HOME/nooa-VERSION."),
    ] = None,
) -> None:
    """Make the harness's virtual environment (kept if it is already there) and print its path."""
    from rollcage.harness import install_harness

    path = install_harness(kind.value, python=python, target=directory)
    typer.echo(str(path))


@app.command("path")
def path(kind: Annotated[_Kind, typer.Argument(help="The harness (nooa).")]) -> None:
    """Print where the harness's environment is (exit 1 if it is not installed there)."""
    from rollcage.commands import fail
    from rollcage.harness import default_environment_dir, resolve_environment

    target = default_environment_dir(kind.value)
    from rollcage.errors import ConfigError

    try:
        resolve_environment(kind.value, None)
    except ConfigError as exc:
        fail("harness path", str(exc), code=1)
    typer.echo(str(target))
