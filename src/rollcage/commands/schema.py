"""``rollcage schema [NAME]``: the JSON Schema of every artifact."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = ["command"]


def command(
    name: Annotated[
        str | None, typer.Argument(help="One artifact (e.g. WorkerInput); all of them when omitted.")
    ] = None,
) -> None:
    """Print the JSON Schema of every artifact, or of one (each says its artifact schema version)."""
    import json

    from rollcage.protocol import SCHEMA_VERSION, artifact_models

    models = artifact_models()

    def schema_of(model: type[BaseModel]) -> dict[str, Any]:
        return {**model.model_json_schema(), "x-rollcage-schema-version": SCHEMA_VERSION}

    if name is None:
        doc = {key: schema_of(model) for key, model in models.items()}
    elif name in models:
        doc = schema_of(models[name])
    else:
        raise typer.BadParameter(
            f"unknown artifact {name!r}; choose from {', '.join(models)}", param_hint="NAME"
        )
    typer.echo(json.dumps(doc, indent=2, sort_keys=True))
