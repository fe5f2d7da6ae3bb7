"""Dataset rows: JSONL, streamed line by line, each validated on its own.

A row (one JSON object a line)::

    {"id": "oslo-sum",
     "input": "Is it cold in Oslo? Also compute 40 + 2. Answer as <condition>;sum=<n>.",
     "instructions": "Use the tools.",
     "environment": "calc-weather",
     "tools": ["python", "get_weather"],
     "agent": {"mode": "function_calling", "max_policy_calls": 6},
     "model": {"sampling": {"temperature": 0}, "max_retries": 1},
     "expected": "cold;sum=42",
     "grader": {"type": "verify"},
     "metadata": {"split": "demo"}}

Model-visible: ``input``, ``instructions``, ``tools``. Settings: ``agent``,
``executor``, ``model`` (everything of the endpoint but its URL and name).
Controller-only: ``expected``, ``grader``, ``metadata``, ``verifier`` (fields sent to
the environment's ``/seed_session`` and ``/verify``); they never reach
``input.json``. A row that fails validation is reported with its line number and
reason and skipped; the others still run.

Rows written for NeMo Gym or Inspect are read as they are (``rollcage.controller._formats``):
``iter_dataset(path, format=...)``, with ``detect_format`` for ``--format auto``.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollcage.controller._formats import DatasetFormat, detect_format_of, from_inspect, from_nemo_gym
from rollcage.controller._graders import ExactGrader, GraderSpec, VerifyGrader, check_pattern
from rollcage.environments import EnvironmentInfo, bundled_environments
from rollcage.errors import ConfigError, ControllerOnlyFieldError
from rollcage.protocol import (
    AgentSettings,
    BashToolSpec,
    EditorToolSpec,
    ExecutorSettings,
    ModelEndpoint,
    PythonToolSpec,
    ResourceEndpoint,
    ResourceToolSpec,
    SamplingParams,
    ToolSpec,
    WorkerInput,
    describe_validation_error,
)

__all__ = [
    "DatasetRow",
    "EnvironmentRef",
    "InvalidRow",
    "RowModelSettings",
    "RowResourceTool",
    "Task",
    "detect_format",
    "iter_dataset",
    "normalise_url",
    "tasks_from_rows",
    "url_key",
]

_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$", re.IGNORECASE)
_MAX_ID = 256
_BOM = b"\xef\xbb\xbf"
_DETECT_LINES = 100


class _Row(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RowModelSettings(_Row):
    """Per-row model settings; ``None`` fields take the run's defaults (see ``ModelEndpoint``)."""

    api: Literal["chat", "responses"] | None = Field(default=None, description="API style.")
    sampling: SamplingParams | None = Field(default=None, description="Sampling parameters.")
    stream: bool | None = Field(default=None, description="Request server-sent events.")
    timeout_s: float | None = Field(default=None, gt=0, description="Deadline of one request.")
    connect_timeout_s: float | None = Field(default=None, gt=0, description="Connect deadline.")
    max_retries: int | None = Field(default=None, ge=0, le=20, description="Client retries per call.")
    retry_backoff_s: float | None = Field(default=None, ge=0, description="First client backoff.")


class RowResourceTool(_Row):
    """A resource tool given in full; ``resource`` defaults to the row's environment."""

    type: Literal["resource"] = "resource"
    name: str = Field(min_length=1, description="Tool name the model sees.")
    description: str = Field(default="", description="Tool description the model sees.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}}, description="JSON Schema of arguments."
    )
    resource: str | None = Field(default=None, description="Resource key; None: the row's environment.")
    path: str | None = Field(default=None, description="Endpoint path; None: '/<name>'.")


RowTool = Annotated[
    PythonToolSpec | BashToolSpec | EditorToolSpec | RowResourceTool, Field(discriminator="type")
]

_BUILTIN_TOOLS: dict[str, Callable[[], ToolSpec]] = {
    "python": PythonToolSpec,
    "bash": BashToolSpec,
    "str_replace_based_edit_tool": EditorToolSpec,
    "str_replace_editor": lambda: EditorToolSpec(name="str_replace_editor"),
}
"""Tools a row may ask for by name alone: the executor's own (they run in the rollout's cage)."""


