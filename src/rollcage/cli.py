"""The one entry point, ``rollcage``.

``rollcage worker`` runs once per rollout inside the sandbox, so it is dispatched
before typer (and rich, which typer pulls in) is imported: every millisecond of
the worker's start is paid by every rollout. All other verbs go through typer.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point."""
    argv = sys.argv[1:]
    if argv[:1] == ["worker"]:
        from rollcage.worker import worker_main

        raise SystemExit(worker_main(argv[1:]))
    _build_app()()


def _build_app() -> typer.Typer:
    import typer

    from rollcage.commands import register

    app = typer.Typer(
        name="rollcage",
        help="Crash-safe, sandboxed agent rollouts for RL and evaluation.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    register(app)
    return app


def app() -> None:
    """Run the typer application (for ``python -m rollcage``)."""
    main()
