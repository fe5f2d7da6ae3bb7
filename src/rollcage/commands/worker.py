"""``rollcage worker INPUT RESULT``: shown in help only; the real dispatch skips typer (see rollcage.cli)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

__all__ = ["command"]


def command(
    input_path: Annotated[Path, typer.Argument(metavar="INPUT", help="input.json (WorkerInput).")],
    result_path: Annotated[Path, typer.Argument(metavar="RESULT", help="Where result.json is published.")],
    checkpoint: Annotated[
        Path | None, typer.Option(help="Checkpoint journal; default: checkpoint.jsonl beside RESULT.")
    ] = None,
) -> None:
    """Run one rollout (the sandbox entrypoint)."""
    from rollcage.worker import worker_main

    args = [str(input_path), str(result_path)]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    raise typer.Exit(worker_main(args))