class DatasetRow(_Row):
    """One dataset row as written in the JSONL file (see the module docstring)."""

    id: str = Field(description="Task id, unique in the dataset.")
    input: str | list[dict[str, Any]] = Field(description="Model-visible input: text or Responses items.")
    instructions: str | None = Field(default=None, description="System instructions; None: none.")
    environment: str | None = Field(
        default=None, description="A bundled environment's name or a resource server URL; None: none."
    )
    tools: list[str | RowTool] | None = Field(
        default=None,
        description="Tool names from the environment ('python' is the executor) or full specs; "
        "None: the environment's defaults (just python without one).",
    )
    agent: AgentSettings = Field(default_factory=AgentSettings, description="Agent loop settings.")
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings, description="Python executor.")
    model: RowModelSettings = Field(default_factory=RowModelSettings, description="Model settings.")
    resume: bool | None = Field(
        default=None,
        description="Continue a retried or interrupted attempt from its journal (rollcage.resume); "
        "None: as the run says (--resume-rollouts).",
    )
    expected: Any = Field(default=None, description="Controller-only: the reference answer for the grader.")
    grader: GraderSpec | None = Field(default=None, description="Controller-only: how to grade.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Controller-only, free-form.")
    verifier: dict[str, Any] = Field(
        default_factory=dict,
        description="Controller-only: fields sent to the environment's /seed_session and /verify beside "
        "responses_create_params (NeMo Gym's verifier fields, e.g. expected_count).",
    )

    @field_validator("id", mode="before")
    @classmethod
    def _id_text(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        if isinstance(value, str) and not (0 < len(value) <= _MAX_ID):
            raise ValueError(f"must be 1 to {_MAX_ID} characters")
        return value


@dataclass(frozen=True, slots=True)
class EnvironmentRef:
    """The environment a task runs against.

    Attributes:
        key: The resource key in ``WorkerInput.resources``: the bundled name, or for an
            external URL ``env-<host>-<hash of the URL>`` (see ``url_key``), so rows naming
            different URLs never share a key, and the same URL always gets the same one.
        bundled: The bundled environment, or ``None`` for an external URL.
        url: The external URL, or ``None`` for a bundled environment (started by the controller).
    """

    key: str
    bundled: EnvironmentInfo | None
    url: str | None


@dataclass(frozen=True, slots=True)
class InvalidRow:
    """A row that was rejected, and why.

    Attributes:
        line: 1-based line number in the dataset file.
        reason: What is wrong, in words a user can act on.
        task_id: The row's id when it could be read.
    """

    line: int
    reason: str
    task_id: str | None = None


@dataclass(frozen=True, slots=True)
class Task:
    """A valid row, resolved: its environment, its tool specs and its grader.

    Attributes:
        line: 1-based line number in the dataset file.
        row: The row as validated.
        environment: Its environment, if any.
        tools: Tool specs for ``WorkerInput.tools``.
        grader: The grader to apply; ``None``: not graded.
        verifier: Controller-only fields sent to the environment (seed, verify, close).
        create_params: The row's own ``responses_create_params`` (NeMo Gym rows); ``None``:
            built from the row when the rollout is prepared.
    """

    line: int
    row: DatasetRow
    environment: EnvironmentRef | None
    tools: tuple[ToolSpec, ...]
    grader: GraderSpec | None
    verifier: dict[str, Any] = field(default_factory=dict)
    create_params: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        """The task id."""
        return self.row.id


def normalise_url(url: str) -> str:
    """An environment URL in one spelling: scheme and host lower case, no trailing slash."""
    parts = urllib.parse.urlsplit(url.strip())
    path = parts.path.rstrip("/")
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc.lower(), path, parts.query, ""))


def url_key(url: str) -> str:
    """The resource key of an external environment: a readable host plus a hash of the whole URL.

    Derived from the URL alone, so a resumed run gives the same rows the same keys;
    the hash keeps two URLs on one host (other ports or paths) apart.
    """
    normalised = normalise_url(url)
    host = re.sub(r"[^a-z0-9.]+", "-", urllib.parse.urlsplit(normalised).netloc)[:40].strip("-")
    digest = hashlib.sha256(normalised.encode()).hexdigest()[:12]
    return f"env-{host}-{digest}" if host else f"env-{digest}"


def _environment(name: str | None) -> EnvironmentRef | None:
    if name is None:
        return None
    if _URL.match(name):
        url = normalise_url(name)
        return EnvironmentRef(key=url_key(url), bundled=None, url=url)
    bundled = bundled_environments()
    if name not in bundled:
        raise ConfigError(
            f"unknown environment {name!r}: use one of {', '.join(sorted(bundled))} "
            "or the http(s) URL of a resource server"
        )
    return EnvironmentRef(key=name, bundled=bundled[name], url=None)


