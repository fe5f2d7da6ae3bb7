"""Command-line options generated from a pydantic configuration model: one place for names, types and help.

The rules, for each field the command does not spell itself:

* the flag is the field's name in kebab case (``max_infra_retries`` -> ``--max-infra-retries``); a field
  in seconds (``*_s``) drops the suffix (``deadline_s`` -> ``--deadline``);
* a nested model's fields are flattened under a prefix (``bwrap.cpu_seconds`` -> ``--bwrap-cpu-seconds``);
* types: ``bool`` -> ``--x/--no-x``; ``int``, ``float``, ``str``, ``Path`` as they are; a ``Literal`` of
  strings -> a choice; ``X | None`` -> ``X``; a field of bytes (``*_bytes``) takes a size with a unit
  (``512M``, ``4G``) or plain bytes;
* the help is the field's description, the model's default shown beside it;
* every option defaults to "not given": a value left out keeps the model's default (the model stays the
  one place a default lives), and the command can tell which options were given.

A field with no command-line form (a list, a union of models) must be spelled by the command or
excluded with a reason: :func:`field_options` refuses anything else, so a new field is an option or a
decision, never silently missing. The model validates the values; :func:`describe_errors` names the
option of each error (``--concurrency: ...``), not the field's path.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

__all__ = ["FieldOption", "Spelling", "describe_errors", "field_options", "given_values", "parse_size"]

_SCALARS: tuple[type, ...] = (bool, int, float, str, Path)

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``'512M'`` -> bytes (K, M, G, T are powers of 1024; an optional ``iB``/``B`` is accepted).

    Raises:
        typer.BadParameter: Not a size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if match is None:
        raise typer.BadParameter(f"{text!r} is not a size (e.g. 512M, 4G, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class Spelling:
    """How the command spells one field where the generated spelling will not do (an existing flag)."""

    flag: str | None = None
    """The flag (``--retry-backoff``); None: the generated one."""
    unit: int = 1
    """The option's value times this is the field's (``1 << 20``: the option is in MiB)."""
    unit_name: str | None = None
    """What the help calls the unit (``MiB``)."""
    minimum: int | None = None
    """A bound checked by click, for an option in other units than its field."""
    help: str | None = None
    """What the help says instead of the field's description (a default the command supplies)."""


@dataclass(frozen=True)
class FieldOption:
    """One generated option: where its value lands in the model's input, and how it is spelled."""

    param: str
    """The command's parameter name (a Python identifier)."""
    flag: str
    path: tuple[str, ...]
    """Where the value lands in the model's input (``("bwrap", "memory_bytes")``)."""
    loc: tuple[str, ...]
    """Where pydantic reports an error of this value (a union member's tag included)."""
    annotation: Any
    """The parameter's annotation for typer (``Annotated[int | None, typer.Option(...)]``)."""
    convert: Callable[[Any], Any]
    """The option's value -> the field's value."""


def _kebab(name: str) -> str:
    return name.removesuffix("_s").replace("_", "-")


