"""MkDocs hooks: the reference pages' generated parts, made from the code while the site builds.

A page asks for a generated part with a marker on a line of its own; ``on_page_markdown``
replaces it, so nothing generated is ever committed or retyped:

* ``<!-- rollcage:cli -->``: every verb of the ``rollcage`` command line, its arguments and
  options, walked from the typer application itself (``rollcage.cli``);
* ``<!-- rollcage:config MODULE:CLASS -->``: a table of a pydantic configuration model's keys,
  from its fields (type, default, description);
* ``<!-- rollcage:schemas -->``: every artifact ``rollcage schema`` prints, with a table of
  its top-level fields and its JSON Schema.

An unknown marker, module or class fails the build.
"""

from __future__ import annotations

import html
import importlib
import json
import re
from typing import Any

MARKER = re.compile(r"^<!-- rollcage:(?P<kind>[a-z]+)(?: (?P<arg>\S+))? -->$", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace every generated-part marker of a page with its markdown."""

    def expand(match: re.Match[str]) -> str:
        kind, arg = match["kind"], match["arg"]
        if kind == "cli":
            return cli_reference()
        if kind == "config" and arg:
            return config_table(arg)
        if kind == "schemas":
            return schema_reference()
        raise ValueError(f"{page.file.src_uri}: unknown generated part {match[0]!r}")

    return MARKER.sub(expand, markdown)


# --- the command line -------------------------------------------------------------------------


def cli_reference() -> str:
    """Markdown for every verb of ``rollcage``, from the click command typer builds."""
    import typer.main

    from rollcage.cli import _build_app

    root = typer.main.get_command(_build_app())
    parts: list[str] = []
    for name, command in _walk(root, "rollcage"):
        parts.append(_command_markdown(name, command))
    return "\n".join(parts)


def _walk(command: Any, name: str) -> list[tuple[str, Any]]:
    subcommands = getattr(command, "commands", None)
    if not subcommands:
        return [(name, command)]
    found: list[tuple[str, Any]] = []
    for sub in subcommands:  # in the order the verbs are registered: run first
        found.extend(_walk(subcommands[sub], f"{name} {sub}"))
    return found


def _command_markdown(name: str, command: Any) -> str:
    # click's own help records (what `--help` prints), so the page follows typer and click
    # across versions: typer >= 0.20 carries its own copy of click's classes.
    ctx = command.make_context(name, [], resilient_parsing=True)
    pieces = command.collect_usage_pieces(ctx)
    lines = [f"## `{name}`", "", f"```text\n{' '.join([name, *pieces])}\n```", ""]
    lines += [_text(command.help or ""), ""]
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    if arguments:
        lines += ["| argument | help |", "|---|---|"]
        for param in arguments:
            shown, help_text = param.get_help_record(ctx) or (param.name.upper(), "")
            lines.append(f"| {_code(shown)} | {_cell(help_text)} |")
        lines.append("")
    if options:
        lines += ["| option | help |", "|---|---|"]
        for param in options:
            record = param.get_help_record(ctx)
            if record:
                lines.append(f"| {_code(record[0])} | {_cell(record[1])} |")
        lines.append("")
    return "\n".join(lines)


def _text(text: str) -> str:
    return " ".join(text.split())


def _code(text: str) -> str:
    """Inline code for a table cell: a ``|`` in a code span would end the cell, escaped or not."""
    return "<code>" + html.escape(_text(text)).replace("|", "&#124;") + "</code>"


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|")


# --- configuration keys -----------------------------------------------------------------------


def config_table(target: str) -> str:
    """A markdown table of a pydantic model's fields: key, type, default, description."""
    from pydantic_core import PydanticUndefined

    module_name, _, class_name = target.partition(":")
    model = getattr(importlib.import_module(module_name), class_name)
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for key, field in model.model_fields.items():
        if field.default is not PydanticUndefined:
            default = _code(repr(field.default))
        elif field.default_factory is not None:
            default = "(made)"
        else:
            default = "required"
        kind = _code(_annotation(field.annotation))
        lines.append(f"| `{key}` | {kind} | {default} | {_cell(field.description or '')} |")
    return "\n".join(lines) + "\n"


def _annotation(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    text = text or repr(annotation)
    text = re.sub(r"\b(typing|pathlib|rollcage)\.([\w.]+\.)?", "", text)
    text = text.replace("NoneType", "None")
    return text


# --- artifacts and their JSON Schemas ---------------------------------------------------------


def schema_reference() -> str:
    """Every artifact of ``rollcage schema``: its description, top-level fields and JSON Schema."""
    from rollcage.protocol import SCHEMA_VERSION, artifact_models

    parts = [f"Artifact schema version: **{SCHEMA_VERSION}**.", ""]
    for name, model in artifact_models().items():
        schema = {**model.model_json_schema(), "x-rollcage-schema-version": SCHEMA_VERSION}
        required = set(schema.get("required", []))
        parts += [f"### {name}", "", _text(schema.get("description", "")), ""]
        parts += [f"`rollcage schema {name}` prints it.", ""]
        parts += ["| field | required | description |", "|---|---|---|"]
        for key, prop in schema.get("properties", {}).items():
            mark = "yes" if key in required else ""
            parts.append(f"| `{key}` | {mark} | {_cell(prop.get('description', ''))} |")
        parts += ["", f'??? note "JSON Schema of {name}"', ""]
        body = json.dumps(schema, indent=2, sort_keys=True)
        parts += ["    ```json", *(f"    {line}" for line in body.splitlines()), "    ```", ""]
    return "\n".join(parts)
