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

import dataclasses
import hashlib
import os
import re
import select
import stat
import tempfile
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, BinaryIO, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollcage.controller._formats import (
    DatasetFormat,
    detect_format_of,
    from_inspect,
    from_nemo_gym,
    inspect_notices,
)
from rollcage.controller._graders import ExactGrader, GraderSpec, VerifyGrader, check_pattern
from rollcage.controller._inspect_scoring import choice_positions
from rollcage.environments import EnvironmentInfo, bundled_environments
from rollcage.errors import ConfigError, ControllerOnlyFieldError, RollcageError
from rollcage.headers import id_problem
from rollcage.protocol import (
    MAX_INPUT_BYTES,
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
from rollcage.wire import SUBMIT

__all__ = [
    "MAX_LINE_BYTES",
    "DatasetRow",
    "DatasetSource",
    "EnvironmentRef",
    "InvalidRow",
    "RowModelSettings",
    "RowResourceTool",
    "Task",
    "detect_format",
    "input_problem",
    "iter_dataset",
    "known_served_environment",
    "normalise_url",
    "open_dataset",
    "served_environment",
    "tasks_from_rows",
    "url_key",
]

_URL = re.compile(r"^https?://[^\s/]+(/\S*)?$", re.IGNORECASE)
_MAX_ID = 256
_BOM = b"\xef\xbb\xbf"
_DETECT_LINES = 100
MAX_LINE_BYTES = MAX_INPUT_BYTES + 32 * 1024 * 1024
"""The longest dataset line read: the worker's input bound, and room for the row's controller-only fields.
A longer line is an invalid row (with its number) and is skipped without being held in memory."""
_INPUT_MARGIN = 1024 * 1024
"""What input.json may grow by after validation (real endpoint URLs, session cookies, a harness's paths)."""
_SKIP_CHUNK = 1024 * 1024
_WRITER_WAIT_S = 10.0
"""How long a FIFO given as the dataset may wait for its writer before the run is refused."""
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A tool name the model can call (the OpenAI function-name rule) and safe as an endpoint path."""
_RESERVED_TOOL_NAMES = frozenset({"seed_session", "verify", "close_session", "aggregate_metrics", SUBMIT})
"""The environment's own endpoints (NeMo Gym's protocol) and the agent's answer: never a tool."""
_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})
_PART_TEXT = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}


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
    strict: bool | None = Field(
        default=None, description="The function tool's strict (schema-exact arguments); None: false."
    )


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