def _plain(annotation: Any) -> Any:
    """``X | None`` -> ``X``; anything else as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _cli_type(annotation: Any) -> Any | None:
    """The option's type for a field's type, or None where the field has no command-line form."""
    plain = _plain(annotation)
    if typing.get_origin(plain) is Literal and all(isinstance(v, str) for v in typing.get_args(plain)):
        return plain
    if plain in _SCALARS:
        return plain
    return None


def _shown(default: Any, kind: Any, unit: int, flag: str, *, size: bool) -> str | bool:
    if default is None or default is PydanticUndefined:
        return False
    if kind is bool:
        return flag.removeprefix("--") if default else "no-" + flag.removeprefix("--")
    if unit != 1 and isinstance(default, int):
        return str(default // unit)
    if size and isinstance(default, int):
        return _size_text(default)
    return str(default)


def _size_text(count: int) -> str:
    """Bytes in the largest unit that holds them whole (``4G``, ``1536M``), as :func:`parse_size` reads."""
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if count and count % unit == 0:
            return f"{count // unit}{suffix}"
    return str(count)


def field_options(
    model: type[BaseModel],
    *,
    spellings: Mapping[tuple[str, ...], Spelling] | None = None,
    spelled_by_command: Mapping[tuple[str, ...], str] | None = None,
    prefix: str = "",
    path: tuple[str, ...] = (),
    tag: str | None = None,
    panels: Mapping[tuple[str, ...], str] | None = None,
) -> list[FieldOption]:
    """The options of ``model``'s fields, nested models flattened under ``<field>-``.

    Args:
        model: The configuration model.
        spellings: Flags (and units) the command keeps for fields, by path; the generated one elsewhere.
        spelled_by_command: Paths the command spells itself (or leaves out), each with the reason.
        prefix: The flags' prefix (``ray-``) for a model that is itself nested.
        path: Where ``model``'s input lands in the outer model's input.
        tag: For a member of a tagged union: its tag, part of pydantic's error locations.
        panels: Help panels by path prefix (the first that holds a field's path names its panel).

    Raises:
        TypeError: A field has no command-line form and is neither spelled nor excluded.
    """
    spellings = spellings or {}
    spelled_by_command = spelled_by_command or {}
    panels = panels or {}
    found: list[FieldOption] = []
    loc_base = (*path, tag) if tag is not None else path
    for name, field in model.model_fields.items():
        where = (*path, name)
        if where in spelled_by_command:
            continue
        if _is_model(_plain(field.annotation)):
            found += field_options(
                _plain(field.annotation),
                spellings=spellings,
                spelled_by_command=spelled_by_command,
                prefix=f"{prefix}{_kebab(name)}-",
                path=where,
                panels=panels,
            )
            continue
        kind = _cli_type(field.annotation)
        if kind is None:
            raise TypeError(
                f"{model.__name__}.{name} ({field.annotation}) has no command-line form: "
                "spell it in the command or exclude it with a reason"
            )
        spelling = spellings.get(where, Spelling())
        flag = spelling.flag or f"--{prefix}{_kebab(name)}"
        found.append(
            _option(
                flag, where, (*loc_base, name), kind, field.description or "", field.default, spelling, panels
            )
        )
    return found


def _option(
    flag: str,
    path: tuple[str, ...],
    loc: tuple[str, ...],
    kind: Any,
    description: str,
    default: Any,
    spelling: Spelling,
    panels: Mapping[tuple[str, ...], str],
) -> FieldOption:
    help_text = spelling.help or description
    convert: Callable[[Any], Any] = _same
    shown_kind = kind
    size = False
    if spelling.unit != 1:
        help_text += f" In {spelling.unit_name or spelling.unit}."
        unit = spelling.unit
        convert = lambda value: value * unit  # noqa: E731 - one expression, closed over the unit
    elif path[-1].endswith("_s"):
        help_text += " In seconds."
    elif path[-1].endswith("_bytes") and kind is int:
        help_text += " A size: 512M, 4G, or bytes."
        shown_kind, size = str, True
        convert = _size_of(flag)
    panel = next((name for prefix, name in panels.items() if path[: len(prefix)] == prefix), None)
    decls = f"{flag}/--no-{flag.removeprefix('--')}" if kind is bool else flag
    option = typer.Option(
        decls,
        help=help_text,
        show_default=_shown(default, kind, spelling.unit, flag, size=size),
        min=spelling.minimum,
        rich_help_panel=panel,
    )
    param = flag.removeprefix("--").replace("-", "_")
    return FieldOption(param, flag, path, loc, Annotated[shown_kind | None, option], convert)


def _same(value: Any) -> Any:
    return value


def _size_of(flag: str) -> Callable[[Any], Any]:
    def convert(text: Any) -> Any:
        try:
            return parse_size(str(text))
        except typer.BadParameter as exc:
            raise typer.BadParameter(f"{flag}: {exc.message}") from exc

    return convert


def given_values(options: list[FieldOption], given: Mapping[str, Any]) -> dict[str, Any]:
    """The model's input from the options given (those left out are absent: the model's defaults hold).

    Raises:
        typer.BadParameter: A value could not be converted (a size that is not one), naming its option.
    """
    values: dict[str, Any] = {}
    for option in options:
        value = given.get(option.param)
        if value is None:
            continue
        node = values
        for part in option.path[:-1]:
            node = node.setdefault(part, {})
        node[option.path[-1]] = option.convert(value)
    return values


def describe_errors(exc: ValidationError, flags: Mapping[tuple[str, ...], str], *, limit: int = 3) -> str:
    """A model's validation errors as one line, each naming its option (``--concurrency: ...``).

    Args:
        exc: The model's errors.
        flags: Option by error location (:attr:`FieldOption.loc`); an error elsewhere (a check of the
            whole model) is its message alone, which names its options itself.
        limit: Errors told at most.
    """
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:limit]:
        loc = tuple(str(part) for part in error.get("loc", ()))
        message = " ".join(str(error.get("msg", "")).removeprefix("Value error, ").split())
        flag = flags.get(loc)
        if flag is None and error.get("type") == "extra_forbidden":
            message = f"{'.'.join(loc)}: unknown field"
        parts.append(f"{flag}: {message}" if flag is not None else message)
    more = len(errors) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
