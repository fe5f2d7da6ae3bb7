"""``rollcage show PATH``: a rollout or a run, in the terminal."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["command"]


def command(
    path: Annotated[
        Path,
        typer.Argument(
            help="A rollout directory, its result.json or checkpoint.jsonl, a run directory, or a NeMo Gym "
            "sandbox's directory (rollcage's provider).",
            show_default=False,
        ),
    ],
    outcome: Annotated[
        str | None,
        typer.Option(
            "--outcome",
            help="Run only: list rollouts with this outcome "
            "(completed, agent_error, timeout, cancelled, infra_failure).",
        ),
    ] = None,
    limit: Annotated[
        int, typer.Option("--limit", min=0, help="Run only: list at most N rollouts (0: all).")
    ] = 200,
) -> None:
    """Show a rollout as a tree of turns (model calls, tool calls, outcome, receipt), or a run's summary."""
    from rich.console import Console

    from rollcage.commands import fail
    from rollcage.errors import ViewerError
    from rollcage.gym_sandbox import render_sandbox, sandbox_directory
    from rollcage.viewer import load_rollout, render_rollout, render_run, resolve_target

    try:
        # A NeMo Gym sandbox's directory (rollcage's provider): its record and exec journal.
        sandbox = sandbox_directory(path)
        if sandbox is not None:
            Console().print(render_sandbox(sandbox))
            return
        target = resolve_target(path)
        if target.kind == "run":
            renderable = render_run(target.path, outcome=outcome, limit=limit)
        else:
            if outcome is not None:
                raise ViewerError(f"{path}: --outcome filters a run's rollouts; this is one rollout")
            view = load_rollout(target.path, prefer=target.prefer, file=target.file)
            renderable = render_rollout(view)
    except ViewerError as exc:
        fail("show", str(exc))
    except OSError as exc:
        fail("show", f"cannot read {path}: {exc}", code=1)
    Console().print(renderable)