class RowSandbox(_Row):
    """Where a row's agent code runs: a task image (a copy-on-write root of it per rollout)."""

    image: str = Field(
        description="The image: docker://HOST[:PORT]/NAME[:TAG|@sha256:...], oci:PATH[:TAG], "
        "docker-archive:PATH or dir:PATH."
    )

    @field_validator("image")
    @classmethod
    def _image_ref(cls, value: str) -> str:
        from rollcage.images import parse_ref

        try:
            return str(parse_ref(value))
        except RollcageError as exc:
            raise ValueError(str(exc)) from exc


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
    sandbox: RowSandbox | None = Field(
        default=None, description="The task image agent code runs in; None: the run's --image, if any."
    )
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
        if isinstance(value, str):
            if not (0 < len(value) <= _MAX_ID):
                raise ValueError(f"must be 1 to {_MAX_ID} characters")
            # Printable Unicode ('café', '日本-1') runs: headers carry it percent-encoded, and a rollout
            # directory's name is sanitised and hashed (rollout_id). What no header, log line or
            # terminal can show faithfully is refused here, with the row's line number.
            problem = id_problem(value)
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("input")
    @classmethod
    def _sendable_input(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        problem = input_problem(value)
        if problem is not None:
            raise ValueError(problem)
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
        serves: For an external URL: the bundled environment it says it serves (rollcage's own apps
            say so at ``GET /``, e.g. one served by URL for a multi-node cluster), whose tools and
            ``/verify`` files it then offers; ``None``: unknown (or a bundled environment).
    """

    key: str
    bundled: EnvironmentInfo | None
    url: str | None
    serves: EnvironmentInfo | None = None

    @property
    def catalog(self) -> EnvironmentInfo | None:
        """What is known of its tools and ``/verify`` files: the bundled environment it is or serves."""
        return self.bundled or self.serves


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

    def __post_init__(self) -> None:
        # Reasons quote what the row holds (a key, a value): one line, whatever the row put in them,
        # so a key like "\n" can neither split the report nor forge another line of it.
        object.__setattr__(self, "reason", printable_line(self.reason))


def printable_line(text: str) -> str:
    """``text`` on one line: every character that is not printable written as its escape (``\\n``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


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
        notices: What a run says up front of a row written for another harness: what is assumed of
            it and what is not run as that harness would (each said once, naming the first such row).
    """

    line: int
    row: DatasetRow
    environment: EnvironmentRef | None
    tools: tuple[ToolSpec, ...]
    grader: GraderSpec | None
    verifier: dict[str, Any] = field(default_factory=dict)
    create_params: dict[str, Any] | None = None
    notices: tuple[str, ...] = ()

    @property
    def id(self) -> str:
        """The task id."""
        return self.row.id

    @property
    def index(self) -> int:
        """The task's dataset row as NeMo Gym numbers it (``_ng_task_index``).

        The row's own ``_ng_task_index`` when it carries one (NeMo Gym honours a
        caller's), else the row's 0-based line in the dataset, so an exported row joins
        back to its prompt whatever order the rollouts finished in.
        """
        own = self.verifier.get("_ng_task_index")
        if isinstance(own, int) and not isinstance(own, bool) and own >= 0:
            return own
        return self.line - 1


def input_problem(value: str | list[dict[str, Any]]) -> str | None:
    """Why a row's model-visible input could never be sent to a model; ``None`` when it can.

    The items the worker sends (``rollcage.model``) to a Chat Completions or Responses endpoint:
    ``message`` (role ``user``, ``system``, ``developer`` or ``assistant``; content a string or a
    list of text, refusal and ``input_image`` parts), ``function_call`` (string ``call_id``,
    ``name`` and ``arguments``), ``function_call_output`` (string ``call_id``) and ``reasoning``.
    """
    if isinstance(value, str):
        return None
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind not in _ITEM_TYPES:
            return f"{where}.type: {_shown(kind)} is not an input item ({', '.join(sorted(_ITEM_TYPES))})"
        if kind == "message":
            problem = _message_problem(item, where)
        elif kind == "function_call":
            problem = next(
                (
                    f"{where}.{key}: must be a string, got {_shown(item.get(key))}"
                    for key in ("call_id", "name", "arguments")
                    if not isinstance(item.get(key, "" if key == "arguments" else None), str)
                ),
                None,
            )
        elif kind == "function_call_output":
            problem = None if isinstance(item.get("call_id"), str) else f"{where}.call_id: must be a string"
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _message_problem(item: dict[str, Any], where: str) -> str | None:
    role = item.get("role")
    if role not in _ROLES:
        return f"{where}.role: {_shown(role)} is not a role ({', '.join(sorted(_ROLES))})"
    content = item.get("content", "")
    if isinstance(content, str):
        return None
    if not isinstance(content, list):
        return f"{where}.content: must be a string or a list of content parts, got {_shown(content)}"
    for index, part in enumerate(content):
        at = f"{where}.content[{index}]"
        if not isinstance(part, dict):
            return f"{at}: must be an object, got {_shown(part)}"
        kind = part.get("type")
        field_name = _PART_TEXT.get(kind) if isinstance(kind, str) else None
        if field_name is not None:
            if not isinstance(part.get(field_name, ""), str):
                return f"{at}.{field_name}: must be a string, got {_shown(part.get(field_name))}"
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                return f"{at}.image_url: must be a string"
        else:
            known = ", ".join(sorted([*_PART_TEXT, "input_image"]))
            return f"{at}.type: {_shown(kind)} is not a content part the model client sends ({known})"
    return None


def _shown(value: Any) -> str:
    """A value for a message: short, and its type when it is not text."""
    if isinstance(value, str):
        return repr(value[:60])
    kinds = {bool: "a boolean", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")


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


_IDENTITY_TIMEOUT_S = 3.0
"""Bound on asking an environment URL which bundled environment it serves (once per URL)."""
_IDENTITY_LIMIT = 64 * 1024
_identities: dict[str, EnvironmentInfo | None] = {}
_identities_lock = threading.Lock()


def served_environment(url: str) -> EnvironmentInfo | None:
    """The bundled environment served at ``url``, as its ``GET /`` says; ``None``: none or unknown.

    rollcage's bundled apps answer ``{"environment": NAME, "tools": [...]}`` there; served by URL
    (the multi-node recipe) they offer the same tools as when the controller starts them. Asked once
    per URL and process (blocking, bounded by ``_IDENTITY_TIMEOUT_S``); any other answer, or none,
    is "unknown", never an error: the URL may be any NeMo Gym resource server.
    """
    with _identities_lock:
        if url in _identities:
            return _identities[url]
    info = _ask_identity(url)
    with _identities_lock:
        _identities[url] = info
    return info


def _ask_identity(url: str) -> EnvironmentInfo | None:
    import httpx

    try:
        with httpx.Client(trust_env=False, follow_redirects=False, timeout=_IDENTITY_TIMEOUT_S) as client:
            with client.stream("GET", f"{url}/") as response:
                if response.status_code != 200:
                    return None
                data = b""
                for chunk in response.iter_bytes():
                    data += chunk
                    if len(data) > _IDENTITY_LIMIT:
                        return None
        said = orjson.loads(data)
    except (httpx.HTTPError, orjson.JSONDecodeError, OSError):
        return None
    if not isinstance(said, dict) or not isinstance(said.get("environment"), str):
        return None
    info = bundled_environments().get(said["environment"])
    tools = said.get("tools")
    # Its own words must match what rollcage knows of that environment, or nothing is assumed.
    if (
        info is None
        or not isinstance(tools, list)
        or sorted(map(str, tools)) != sorted(t.name for t in info.tools)
    ):
        return None
    return info


def known_served_environment(url: str) -> EnvironmentInfo | None:
    """What :func:`served_environment` found for ``url`` if it was asked; ``None`` otherwise (never asks)."""
    with _identities_lock:
        return _identities.get(url)


def _identified(row: DatasetRow, env: EnvironmentRef | None) -> EnvironmentRef | None:
    """``env``, with the bundled environment its URL serves where the row relies on what it offers:
    its default tools (the row names none) or a tool named without a spec. Asked only then, so a row
    that says everything itself never costs its environment a request."""
    if env is None or env.url is None:
        return env
    if row.tools is not None and not any(isinstance(t, str) and t != "python" for t in row.tools):
        return env
    return dataclasses.replace(env, serves=served_environment(env.url))


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
        wanted = list(env.catalog.default_tools) if env is not None and env.catalog else ["python"]
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
                    strict=tool.strict,
                )
            )
        elif tool in _BUILTIN_TOOLS:
            specs.append(_BUILTIN_TOOLS[tool]())
        else:
            catalog = {t.name: t for t in env.catalog.tools} if env is not None and env.catalog else {}
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
    for name in names:
        if not _TOOL_NAME.fullmatch(name):
            raise ConfigError(
                f"tool name {_shown(name)}: use 1 to 64 letters, digits, '_' or '-' (the name the model "
                "calls, and the tool's endpoint path)"
            )
        if name in _RESERVED_TOOL_NAMES:
            raise ConfigError(
                f"tool name {name!r} is reserved ({', '.join(sorted(_RESERVED_TOOL_NAMES))}: the "
                "environment's own endpoints and the agent's answer)"
            )
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
    if spec.type in ("exact", "normalized", "numeric", "match", "includes") and row.expected is None:
        raise ConfigError(f"grader {spec.type!r} needs 'expected'")
    if spec.type == "choice":
        # Inspect refuses a target naming no option when it scores; here it is named before anything runs.
        expected = row.expected
        if not (
            isinstance(expected, str)
            or (isinstance(expected, list) and expected and all(isinstance(x, str) for x in expected))
        ):
            raise ConfigError(
                'grader \'choice\' needs \'expected\': the correct letter(s), e.g. "B" or ["A", "C"]'
            )
        try:
            choice_positions(expected, spec.choices)
        except ValueError as exc:
            raise ConfigError(f"grader 'choice': {exc}") from None
    if spec.type == "regex":
        pattern = spec.pattern if spec.pattern is not None else row.expected
        if not isinstance(pattern, str):
            raise ConfigError("grader 'regex' needs 'pattern' or a string 'expected'")
        problem = check_pattern(pattern, ignore_case=spec.ignore_case)
        if problem is not None:
            raise ConfigError(f"grader 'regex': {problem}")
    return spec


def _check_worker_input(row: DatasetRow, tools: tuple[ToolSpec, ...], env: EnvironmentRef | None) -> None:
    """Build the sandbox's view once now, with placeholder endpoints and the row's own model settings,
    and read it back as the worker reads input.json, so a row that could never become a valid
    input.json (a controller-only key nested in ``extra_body``, an input over the worker's bound) is
    rejected with its line number instead of failing every attempt in the sandbox.

    Raises:
        ValidationError: The worker would refuse it.
        ConfigError: It would be larger than the worker reads.
    """
    resources = {env.key: ResourceEndpoint(base_url="http://127.0.0.1:1")} if env is not None else {}
    settings = row.model.model_dump(exclude_none=True)
    built = WorkerInput(
        rollout_id="check",
        task_id=row.id,
        input=row.input,
        instructions=row.instructions,
        model=ModelEndpoint(base_url="http://127.0.0.1:1/v1", model="check", **settings),
        agent=row.agent,
        executor=row.executor,
        tools=list(tools),
        resources=resources,
    )
    size = len(built.model_dump_json())
    if size + _INPUT_MARGIN > MAX_INPUT_BYTES:
        raise ConfigError(
            f"the row's input.json would be {size / 2**20:.1f} MiB; the worker reads at most "
            f"{MAX_INPUT_BYTES // 2**20} MiB (less {_INPUT_MARGIN // 2**20} MiB for what the run adds): "
            "make the input smaller"
        )
    if built.model.sampling.extra_body:
        # The worker reads the settings as plain JSON, which WorkerInput's checks walk (controller-only
        # keys, depth); built from models, they were not walked above. Of the settings, only
        # extra_body holds free-form keys (every other field is typed, unknown fields refused).
        WorkerInput.model_validate(
            {
                "rollout_id": "check",
                "task_id": row.id,
                "input": "",
                "model": built.model.model_dump(mode="json"),
            }
        )


def _open(path: Path) -> BinaryIO:
    try:
        return path.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror or exc}") from exc


def _lines(handle: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """Numbered non-blank lines; ``None`` for a line over ``MAX_LINE_BYTES`` (skipped, never held whole).

    A UTF-8 byte order mark opening the file is not part of line 1.
    """
    number = 0
    while raw := handle.readline(MAX_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            del raw
            while (rest := handle.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        if number == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM) :]  # some editors start a UTF-8 file with one
        if raw.strip():
            yield number, raw


class DatasetSource:
    """A dataset that can be read as often as the run needs: the file itself, or a copy of a pipe.

    A run reads its dataset more than once (the format, a validation pass, the rows to run); a
    pipe (``<(...)``, ``/dev/stdin``) can be read once only, so it is copied, once, to a temporary
    file that goes with :meth:`close`.

    Attributes:
        path: A regular file to read the dataset from.
        given: The path the user gave.
    """

    def __init__(self, path: Path, given: Path, *, spool: bool) -> None:
        self.path = path
        self.given = given
        self._spool = spool

    def close(self) -> None:
        """Remove the copy of a pipe (a regular file is left alone)."""
        if self._spool:
            self._spool = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def open_dataset(path: Path, *, writer_wait_s: float = _WRITER_WAIT_S) -> DatasetSource:
    """The dataset at ``path``, ready to be read several times (blocking).

    A regular file is read where it is. A pipe or FIFO is read once, to its end, into a
    temporary file; a FIFO that no program opens for writing within ``writer_wait_s`` is
    refused rather than waited on for ever. Anything else (a directory, a terminal, a device)
    is refused.

    Raises:
        ConfigError: It cannot be opened, is not a file or a pipe, or a FIFO's writer never came.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read dataset {path}: {exc.strerror or exc}") from exc
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return DatasetSource(path, path, spool=False)
        if not stat.S_ISFIFO(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file or a pipe"
            raise ConfigError(f"dataset {path} is {kind}: give a JSONL file, or a pipe of one")
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP)
        if not poller.poll(writer_wait_s * 1000):
            raise ConfigError(
                f"dataset {path} is a FIFO that no program opened for writing within {writer_wait_s:g} s: "
                "start its writer first, or give a regular file"
            )
        os.set_blocking(fd, True)
        return _spool(fd, path)
    finally:
        os.close(fd)


def _spool(fd: int, given: Path) -> DatasetSource:
    handle, name = tempfile.mkstemp(prefix="rollcage-dataset-", suffix=".jsonl")
    try:
        with os.fdopen(handle, "wb") as out:
            while chunk := os.read(fd, _SKIP_CHUNK):
                out.write(chunk)
    except OSError as exc:
        os.unlink(name)
        raise ConfigError(f"cannot read dataset {given}: {exc.strerror or exc}") from exc
    return DatasetSource(Path(name), given, spool=True)


def validate_row(
    line: int,
    raw: bytes | None,
    *,
    format: DatasetFormat = "rollcage",
    environment: str | None = None,
    base: Path | None = None,
) -> Task | InvalidRow:
    """Parse and resolve one line (see ``iter_dataset``; duplicates are not checked here).

    ``raw`` is ``None`` for a line that was too long to read (see ``MAX_LINE_BYTES``).
    """
    if raw is None:
        return InvalidRow(
            line, f"the line is over {MAX_LINE_BYTES // 2**20} MiB, more than a row can be (it was skipped)"
        )
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return InvalidRow(line, f"not valid JSON: {exc}")
    return validate_value(line, value, format=format, environment=environment, base=base)


def validate_value(
    line: int,
    value: Any,
    *,
    format: DatasetFormat = "rollcage",
    environment: str | None = None,
    base: Path | None = None,
) -> Task | InvalidRow:
    """Resolve one parsed row, numbered ``line`` (1-based) in its source (duplicates are not checked here).

    ``base``: the directory relative paths in a row are read from (an Inspect sample's compose file);
    ``None``: the working directory.
    """
    if not isinstance(value, dict):
        return InvalidRow(line, f"a row must be a JSON object, got {type(value).__name__}")
    raw_id = value.get("id")
    task_id = str(raw_id) if isinstance(raw_id, str | int) and not isinstance(raw_id, bool) else None
    verifier: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    notices: tuple[str, ...] = ()
    try:
        if format == "nemo-gym":
            value, verifier, params = from_nemo_gym(value, line, environment)
        elif format == "inspect":
            notices = inspect_notices(value, environment)
            value = from_inspect(value, line, environment, base=base)
        elif environment is not None and value.get("environment") is None:
            value = {**value, "environment": environment}
    except ConfigError as exc:
        return InvalidRow(line, f"{format} row: {exc}", task_id)
    try:
        row = DatasetRow.model_validate(value)
    except ValidationError as exc:
        return InvalidRow(line, describe_validation_error(exc), task_id)
    try:
        env = _identified(row, _environment(row.environment))
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
        notices=notices,
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
            if raw is None:
                continue
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
        base = path.absolute().parent
        rows = (
            validate_row(n, raw, format=format, environment=environment, base=base)
            for n, raw in _lines(handle)
        )
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
