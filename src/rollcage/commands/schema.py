"""``rollcage schema [NAME]``: the JSON Schema of every artifact."""

from __future__ import annotations

from typing import Annotated

import typer

__all__ = ["command"]


def command(
    name: Annotated[
        str | None, typer.Argument(help="One artifact (e.g. WorkerInput); all of them when omitted.")
    ] = None,
) -> None:
    """Print the JSON Schema of every artifact, or of one."""
    import json

    from rollcage.protocol import artifact_models

    models = artifact_models()
    if name is None:
        doc = {key: model.model_json_schema() for key, model in models.items()}
    elif name in models:
        doc = models[name].model_json_schema()
    else:
        raise typer.BadParameter(
            f"unknown artifact {name!r}; choose from {', '.join(models)}", param_hint="NAME"
        )
    typer.echo(json.dumps(doc, indent=2, sort_keys=True))
