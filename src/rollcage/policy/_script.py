"""Policy scripts: per task, the turns the scripted model plays (format in the package docstring)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollcage.durable import read_bounded
from rollcage.errors import ConfigError
from rollcage.protocol import describe_validation_error

__all__ = ["DEFAULT_TASK", "MAX_SCRIPT_BYTES", "PolicyScript", "ScriptedToolCall", "Turn", "load_script"]

DEFAULT_TASK = "*"
"""The script entry played for a task id that has no entry of its own."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ScriptedToolCall(_Model):
    """One tool call of a turn."""

    name: str = Field(min_length=1, description="Tool (function) name.")
    arguments: dict[str, Any] | None = Field(
        default=None, description="Arguments, sent as compact JSON; None (and no arguments_raw): '{}'."
    )
    arguments_raw: str | None = Field(
        default=None, description="Arguments sent verbatim, e.g. malformed JSON; excludes 'arguments'."
    )

    @model_validator(mode="after")
    def _one_form_of_arguments(self) -> ScriptedToolCall:
        if self.arguments is not None and self.arguments_raw is not None:
            raise ValueError("give either 'arguments' or 'arguments_raw', not both")
        return self

    def arguments_text(self) -> str:
        """The arguments exactly as the model will send them."""
        if self.arguments_raw is not None:
            return self.arguments_raw
        return json.dumps(self.arguments or {}, ensure_ascii=False, separators=(",", ":"))


class Turn(_Model):
    """One model turn: what one model response contains."""

    text: str | None = Field(
        default=None, description="Message text (a final answer, or words before calls)."
    )
    code: str | None = Field(
        default=None, description="Python code, emitted as a fenced ```python block after the text (CodeAct)."
    )
    tool_calls: list[ScriptedToolCall] = Field(
        default_factory=list, description="Tool calls; several in one turn are parallel calls."
    )
    reasoning: str | None = Field(
        default=None, description="Reasoning: reasoning_content (chat) or a reasoning item (responses)."
    )
    finish: Literal["stop", "length"] = Field(
        default="stop", description="length: a length-stopped (chat) / incomplete (responses) turn."
    )
    repeat: bool = Field(default=False, description="On the last turn only: replay it forever.")

    @model_validator(mode="after")
    def _says_something(self) -> Turn:
        if self.text is None and self.code is None and not self.tool_calls and self.reasoning is None:
            raise ValueError("a turn needs at least one of text, code, tool_calls, reasoning")
        return self

    def message_text(self) -> str | None:
        """The assistant message text: ``text``, then ``code`` as a fenced block; None if neither."""
        if self.code is None:
            return self.text
        block = f"```python\n{self.code.rstrip()}\n```"
        return block if self.text is None else f"{self.text}\n\n{block}"


class PolicyScript(_Model):
    """A whole script: the turns of every task, and the model name the server reports."""

    model: str = Field(default="scripted-policy", description="Model id listed by /v1/models.")
    tasks: dict[str, list[Turn]] = Field(description="Turns per task id; '*' is the default entry.")

    @model_validator(mode="after")
    def _well_formed(self) -> PolicyScript:
        if not self.tasks:
            raise ValueError("a script needs at least one task")
        for task_id, turns in self.tasks.items():
            if not turns:
                raise ValueError(f"task {task_id!r} has no turns")
            for number, turn in enumerate(turns[:-1]):
                if turn.repeat:
                    raise ValueError(
                        f"task {task_id!r}: 'repeat' is allowed on the last turn only (turn {number})"
                    )
        return self

    def turns_for(self, task_id: str) -> tuple[str, list[Turn]] | None:
        """The entry for ``task_id`` (its own, else ``'*'``) as (entry name, turns); None if neither."""
        if task_id in self.tasks:
            return task_id, self.tasks[task_id]
        if DEFAULT_TASK in self.tasks:
            return DEFAULT_TASK, self.tasks[DEFAULT_TASK]
        return None

    def turn(self, task_id: str, index: int) -> Turn | None:
        """The turn to play as the ``index``-th (0-based) model turn of ``task_id``.

        Past the end of the script: the last turn again if it has ``repeat``, else
        a turn with the last turn's text, else a fixed message. ``None`` when the
        script has neither an entry for the task nor a ``'*'`` entry.
        """
        found = self.turns_for(task_id)
        if found is None:
            return None
        name, turns = found
        if index < len(turns):
            return turns[index]
        last = turns[-1]
        if last.repeat:
            return last
        if last.text is not None:
            return Turn(text=last.text)
        return Turn(text=f"[scripted policy: the script for task {name!r} has no turn {index}]")


MAX_SCRIPT_BYTES = 16 * 1024 * 1024
"""The largest policy script file read."""


def load_script(source: PolicyScript | Mapping[str, Any] | str | os.PathLike[str]) -> PolicyScript:
    """Load a policy script from a YAML (``.yaml``/``.yml``) or JSON file, a mapping, or pass one through.

    The file must be a regular file of at most ``MAX_SCRIPT_BYTES`` in UTF-8.
    YAML aliases (``*name``) are refused: each one can double what a reader
    expands (the "billion laughs"), and a script has no need for them.

    Raises:
        ConfigError: the file cannot be read or parsed, or the script is not valid
            (one line, naming the file and the field).
    """
    if isinstance(source, PolicyScript):
        return source
    if isinstance(source, Mapping):
        return _validate(source, "the script")
    path = Path(source)
    try:
        text = read_bounded(path, limit=MAX_SCRIPT_BYTES).decode("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read policy script {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"policy script {path} is not UTF-8 text (byte {exc.start})") from exc
    try:
        data = _parse_yaml(text) if path.suffix.lower() in (".yaml", ".yml") else json.loads(text)
    except ConfigError as exc:
        raise ConfigError(f"policy script {path}: {exc}") from exc
    except Exception as exc:  # yaml's and json's errors have no common base worth naming
        raise ConfigError(f"policy script {path} does not parse: {' '.join(str(exc).split())}") from exc
    if not isinstance(data, Mapping):
        raise ConfigError(f"policy script {path}: the top level must be a mapping with 'tasks'")
    return _validate(data, str(path))


def _parse_yaml(text: str) -> Any:
    import yaml  # only here: the worker never loads scripts

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
                raise ConfigError(
                    f"YAML aliases are not allowed in a policy script (line {mark.line + 1}); "
                    "write the value out"
                )
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=Loader)  # a SafeLoader without aliases


def _validate(data: Mapping[str, Any], where: str) -> PolicyScript:
    tasks = data.get("tasks")
    if isinstance(tasks, Mapping):
        # YAML reads a task id such as 7 as a number; task ids are strings on the wire.
        data = {**data, "tasks": {str(key): value for key, value in tasks.items()}}
    try:
        return PolicyScript.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"policy script {where} is not valid: {describe_validation_error(exc)}") from exc