def _tools(row: DatasetRow, env: EnvironmentRef | None) -> tuple[ToolSpec, ...]:
    wanted: list[str | PythonToolSpec | BashToolSpec | EditorToolSpec | RowResourceTool]
    if row.tools is None:
        wanted = list(env.bundled.default_tools) if env is not None and env.bundled else ["python"]
    else:
        wanted = list(row.tools)
    specs: list[ToolSpec] = []
    for tool in wanted:
        if isinstance(tool, PythonToolSpec | BashToolSpec | EditorToolSpec):
            specs.append(tool)
        elif isinstance(tool, RowResourceTool):
            # A row has one environment: its tools name it by key, by the row's own spelling,
            # or by the historical alias "env".
            if env is None or tool.resource not in (None, env.key, row.environment, "env"):
                raise ConfigError(f"tool {tool.name!r} needs the row's environment as its resource")
            resource = env.key
            specs.append(
                ResourceToolSpec(
                    name=tool.name,
                    description=tool.description,
                    parameters=tool.parameters,
                    resource=resource,
                    path=tool.path,
                )
            )
        elif tool in _BUILTIN_TOOLS:
            specs.append(_BUILTIN_TOOLS[tool]())
        else:
            catalog = {t.name: t for t in env.bundled.tools} if env is not None and env.bundled else {}
            info = catalog.get(tool)
            if info is None or env is None:
                known = ", ".join([*_BUILTIN_TOOLS, *catalog])
                raise ConfigError(f"unknown tool {tool!r}: known here are {known}; or give a full spec")
            specs.append(
                ResourceToolSpec(
                    name=info.name,
                    description=info.description,
                    parameters=info.parameters,
                    resource=env.key,
                    path=info.path,
                )
            )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"tool names must be unique, got {names}")
    shell_tools = [s.name for s in specs if isinstance(s, BashToolSpec | EditorToolSpec)]
    if shell_tools and row.agent.mode == "codeact":
        raise ConfigError(
            f"tools {shell_tools} are offered only as function tools: use agent.mode 'function_calling'"
        )
    return tuple(specs)


def _grader(row: DatasetRow, env: EnvironmentRef | None) -> GraderSpec | None:
    spec = row.grader
    if spec is None:
        if env is not None:
            return VerifyGrader()
        return None if row.expected is None else ExactGrader()
    if spec.type == "verify" and env is None:
        raise ConfigError("grader 'verify' needs an 'environment' to send the rollout to")
    if spec.type in ("exact", "normalized", "numeric") and row.expected is None:
        raise ConfigError(f"grader {spec.type!r} needs 'expected'")
    if spec.type == "regex":
        pattern = spec.pattern if spec.pattern is not None else row.expected
        if not isinstance(pattern, str):
            raise ConfigError("grader 'regex' needs 'pattern' or a string 'expected'")
        problem = check_pattern(pattern, ignore_case=spec.ignore_case)
        if problem is not None:
            raise ConfigError(f"grader 'regex': {problem}")
    return spec


def _check_worker_input(row: DatasetRow, tools: tuple[ToolSpec, ...], env: EnvironmentRef | None) -> None:
    # Build the sandbox's view once now, with placeholder endpoints, so a row that
    # could never become a valid input.json is rejected with its line number.
    resources = {env.key: ResourceEndpoint(base_url="http://127.0.0.1:1")} if env is not None else {}
    WorkerInput(
        rollout_id="check",
        task_id=row.id,
        input=row.input,
        instructions=row.instructions,
        model=ModelEndpoint(base_url="http://127.0.0.1:1/v1", model="check"),
        agent=row.agent,
        executor=row.executor,
        tools=list(tools),
        resources=resources,
    )


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror or exc}") from exc


def _lines(handle: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """Numbered non-blank lines; a UTF-8 byte order mark opening the file is not part of line 1."""
    for number, raw in enumerate(handle, start=1):
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]  # some editors start a UTF-8 file with one
        if raw.strip():
            yield number, raw


def validate_row(
    line: int, raw: bytes, *, format: DatasetFormat = "rollcage", environment: str | None = None
) -> Task | InvalidRow:
    """Parse and resolve one line (see ``iter_dataset``; duplicates are not checked here)."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return InvalidRow(line, f"not valid JSON: {exc}")
    return validate_value(line, value, format=format, environment=environment)


def validate_value(
    line: int, value: Any, *, format: DatasetFormat = "rollcage", environment: str | None = None
) -> Task | InvalidRow:
    """Resolve one parsed row, numbered ``line`` (1-based) in its source (duplicates are not checked here)."""
    if not isinstance(value, dict):
        return InvalidRow(line, f"a row must be a JSON object, got {type(value).__name__}")
    raw_id = value.get("id")
    task_id = str(raw_id) if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else None
    verifier: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    try:
        if format == "nemo-gym":
            value, verifier, params = from_nemo_gym(value, line, environment)
        elif format == "inspect":
            value = from_inspect(value, line, environment)
        elif environment is not None and value.get("environment") is None:
            value = {**value, "environment": environment}
    except ConfigError as exc:
        return InvalidRow(line, f"{format} row: {exc}", task_id)
    try:
        row = DatasetRow.model_validate(value)
    except ValidationError as exc:
        return InvalidRow(line, describe_validation_error(exc), task_id)
    try:
        env = _environment(row.environment)
        tools = _tools(row, env)
        grader = _grader(row, env)
        _check_worker_input(row, tools, env)
    except ControllerOnlyFieldError as exc:
        return InvalidRow(line, f"model-visible fields carry controller-only state: {exc}", row.id)
    except ValidationError as exc:
        return InvalidRow(line, describe_validation_error(exc), row.id)
    except ConfigError as exc:
        return InvalidRow(line, str(exc), row.id)
    if verifier is None:
        # rollcage rows: the reference answer travels as 'expected' (what the bundled environments read).
        verifier = {**row.verifier, "expected": row.expected}
    return Task(
        line=line,
        row=row,
        environment=env,
        tools=tools,
        grader=grader,
        verifier=verifier,
        create_params=params,
    )


def detect_format(path: Path) -> DatasetFormat:
    """The format of a dataset, from its first parseable rows (rollcage when they say nothing else).

    Raises:
        ConfigError: The file cannot be opened.
    """
    handle = _open(path)
    with handle:
        for seen, (_, raw) in enumerate(_lines(handle)):
            if seen >= _DETECT_LINES:
                break
            try:
                found = detect_format_of(orjson.loads(raw))
            except orjson.JSONDecodeError:
                continue
            if found is not None:
                return found
    return "rollcage"


def iter_dataset(
    path: Path, *, format: DatasetFormat = "rollcage", environment: str | None = None
) -> Iterator[Task | InvalidRow]:
    """Stream a dataset: each non-blank line becomes a ``Task`` or an ``InvalidRow``.

    The file is read a line at a time, never whole; only the set of ids seen is
    kept, to reject a repeated id (a second row with the same id would make rollout
    ids collide and resume ambiguous).

    Args:
        path: The JSONL file.
        format: How its rows are written (see ``rollcage.controller._formats``).
        environment: The environment of rows that name none (a bundled name or a URL).

    Raises:
        ConfigError: The file cannot be opened.
    """
    handle = _open(path)
    with handle:
        rows = (validate_row(n, raw, format=format, environment=environment) for n, raw in _lines(handle))
        yield from _unique(rows)


def tasks_from_rows(
    rows: Iterable[Any],
    *,
    format: DatasetFormat | Literal["auto"] = "rollcage",
    environment: str | None = None,
) -> list[Task | InvalidRow]:
    """Validate in-memory rows (parsed dataset lines, numbered from 1) like ``iter_dataset`` validates a file.

    ``auto`` detects the format from the first rows that say (rollcage when none does).
    """
    values = list(rows)
    chosen: DatasetFormat = "rollcage" if format == "auto" else format
    if format == "auto":
        found = (detect_format_of(value) for value in values[:_DETECT_LINES])
        chosen = next((f for f in found if f is not None), "rollcage")
    return list(
        _unique(
            validate_value(number, value, format=chosen, environment=environment)
            for number, value in enumerate(values, start=1)
        )
    )


def _unique(items: Iterable[Task | InvalidRow]) -> Iterator[Task | InvalidRow]:
    """The items, a task whose id came before made an ``InvalidRow`` (rollout ids would collide)."""
    seen: dict[str, int] = {}
    for item in items:
        if isinstance(item, Task):
            first = seen.get(item.id)
            if first is not None:
                yield InvalidRow(item.line, f"duplicate id {item.id!r} (first on line {first})", item.id)
                continue
            seen[item.id] = item.line
        yield item
