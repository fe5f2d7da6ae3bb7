"""The typed artifacts: the only shapes that cross a process boundary.

Every model forbids unknown fields, so a typo or a smuggled field is an error at
the boundary rather than silently ignored state. Nothing the worker writes has a
reward or grade field: grading happens outside the sandbox, on the controller's
side, and only ``RolloutRecord`` carries a reward.

Response items (``message``, ``function_call``, ``function_call_output``,
``reasoning``) are kept as plain JSON objects shaped like the OpenAI Responses
API, because they are carried through verbatim rather than interpreted.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

if TYPE_CHECKING:
    from pydantic import ValidationError

from rollcage.errors import ControllerOnlyFieldError, ErrorKind

__all__ = [
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TOKEN_COUNT",
    "MAX_TOKEN_ID",
    "RESERVED_REQUEST_FIELDS",
    "SCHEMA_VERSION",
    "AgentSettings",
    "BashToolSpec",
    "BoundaryRecord",
    "BudgetMechanism",
    "BudgetName",
    "BudgetUse",
    "BuiltinHarness",
    "CallAttempt",
    "CallTokens",
    "CaptureExchange",
    "CapturedBody",
    "CapturedMessage",
    "Checkpoint",
    "CheckpointSettings",
    "CommandHarness",
    "DeltaField",
    "EditorToolSpec",
    "ErrorKind",
    "ExecutorSettings",
    "HarnessEnvironment",
    "HarnessSpec",
    "HealthFinding",
    "HealthVerdict",
    "ImageSandbox",
    "ListDelta",
    "ModelCall",
    "ModelEndpoint",
    "NooaHarness",
    "Outcome",
    "Percentiles",
    "PythonToolSpec",
    "ResourceEndpoint",
    "ResourceToolSpec",
    "ResponseItem",
    "ResponseOutput",
    "ResumeLink",
    "ResumeRequest",
    "ResumedFrom",
    "RolloutHealth",
    "RolloutMetrics",
    "RolloutRecord",
    "RolloutUsage",
    "RunMetrics",
    "RunnerError",
    "SamplingParams",
    "SignalEvent",
    "SupervisorReceipt",
    "TerminationReason",
    "TokenCoverage",
    "TokenField",
    "TokenUsage",
    "ToolCall",
    "ToolSpec",
    "ToolStatus",
    "Trajectory",
    "Turn",
    "TurnResolution",
    "TurnStart",
    "WorkerInput",
    "WorkerResult",
    "artifact_models",
    "describe_validation_error",
    "json_problem",
]

SCHEMA_VERSION: Literal[2] = 2
"""Version of the artifact formats (every artifact of one rollcage shares it).

2: model calls carry ids, attempts, owning turn and token data; trajectories have turns;
rollout records carry their health; the journal's deltas and call starts.
A reader meets any other version with an error that names both (see ``_check_version``).
"""

MAX_TOKEN_ID = 2**63 - 1
"""The largest token id an artifact holds (int64: what tokenizers and trainers store)."""

MAX_TOKEN_COUNT = 2**40
"""The largest token count a model call may report (about 10^12: no context comes near it). A run's sums
of counts this size stay far inside the 64-bit integers JSON readers keep exactly."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of containers accepted in JSON that crosses a boundary (input.json, a model response).

Far beyond any real input or response (a Responses item with a JSON Schema nests about 10 deep), and far
below the limits of the parsers and serialisers downstream (pydantic: about 200, orjson's writer: 255),
so a value that was accepted can always be written back into a journal line or a result.
"""

MAX_INPUT_BYTES = 64 * 1024 * 1024
"""The largest input.json the worker reads; a larger one is invalid input (a task's input is text, not a
data set). A dataset row whose input.json would be larger is refused when the dataset is validated."""

_DAY_S = 86_400.0
_EXTRA_BODY_KEYS = 32
_EXTRA_BODY_DEPTH = 16
_EXTRA_BODY_BYTES = 64 * 1024
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")

RESERVED_REQUEST_FIELDS = frozenset(
    {
        "model",
        "messages",
        "input",
        "instructions",
        "tools",
        "stream",
        "stream_options",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "include",
        "n",
    }
)
"""Request fields rollcage builds itself, never taken from ``SamplingParams.extra_body``: the conversation,
the tools, streaming, the typed sampling settings, and ``n`` (rollcage reads one choice)."""

Outcome = Literal["completed", "agent_error", "timeout", "cancelled", "infra_failure"]
"""How one attempt ended, as classified by the supervisor (see docs/reference/outcomes.md)."""

TerminationReason = Literal[
    "completed", "max_policy_calls", "max_tool_calls", "invalid_policy_output", "cancelled", "error"
]
"""Why the agent loop stopped."""

ResponseItem = dict[str, Any]
"""One Responses-API item (``message``, ``function_call``, ``function_call_output``, ``reasoning``)."""

# Keys that belong to the controller alone. They are rejected by name, anywhere in
# WorkerInput, with a message that says why, before the generic unknown-field check.
CONTROLLER_ONLY_KEYS = frozenset(
    {
        "expected",
        "expected_answer",
        "reference_answer",
        "answer_key",
        "grader",
        "grading",
        "reward",
        "rewards",
        "score",
        "api_key",
        "authorization",
        "credentials",
        "secret",
    }
)


class _Model(BaseModel):
    """Base of every artifact: unknown fields are an error."""

    # Infinity and NaN are not numbers any artifact means: a timeout of Infinity never fires.
    model_config = ConfigDict(extra="forbid", defer_build=True, allow_inf_nan=False)


class _Frozen(_Model):
    """Base of published values that must not change after they are built."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False)


def _check_version(data: Any, artifact: str) -> Any:
    """Refuse an artifact of another schema version, with a message that names both versions."""
    if isinstance(data, dict) and "schema_version" in data:
        found = data["schema_version"]
        if found != SCHEMA_VERSION:
            older = isinstance(found, int) and not isinstance(found, bool) and found < SCHEMA_VERSION
            writer = "an older rollcage" if older else "a newer rollcage (or something else)"
            raise ValueError(
                f"field 'schema_version': this {artifact} has artifact schema version {found!r}, written by "
                f"{writer}; this rollcage reads version {SCHEMA_VERSION} only: read it with the rollcage "
                "that wrote it, or produce it again"
            )
    return data


class _VersionGate(BaseModel):
    """Mixin of the versioned artifacts: another ``schema_version`` is refused by name, first."""

    # The same settings as _Model: deferred, or importing the protocol would build (and pay for) it.
    model_config = ConfigDict(extra="forbid", defer_build=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _same_version(cls, data: Any) -> Any:
        return _check_version(data, cls.__name__)


class RunnerError(_Frozen):
    """Why a rollout did not complete normally."""

    kind: ErrorKind = Field(description="transient: infrastructure; fatal: final; cancelled: stopped.")
    type: str = Field(description="The exception class name, e.g. 'TransientModelError'.")
    message: str = Field(description="What happened, in words a user can act on.")


# --------------------------------------------------------------------------- input


class SamplingParams(_Model):
    """Sampling parameters sent with every model request; ``None`` means "the server's default"."""

    temperature: float | None = Field(default=None, ge=0, description="Sampling temperature (0 or more).")
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass, in (0, 1].")
    max_output_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**31 - 1,
        description="Cap on generated tokens per call (max_tokens for Chat Completions).",
    )
    seed: int | None = Field(
        default=None, ge=-(2**63), le=2**64 - 1, description="Sampling seed, where the server supports it."
    )
    stop: list[str] | None = Field(default=None, description="Stop sequences (Chat Completions only).")
    logprobs: bool | None = Field(
        default=None,
        description="Ask for the log probability of every sampled token: 'logprobs' for Chat Completions, "
        "include 'message.output_text.logprobs' for Responses. The trajectory keeps them per model call "
        "(ModelCall.tokens).",
    )
    top_logprobs: int | None = Field(
        default=None,
        ge=0,
        le=20,
        description="Most likely alternatives returned per token, beside the sampled one (0: none). vLLM "
        "returns per-token logprobs only when this is set with 'logprobs'.",
    )
    extra_body: dict[str, Any] = Field(
        default_factory=dict,
        description="Server-specific request fields, sent as they are beside the ones rollcage builds (the "
        "OpenAI SDK's extra_body). For RL on vLLM: {'return_token_ids': true} (prompt and completion token "
        "ids), {'return_tokens_as_token_ids': true} (logprob tokens as 'token_id:N'), {'prompt_logprobs': 0} "
        "(the prompt tokens' log probabilities); also 'top_k', 'min_p', 'repetition_penalty', "
        "'chat_template_kwargs'. At most 32 keys, names of letters, digits and '_', JSON values at most 16 "
        "deep and 64 KiB in all; a field rollcage sets itself (RESERVED_REQUEST_FIELDS) is refused.",
    )

    @field_validator("extra_body")
    @classmethod
    def _pass_through_only(cls, value: dict[str, Any]) -> dict[str, Any]:
        if len(value) > _EXTRA_BODY_KEYS:
            raise ValueError(f"extra_body: {len(value)} fields, at most {_EXTRA_BODY_KEYS}")
        for key in value:
            if not _FIELD_NAME.fullmatch(key):
                raise ValueError(f"extra_body: {key!r} is not a request field name (letters, digits, '_')")
            if key in RESERVED_REQUEST_FIELDS:
                raise ValueError(
                    f"extra_body: {key!r} is a field rollcage sets itself; use the sampling setting or the "
                    "endpoint setting for it"
                )
        problem = json_problem(value, max_depth=_EXTRA_BODY_DEPTH)
        if problem is not None:
            raise ValueError(f"extra_body: {problem}")
        size = len(json.dumps(value, allow_nan=False, separators=(",", ":")))
        if size > _EXTRA_BODY_BYTES:
            raise ValueError(f"extra_body: {size} bytes of JSON, at most {_EXTRA_BODY_BYTES}")
        return value


class ModelEndpoint(_Model):
    """Where and how the worker calls the model. Never holds a key: the egress proxy adds it."""

    base_url: str = Field(
        description="Base URL as seen from inside the sandbox, ending in /v1 (e.g. http://127.0.0.1:8000/v1)."
    )
    model: str = Field(description="Model name sent in every request.")
    api: Literal["chat", "responses"] = Field(
        default="chat", description="chat: /chat/completions; responses: /responses."
    )
    sampling: SamplingParams = Field(default_factory=SamplingParams, description="Sampling parameters.")
    stream: bool = Field(default=False, description="Request server-sent events and assemble them.")
    timeout_s: float = Field(
        default=120.0, gt=0, le=_DAY_S, description="Deadline for one request, first byte to last."
    )
    connect_timeout_s: float = Field(
        default=10.0, gt=0, le=_DAY_S, description="Deadline for establishing a connection."
    )
    max_retries: int = Field(default=3, ge=0, le=20, description="Retries of a transient failure per call.")
    retry_backoff_s: float = Field(
        default=0.5, ge=0, le=_DAY_S, description="First backoff; doubles per retry."
    )
    max_response_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        le=1 << 32,
        description="Largest response body (decoded) read from the endpoint; a larger one is a transient "
        "malformed-response error, as is a response nested deeper than MAX_JSON_DEPTH.",
    )
    uds: str | None = Field(
        default=None, description="Unix socket of the egress proxy; None means connect to base_url directly."
    )


class ResourceEndpoint(_Model):
    """An HTTP resource server the agent's tools call (the NeMo Gym convention: JSON POST per tool)."""

    base_url: str = Field(description="Base URL as seen from inside the sandbox.")
    uds: str | None = Field(default=None, description="Unix socket of the egress proxy; None: direct.")
    timeout_s: float = Field(default=30.0, gt=0, le=_DAY_S, description="Deadline for one tool request.")


class PythonToolSpec(_Model):
    """The persistent Python executor, offered as a tool (function_calling) or as code blocks (codeact)."""

    type: Literal["python"] = "python"
    name: str = Field(default="python", description="Tool name the model sees.")
    description: str = Field(
        default="Run Python code in a persistent session; returns stdout, stderr and the last value.",
        description="Tool description the model sees.",
    )


class BashToolSpec(_Model):
    """A persistent bash session in the executor's cage (``{"command": "...", "restart": false}``).

    Commands run one at a time, each bounded by ``AgentSettings.tool_timeout_s`` and
    ``tool_output_limit``; the working directory and exported variables persist between
    calls. ``restart: true`` starts a fresh session.
    """

    type: Literal["bash"] = "bash"
    name: str = Field(default="bash", description="Tool name the model sees.")
    description: str = Field(
        default="Run a command in a persistent bash session (working directory and exported variables "
        "persist between calls); returns its output and, when not 0, its exit status. There is no "
        "terminal: interactive programs see end of input. Pass restart: true to start a fresh session.",
        description="Tool description the model sees.",
    )


class EditorToolSpec(_Model):
    """A file editor with the interface of Anthropic's and OpenHands' editors, run in the executor's cage.

    Commands ``view``, ``create``, ``str_replace``, ``insert`` and ``undo_edit``; paths are absolute.
    """

    type: Literal["editor"] = "editor"
    name: Literal["str_replace_based_edit_tool", "str_replace_editor"] = Field(
        default="str_replace_based_edit_tool",
        description="Tool name the model sees: Anthropic's current name, or str_replace_editor "
        "(OpenHands, SWE-agent, Anthropic's earlier tool).",
    )
    description: str = Field(
        default="View, create and edit files. `view` shows a file with line numbers (`cat -n`; "
        "`view_range` [start, end], end -1 for the rest) or lists a directory 2 levels deep; `create` "
        "writes a new file (`file_text`); `str_replace` replaces `old_str`, which must occur exactly "
        "once, with `new_str`; `insert` inserts `new_str` after line `insert_line` (0: at the top); "
        "`undo_edit` reverts the last edit of `path`. Paths must be absolute.",
        description="Tool description the model sees.",
    )


class ResourceToolSpec(_Model):
    """A tool served by a resource endpoint: ``POST {base_url}/{path}`` with the arguments as JSON."""

    type: Literal["resource"] = "resource"
    name: str = Field(description="Tool name the model sees (and the Python function name in codeact).")
    description: str = Field(default="", description="Tool description the model sees.")
    parameters: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON Schema of the arguments.",
    )
    resource: str = Field(description="Key into WorkerInput.resources.")
    path: str | None = Field(default=None, description="Endpoint path; None means '/<name>'.")


ToolSpec = Annotated[
    PythonToolSpec | BashToolSpec | EditorToolSpec | ResourceToolSpec, Field(discriminator="type")
]
"""A tool offered to the agent, tagged by ``type``."""


_ARG_MAX_CHARS = 65_536
_HARNESS_GRACE_S = 3.0


class BuiltinHarness(_Model):
    """rollcage's own agent loop (:mod:`rollcage.agent`): the default."""

    type: Literal["builtin"] = Field(default="builtin", description="rollcage's own agent loop.")


class NooaHarness(_Model):
    """NVIDIA's NOOA CodeAct agent, run by its own Python (>= 3.12) inside the sandbox.

    The task's input is the argument of a generated agent method, its instructions the agent's
    docstring, its resource tools Python functions in NOOA's execution context; NOOA's answer is
    the value it returns (``return_result``).
    """

    type: Literal["nooa"] = Field(description="The NOOA harness.")
    stop_grace_s: float = Field(
        default=_HARNESS_GRACE_S,
        gt=0,
        le=_DAY_S,
        description="After SIGTERM (cancellation, stop file, a spent budget), how long NOOA has to report "
        "its partial episode before SIGKILL; the worker keeps it under the supervisor's grace.",
    )


class CommandHarness(_Model):
    """Any command-line agent: a command line run in the workspace, the task given on stdin, argv or a file.

    It reaches the model over plain HTTP (``OPENAI_BASE_URL``) and the environment's tools at
    ``ROLLCAGE_TOOLS_URL``; it may report its tool calls and its answer as rollcage harness events
    on the descriptor ``ROLLCAGE_EVENTS_FD``.
    """

    type: Literal["command"] = Field(description="A command-line agent.")
    argv: list[str] = Field(
        min_length=1,
        max_length=256,
        description="The command line; argv[0] is looked up in the harness environment's bin, then "
        "/usr/local/bin:/usr/bin:/bin.",
    )
    task: Literal["stdin", "argv", "file"] = Field(
        default="stdin",
        description="How the task (instructions, a blank line, the input as text) is given: on stdin; as one "
        "more argument after argv; or written to a file in the workspace whose path is that argument.",
    )
    answer: Literal["stdout", "file", "events"] = Field(
        default="stdout",
        description="Where the final answer is: the command's stdout (stripped); the file answer_file in the "
        "workspace; or an 'answer' harness event. None found means the harness gave no answer.",
    )
    answer_file: str = Field(
        default="answer.txt",
        min_length=1,
        max_length=255,
        description="With answer 'file': the answer's path, relative to the workspace.",
    )
    stop_grace_s: float = Field(
        default=_HARNESS_GRACE_S,
        gt=0,
        le=_DAY_S,
        description="After SIGTERM, how long the command has before SIGKILL (kept under the supervisor's "
        "grace).",
    )

    @field_validator("argv")
    @classmethod
    def _plain_arguments(cls, value: list[str]) -> list[str]:
        for position, argument in enumerate(value):
            if "\0" in argument or len(argument) > _ARG_MAX_CHARS:
                raise ValueError(f"argv[{position}] has a NUL or is over {_ARG_MAX_CHARS} characters")
        if not value[0]:
            raise ValueError("argv[0] is empty")
        return value

    @field_validator("answer_file")
    @classmethod
    def _inside_workspace(cls, value: str) -> str:
        parts = value.split("/")
        if value.startswith("/") or "\0" in value or any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{value!r} must be a relative path in the workspace (no '..', not absolute)")
        return value


HarnessSpec = Annotated[BuiltinHarness | NooaHarness | CommandHarness, Field(discriminator="type")]
"""Which agent runs the rollout, tagged by ``type``: ``builtin``, ``nooa`` or ``command``."""


class HarnessEnvironment(_Model):
    """A harness's own Python environment (a virtualenv and its base interpreter), as the sandbox sees it.

    The supervisor mounts ``mounts`` read-only at their host paths, so every path here is the
    same on the host and in the sandbox. Set by the controller (``rollcage harness install``,
    ``--harness-env``), never by a dataset row.
    """

    python: str = Field(description="The environment's interpreter (absolute).")
    bin: str = Field(description="Directory put first on the harness's PATH (absolute).")
    mounts: list[str] = Field(
        max_length=32, description="Host directories mounted read-only at the same path (absolute)."
    )

    @field_validator("python", "bin")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return _absolute_path(value)

    @field_validator("mounts")
    @classmethod
    def _absolute_mounts(cls, value: list[str]) -> list[str]:
        return [_absolute_path(path) for path in value]


class ImageSandbox(_Model):
    """The task image a rollout runs in: agent code sees this root, copy-on-write, not the host's.

    Set by the controller (a row's ``sandbox.image`` or the run's ``--image``) once the image is
    prepared in the node's store; the supervisor mounts the rollout's root over ``root``.
    """

    ref: str = Field(min_length=1, max_length=4096, description="The image reference, canonical.")
    digest: str | None = Field(default=None, description="The image id (config digest); None for dir:.")
    manifest_digest: str | None = Field(default=None, description="The manifest's digest, where known.")
    root: str = Field(description="The unpacked image root in the store (host path, absolute).")
    working_dir: str = Field(default="/", description="The image's WorkingDir ('/' when it sets none).")
    env: list[str] = Field(default_factory=list, max_length=4096, description="The image's Env (NAME=value).")
    user: str | None = Field(default=None, description="The image's User, as written.")
    uid: int = Field(default=0, ge=0, lt=1 << 31, description="The uid agent code has in the image.")
    gid: int = Field(default=0, ge=0, lt=1 << 31, description="The gid agent code has in the image.")

    @field_validator("root", "working_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return _absolute_path(value)


def _absolute_path(value: str) -> str:
    parts = value.split("/")
    if not value.startswith("/") or "\0" in value or ".." in parts or len(value) > 4096:
        raise ValueError(f"{value!r} must be an absolute path without '..'")
    return value


class AgentSettings(_Model):
    """Limits and action style of the agent loop."""

    mode: Literal["function_calling", "codeact"] = Field(
        default="function_calling",
        description="function_calling: tools as function tools; codeact: the model writes fenced Python.",
    )
    max_policy_calls: int = Field(
        default=16, ge=1, le=1_000_000, description="Model calls before the loop stops."
    )
    max_tool_calls: int = Field(
        default=64, ge=0, le=1_000_000, description="Tool calls before the loop stops."
    )
    tool_timeout_s: float = Field(
        default=30.0, gt=0, le=_DAY_S, description="Timeout of one tool call or code cell."
    )
    tool_output_limit: int = Field(
        default=16_384,
        ge=256,
        le=1 << 30,
        description="Characters of one tool result shown to the model; more is cut.",
    )
    max_invalid_outputs: int = Field(
        default=2,
        ge=0,
        le=1_000_000,
        description="Unusable model outputs tolerated: malformed tool JSON, calls of tools that do not "
        "exist, length stops.",
    )
    harness: HarnessSpec | None = Field(
        default=None,
        description="Which agent runs the rollout: builtin (rollcage's loop), nooa, or command; None: the "
        "run's harness (builtin unless the run names another).",
    )


class ExecutorSettings(_Model):
    """The persistent Python executor."""

    backend: Literal["repl", "jupyter"] = Field(
        default="repl", description="repl: lean child process (default); jupyter: ipykernel (optional extra)."
    )
    interrupt_grace_s: float = Field(
        default=2.0,
        gt=0,
        le=_DAY_S,
        description="After SIGINT, how long a cell may take to stop before a restart.",
    )


class CheckpointSettings(_Model):
    """The append-only checkpoint journal."""

    enabled: bool = Field(default=True, description="Write a boundary record after every model/tool step.")


class ResumeRequest(_Model):
    """Continue an earlier attempt of this rollout from its journal instead of starting over.

    The journal itself is not in ``input.json``: the controller copies the earlier
    attempt's ``checkpoint.jsonl`` beside the result as ``resume.jsonl`` (worker-only,
    hidden from agent code), and the worker validates it as evidence before using it.
    """

    previous_rollout_id: str = Field(
        min_length=1, max_length=512, description="Id of the attempt whose journal is replayed."
    )


class WorkerInput(_Model, _VersionGate):
    """``input.json``: the complete allow-list of what enters the sandbox.

    Controller-only state (reference answers, grader settings, rewards,
    credentials) has no field here and is rejected by name if present.
    """

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(min_length=1, description="Unique id of this attempt.")
    task_id: str = Field(min_length=1, description="Id of the task (dataset row).")
    input: str | list[ResponseItem] = Field(description="Model-visible input: text or Responses-API items.")
    instructions: str | None = Field(default=None, description="System instructions; None: none.")
    model: ModelEndpoint = Field(description="The model endpoint as seen from inside the sandbox.")
    agent: AgentSettings = Field(default_factory=AgentSettings, description="Agent loop settings.")
    executor: ExecutorSettings = Field(default_factory=ExecutorSettings, description="Python executor.")
    tools: list[ToolSpec] = Field(default_factory=list, description="Tools offered to the agent.")
    resources: dict[str, ResourceEndpoint] = Field(
        default_factory=dict, description="Resource endpoints by name, referenced by resource tools."
    )
    model_cookies: dict[str, str] = Field(default_factory=dict, description="Cookies sent to the model.")
    resource_cookies: dict[str, str] = Field(default_factory=dict, description="Cookies sent to resources.")
    checkpoint: CheckpointSettings = Field(
        default_factory=CheckpointSettings, description="Journal settings."
    )
    result_mode: int = Field(
        default=0o600, ge=0, le=0o777, description="File mode of result.json (e.g. 0o640 for a collector)."
    )
    harness_env: HarnessEnvironment | None = Field(
        default=None,
        description="The Python environment of a nooa or command harness, mounted read-only; None: none (the "
        "builtin loop, or a command that needs only the system's programs).",
    )
    resume: ResumeRequest | None = Field(
        default=None,
        description="Replay an earlier attempt's journal first; None: start from the first turn.",
    )
    image: ImageSandbox | None = Field(
        default=None,
        description="The task image agent code runs in (a copy-on-write root per rollout); None: the "
        "host's system view.",
    )

    @model_validator(mode="before")
    @classmethod
    def _reject_unsafe_data(cls, data: Any) -> Any:
        problem = json_problem(data)
        if problem is not None:
            raise ValueError(problem)
        found = sorted(_controller_only_paths(data))
        if found:
            raise ControllerOnlyFieldError(
                f"field {found[0]!r} is controller-only state (answers, grading, rewards, credentials) "
                "and must never enter the sandbox; remove it from input.json"
            )
        return data

    @model_validator(mode="after")
    def _check_tool_references(self) -> WorkerInput:
        names: set[str] = set()
        for tool in self.tools:
            if tool.name in names:
                raise ValueError(f"tools: duplicate tool name {tool.name!r}")
            names.add(tool.name)
            if isinstance(tool, BashToolSpec | EditorToolSpec) and self.agent.mode == "codeact":
                raise ValueError(
                    f"tools: tool {tool.name!r} is offered only as a function tool: use agent.mode "
                    "'function_calling' (in codeact, agent code runs shell commands itself)"
                )
            if isinstance(tool, ResourceToolSpec) and tool.resource not in self.resources:
                raise ValueError(
                    f"tools: tool {tool.name!r} names resource {tool.resource!r}, "
                    f"which is not in resources ({sorted(self.resources)})"
                )
        return self


def _controller_only_paths(data: Any) -> list[str]:
    """Dotted paths of controller-only keys in the settings part of an input (not the model-visible input).

    Iterative: the depth of the data is bounded by ``json_problem`` before, not by Python's stack.
    """
    if not isinstance(data, dict):
        return []
    found: list[str] = []
    stack: list[tuple[str, str | None, Any]] = [
        (str(key), key, value)
        for key, value in data.items()
        # model-visible text and tool schemas may mention such words legitimately
        if key not in ("input", "instructions", "tools")
    ]
    while stack:
        path, key, value = stack.pop()
        if isinstance(key, str) and key.lower() in CONTROLLER_ONLY_KEYS:
            found.append(path)
        if isinstance(value, dict):
            stack.extend((f"{path}.{name}", name, child) for name, child in value.items())
        elif isinstance(value, list):
            # A list holds no key of its own: its items are looked into under their index.
            stack.extend((f"{path}[{index}]", None, child) for index, child in enumerate(value))
    return found


def json_problem(value: Any, *, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """Why JSON-like data cannot safely cross a boundary, naming where; ``None`` when it can.

    Two things are refused: nesting deeper than ``max_depth`` containers (it would
    break a parser or serialiser further on, see ``MAX_JSON_DEPTH``) and strings or
    keys with lone surrogates (``"\\udfff"``: no UTF-8 encoding exists, so nothing
    holding one can ever be written to a file). The walk is iterative and stops at
    the first problem.

    Args:
        value: Parsed JSON (dicts, lists, strings, numbers, booleans, None).
        max_depth: The deepest nesting allowed; the top-level container is depth 1.

    Returns:
        A one-line description naming the field (``field 'a.b[2]': ...``), or ``None``.
    """
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return (
                    f"field {path or '(top level)'!r}: contains a lone surrogate, which is not valid Unicode"
                )
            continue
        if not isinstance(item, dict | list):
            continue
        if depth >= max_depth:
            return f"field {path or '(top level)'!r}: nested more than {max_depth} levels deep"
        if isinstance(item, dict):
            for key, child in item.items():
                name = str(key)
                if not _encodable(name):
                    return f"field {path or '(top level)'!r}: a key contains a lone surrogate"
                stack.append((child, f"{path}.{name}" if path else name, depth + 1))
        else:
            stack.extend((child, f"{path}[{index}]", depth + 1) for index, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def describe_validation_error(exc: ValidationError, *, limit: int = 3) -> str:
    """A pydantic ``ValidationError`` as one line that names each field (at most ``limit`` of them).

    Field paths are dotted (``model.timeout_s``); unknown fields say so; the
    input values themselves are left out (they may be huge, or hostile).
    """
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for error in errors[:limit]:
        where = ".".join(str(part) for part in error.get("loc", ())) or "(top level)"
        message = " ".join(str(error.get("msg", "")).removeprefix("Value error, ").split())
        if error.get("type") == "extra_forbidden":
            message = "unknown field"
        # A model-level check names its field in its own message.
        parts.append(
            message
            if not error.get("loc") and message.startswith("field ")
            else f"field {where!r}: {message}"
        )
    more = len(errors) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------- trajectory


class TokenUsage(_Model):
    """Token counts as the server reported them; ``None`` means "not reported", never a guessed 0."""

    input_tokens: int | None = Field(default=None, description="Prompt tokens.")
    output_tokens: int | None = Field(default=None, description="Generated tokens, reasoning included.")
    reasoning_tokens: int | None = Field(default=None, description="Generated reasoning tokens.")
    cached_tokens: int | None = Field(default=None, description="Prompt tokens served from cache.")
    total_tokens: int | None = Field(default=None, description="input + output, as the server said.")


TokenField = Literal["prompt_token_ids", "generation_token_ids", "generation_log_probs"]
"""The three token arrays an RL trainer needs of a model call (NeMo Gym's names)."""

TokenCoverage = Literal["complete", "partial", "unobserved"]
"""How much of something was reported: all of it, some of it, none of it."""

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
"""A token id: an integer (never a boolean or a string) within int64, not negative."""

LogProb = Annotated[float, Field(strict=True, le=0.0, allow_inf_nan=False)]
"""A log probability: a finite number, at most 0."""

_TOKEN_FIELDS: tuple[TokenField, ...] = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class CallTokens(_Model):
    """Token-level data of one model call, as the server returned it (NeMo Gym's field names).

    ``None`` means the server did not return that array (``status`` and ``missing``
    say so): rollcage never guesses or re-tokenizes. Ask for them with
    ``SamplingParams.logprobs`` and, on vLLM, ``extra_body={"return_token_ids": true}``.
    """

    prompt_token_ids: list[TokenId] | None = Field(
        default=None,
        description="Token ids of the whole prompt the server sampled from (chat template applied).",
    )
    generation_token_ids: list[TokenId] | None = Field(
        default=None, description="Token ids of exactly what was sampled, in order."
    )
    generation_log_probs: list[LogProb] | None = Field(
        default=None, description="Log probability of each sampled token, aligned with generation_token_ids."
    )
    prompt_log_probs: list[LogProb | None] | None = Field(
        default=None,
        description="Log probability of each prompt token given the ones before it (vLLM's prompt_logprobs; "
        "None for the first token); None: not returned.",
    )
    scope: Literal["generation", "message_text"] = Field(
        default="generation",
        description="What generation_* cover: every sampled token (generation), or only the text of the "
        "output messages (message_text: a Responses server's output_text logprobs, which leave out "
        "reasoning and tool calls).",
    )
    status: Literal["observed", "partial", "unobserved"] = Field(
        default="unobserved",
        description="observed: all three of prompt_token_ids, generation_token_ids and generation_log_probs "
        "came back; partial: some; unobserved: none.",
    )
    missing: list[TokenField] = Field(
        default_factory=lambda: list(_TOKEN_FIELDS),
        description="The arrays the server did not return.",
    )
    note: str | None = Field(
        default=None,
        description="What was wrong with the token data the server sent and was not kept (arrays of "
        "different lengths, a token id that is not an int64 >= 0, a log probability that is not a finite "
        "number <= 0: that array is dropped); None: nothing.",
    )

    @model_validator(mode="before")
    @classmethod
    def _derive_status(cls, data: Any) -> Any:
        # status and missing follow from the arrays; a writer need not (and cannot wrongly) set them.
        if isinstance(data, dict):
            missing = [name for name in _TOKEN_FIELDS if data.get(name) is None]
            status = "unobserved" if len(missing) == 3 else "partial" if missing else "observed"
            data = {**data, "missing": missing, "status": status}
        return data

    @model_validator(mode="after")
    def _aligned(self) -> CallTokens:
        ids, probs = self.generation_token_ids, self.generation_log_probs
        if ids is not None and probs is not None and len(ids) != len(probs):
            raise ValueError(
                f"generation_token_ids has {len(ids)} tokens but generation_log_probs {len(probs)} values"
            )
        return self


class CallAttempt(_Model):
    """One HTTP attempt of a model call (a retried call has several)."""

    index: int = Field(ge=0, description="0-based attempt number within the call.")
    status: Literal["completed", "failed", "incomplete"] = Field(
        description="completed: an answer came back and was used; failed: an error (error says which); "
        "incomplete: it was in flight when the rollout stopped."
    )
    http_status: int | None = Field(default=None, description="HTTP status of the answer; None: none came.")
    error: RunnerError | None = Field(default=None, description="Why the attempt failed, if it did.")
    started_at: float = Field(description="Unix time the attempt started.")
    first_byte_at: float | None = Field(default=None, description="Unix time of its first response byte.")
    ended_at: float = Field(description="Unix time it ended (or was abandoned).")


class ModelCall(_Model):
    """One model call: the exact request, the raw response, what it meant, and who owns it."""

    id: str = Field(
        min_length=1,
        description="Unique id of the call ('<rollout_id>:m<index>'), the key turns use to own it.",
    )
    index: int = Field(ge=0, description="0-based position among the rollout's model calls.")
    turn: int = Field(ge=0, description="Index of the turn that owns the call (Trajectory.turns).")
    api: Literal["chat", "responses"] = Field(description="API style used.")
    request: dict[str, Any] = Field(description="The exact JSON payload of the last attempt.")
    input: list[ResponseItem] | None = Field(
        default=None,
        description="Chat calls: the Responses-API input items the messages were built from (the wire "
        "messages are in request); None for Responses calls, whose request.input is that list.",
    )
    response: dict[str, Any] | None = Field(
        default=None,
        description="The raw response payload (assembled from events if streamed), with the token arrays "
        "that were lifted into tokens (prompt_token_ids, prompt_logprobs) removed; None when no usable "
        "answer came.",
    )
    status: Literal["completed", "incomplete", "failed"] = Field(description="How the call ended.")
    incomplete_reason: str | None = Field(
        default=None,
        description="Why the output is incomplete: the server's word ('max_output_tokens', 'length', ...), "
        "or 'interrupted' for a call still in flight when the rollout stopped.",
    )
    output: list[ResponseItem] = Field(
        default_factory=list, description="The output as Responses-API items (server item ids kept)."
    )
    usage: TokenUsage = Field(default_factory=TokenUsage, description="Token counts.")
    tokens: CallTokens = Field(
        default_factory=CallTokens, description="Token ids and log probabilities, where the server sent them."
    )
    http_status: int | None = Field(default=None, description="HTTP status of the last attempt.")
    attempts: list[CallAttempt] = Field(
        min_length=1, description="Every HTTP attempt, in order; earlier ones of a retried call included."
    )
    started_at: float = Field(description="Unix time the call started.")
    first_byte_at: float | None = Field(default=None, description="Unix time of the first response byte.")
    ended_at: float = Field(description="Unix time the call ended.")
    error: RunnerError | None = Field(default=None, description="Why the call failed, if it did.")

    def input_items(self) -> list[ResponseItem]:
        """The call's model-visible input as Responses-API items, whichever API it used."""
        if self.input is not None:
            return self.input
        items = self.request.get("input")
        return items if isinstance(items, list) else []


ToolStatus = Literal["pending", "completed", "failed", "cancelled", "incomplete"]


class ToolCall(_Model):
    """One tool call or code cell, from the model's request to its output."""

    call_id: str = Field(
        description="rollcage's id of the call, unique in the rollout (call_<turn>_<k>, cell-<turn>-<k> for "
        "codeact cells, bridge-<turn>-<k> for tools called from agent code); the model sees this id."
    )
    server_call_id: str | None = Field(
        default=None,
        description="The id the model's server gave the call, kept as evidence (servers omit or reuse ids, "
        "so it is never used as a key); None when it gave none.",
    )
    name: str = Field(description="Tool name.")
    arguments: str = Field(description="Arguments exactly as the model wrote them (JSON text or code).")
    turn: int = Field(ge=0, description="Index of the turn (and of its model call) that requested it.")
    status: ToolStatus = Field(
        description="pending until it ends; completed; failed (the tool answered with an error, HTTP "
        "4xx/5xx included, or the call could not be run); cancelled; incomplete if it never ended."
    )
    output: str | None = Field(default=None, description="Text shown to the model; None while pending.")
    started_at: float = Field(description="Unix time the call started.")
    ended_at: float | None = Field(default=None, description="Unix time the call ended; None while pending.")
    duration_s: float | None = Field(default=None, description="ended_at - started_at.")
    origin: Literal["model", "harness"] = Field(
        default="model",
        description="model: it answers a function call or code cell of a model response (turn is that call); "
        "harness: the harness ran it on its own, no model call asked for it (NOOA's synthetic first turn, "
        "which prints the task's inputs): turn is then the number of model calls answered before it.",
    )
    reported_by: Literal["worker", "harness"] = Field(
        default="worker",
        description="Who says how the call ended: worker: rollcage ran it; harness: a harness ran it and "
        "reported it (NOOA's events, a command's harness events): its status and output are the harness's "
        "own account, unverified, or 'incomplete' where it reported nothing.",
    )


TurnResolution = Literal["acted", "answered", "cut_off", "failed", "interrupted", "pending"]
"""How one turn ended: acted (it asked for tool calls or ran code), answered (an answer and no action),
cut_off (stopped at the length limit; its actions were not run), failed (the model call failed),
interrupted (the rollout stopped while the model call was in flight), pending (in a checkpoint: its
model call has not come back yet)."""


class TurnStart(_Model):
    """The start of one turn, journaled before its model call is sent: an in-flight call leaves a trace."""

    index: int = Field(ge=0, description="0-based turn number.")
    id: str = Field(min_length=1, description="Unique id of the turn ('<rollout_id>:t<index>').")
    model_call_id: str = Field(min_length=1, description="Id of the model call the turn makes.")
    started_at: float = Field(description="Unix time the turn started (its model call is sent next).")
    input: list[ResponseItem] = Field(
        description="Responses-API items the turn adds to the conversation before its model call: the task's "
        "input for turn 0, then tool outputs and feedback."
    )


class Turn(_Model):
    """One agent turn: its question, the model's answer and reasoning, and what it did."""

    index: int = Field(ge=0, description="0-based turn number.")
    id: str = Field(min_length=1, description="Unique id of the turn ('<rollout_id>:t<index>').")
    started_at: float = Field(description="Unix time the turn started.")
    ended_at: float | None = Field(
        default=None, description="Unix time its model call ended; None while it is in flight."
    )
    input: list[ResponseItem] = Field(
        description="The question: Responses-API items the turn added to the conversation before its model "
        "call (the task's input for turn 0, then tool outputs and feedback)."
    )
    model_calls: list[str] = Field(description="Ids of the model calls the turn owns (exact ownership).")
    answer: list[ResponseItem] = Field(
        default_factory=list, description="The model's output items other than reasoning (messages, calls)."
    )
    reasoning: list[ResponseItem] = Field(default_factory=list, description="The model's reasoning items.")
    tool_calls: list[str] = Field(
        default_factory=list,
        description="call_ids of the tool calls the turn requested or ran (Trajectory.tool_calls holds them "
        "with their outputs).",
    )
    tool_steps: int = Field(
        ge=0, description="Tool calls of the rollout so far, this turn's included (run or refused)."
    )
    resolution: TurnResolution = Field(description="How the turn ended (see TurnResolution).")


class ResumedFrom(_Model):
    """Where a resumed rollout took over from an earlier attempt, and what it did not redo."""

    previous_rollout_id: str = Field(description="Id of the attempt whose journal was replayed.")
    boundary: int = Field(ge=0, description="seq of the last journal record of that attempt that was used.")
    replayed_model_calls: list[str] = Field(
        description="Ids (in this trajectory) of the model calls answered from the journal, not sent."
    )
    replayed_tool_calls: list[str] = Field(
        description="Tool calls answered from the journal without being sent again (resource tools, submit)."
    )
    rerun_cells: list[str] = Field(
        description="Python cells, bash commands and file editor calls run again in a fresh cage to restore "
        "its state, in their recorded order; each output matched."
    )


class Trajectory(_Model):
    """Everything the agent did, in order."""

    model_calls: list[ModelCall] = Field(default_factory=list, description="Model calls in order.")
    tool_calls: list[ToolCall] = Field(default_factory=list, description="Tool calls in order of request.")
    turns: list[Turn] = Field(default_factory=list, description="Turns in order; each owns its model calls.")
    resumed_from: ResumedFrom | None = Field(
        default=None, description="Set when the rollout continued an earlier attempt from its journal."
    )
    resume_refused: str | None = Field(
        default=None,
        description="Why a resume that was asked for fell back to a fresh start (journal unusable, replay "
        "diverged); None: none was asked for, or it resumed.",
    )


class ResponseOutput(_Model):
    """The rollout's answer, shaped like a Responses-API response object."""

    id: str = Field(description="The rollout id.")
    object: Literal["response"] = "response"
    model: str = Field(description="Model name.")
    status: Literal["completed", "incomplete", "failed", "cancelled"] = Field(description="Overall status.")
    output: list[ResponseItem] = Field(description="All items the episode produced, tool outputs included.")
    output_text: str = Field(default="", description="The final answer text.")
    usage: TokenUsage = Field(
        default_factory=TokenUsage, description="Summed over calls (None if unreported)."
    )


class WorkerResult(_Frozen, _VersionGate):
    """``result.json``: published once, atomically, by the worker. Never carries a reward."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(description="Id of this attempt ('' if the input could not be read).")
    task_id: str = Field(description="Id of the task ('' if the input could not be read).")
    response: ResponseOutput | None = Field(
        description="The final output; None when no model response arrived (e.g. cancelled early)."
    )
    trajectory: Trajectory = Field(default_factory=Trajectory, description="Model and tool calls.")
    model_cookies: dict[str, str] = Field(default_factory=dict, description="Model cookies at the end.")
    resource_cookies: dict[str, str] = Field(default_factory=dict, description="Resource cookies at the end.")
    termination_reason: TerminationReason = Field(description="Why the agent loop stopped.")
    error: RunnerError | None = Field(default=None, description="None when the rollout completed normally.")
    checkpoint_failures: int = Field(default=0, ge=0, description="Boundary records that failed to persist.")
    started_at: float = Field(description="Unix time the worker started.")
    ended_at: float = Field(description="Unix time the result was built.")


DeltaField = Literal[
    "request.messages", "request.input", "input", "tokens.prompt_token_ids", "tokens.prompt_log_probs"
]


class ListDelta(_Model):
    """How a list of a model call extends the same list of an earlier call, so a journal line stays O(new).

    Every request repeats the conversation so far, and every prompt's token ids
    repeat the previous prompt's: the list named by ``field`` is the first ``keep``
    items of model call ``base``'s list followed by ``append``.
    """

    field: DeltaField = Field(description="Which list of the call the delta rebuilds (a dotted path).")
    base: int = Field(ge=0, description="Index of the earlier model call whose list this one extends.")
    keep: int = Field(ge=0, description="Leading items of the base list that are kept.")
    append: list[Any] = Field(description="Items that follow them.")


class BoundaryRecord(_Model):
    """One line of ``checkpoint.jsonl`` (its ``seq`` and checksum are added by the journal).

    ``start`` carries the rollout id and the schema version; ``turn_start`` a turn
    whose model call is about to be sent; ``model_call`` a finished model call and
    the tool calls it requested (pending); ``tool_call`` one finished tool call.
    """

    kind: Literal["start", "turn_start", "model_call", "tool_call", "resumed"] = Field(
        description="Which boundary ('resumed': the records before it replayed an earlier attempt)."
    )
    at: float = Field(description="Unix time of the boundary.")
    schema_version: int | None = Field(default=None, description="Set on 'start': SCHEMA_VERSION.")
    reported_by: Literal["worker", "supervisor", "harness"] = Field(
        default="worker",
        description="Who vouches for the record: worker: rollcage's worker inside the sandbox; supervisor: "
        "journaled outside the sandbox from the egress proxy's capture (a harness's model calls), which "
        "nothing inside can forge; harness: a harness's own report of its tool calls, relayed unverified.",
    )
    rollout_id: str | None = Field(default=None, description="Set on 'start'.")
    turn: TurnStart | None = Field(default=None, description="Set on 'turn_start'.")
    model_call: ModelCall | None = Field(default=None, description="Set on 'model_call'.")
    deltas: list[ListDelta] = Field(
        default_factory=list, description="Lists of model_call left out of it; rebuild them from these."
    )
    tool_calls: list[ToolCall] = Field(
        default_factory=list, description="On 'model_call': requested calls (pending); on 'tool_call': one."
    )
    model_cookies: dict[str, str] | None = Field(default=None, description="Model cookies, if changed.")
    resource_cookies: dict[str, str] | None = Field(default=None, description="Resource cookies, if changed.")
    resumed_from: ResumedFrom | None = Field(default=None, description="Set on 'resumed'.")


class Checkpoint(_Model):
    """A journal folded into a partial view. Evidence only: a checkpoint is never graded."""

    partial: Literal[True] = Field(default=True, description="Always true: this is not a result.")
    rollout_id: str | None = Field(default=None, description="From the journal's start record.")
    seq: int | None = Field(default=None, description="seq of the last intact record; None if empty.")
    trajectory: Trajectory = Field(default_factory=Trajectory, description="Calls so far.")
    output: list[ResponseItem] = Field(
        default_factory=list, description="Responses-style output so far, without calls still pending."
    )
    model_cookies: dict[str, str] = Field(default_factory=dict, description="Latest model cookies.")
    resource_cookies: dict[str, str] = Field(default_factory=dict, description="Latest resource cookies.")


# --------------------------------------------------------------------------- supervisor


class SignalEvent(_Model):
    """A signal the supervisor sent."""

    signal: str = Field(description="Signal name, e.g. 'SIGTERM'.")
    target: Literal["group", "descendants"] = Field(description="The worker's group, or stray descendants.")
    at: float = Field(description="Unix time it was sent.")
    reason: Literal["deadline", "stop", "budget", "grace_expired", "cleanup"] = Field(
        description="Why it was sent (budget: the rollout went over one of its budgets)."
    )


BudgetName = Literal[
    "memory_bytes",
    "processes",
    "workspace_bytes",
    "workspace_inodes",
    "tmp_bytes",
    "tmp_inodes",
    "shm_bytes",
    "shm_inodes",
]
"""The per-rollout budgets the supervisor enforces (see ``rollcage.cage``)."""

BudgetMechanism = Literal["cgroup2", "cgroup1", "rlimit", "tmpfs", "poll", "none"]
"""How a budget is enforced: a cgroup, a per-process rlimit only, a bounded tmpfs, a poll, or not at all."""


class BudgetUse(_Model):
    """One per-rollout budget, as the receipt reports it."""

    budget: BudgetName = Field(description="Which budget.")
    limit: int | None = Field(
        description="The bound (bytes, processes and threads, or entries); None: unbounded."
    )
    mechanism: BudgetMechanism = Field(
        description=(
            "How it was enforced: a cgroup (v2 or v1: the sandbox as a whole), rlimit (per process only: "
            "the machine allowed no cgroup), tmpfs (a hard bound), poll (measured every budget_poll_s: late "
            "by up to one poll), none."
        )
    )
    peak: int | None = Field(description="Highest use observed; None where it could not be measured.")
    exceeded: bool = Field(description="This budget ended the rollout.")


class RolloutUsage(_Model):
    """What one rollout's sandbox cost the machine, as the receipt reports it."""

    cpu_s: float | None = Field(
        description="CPU time (user + system) of every process of the sandbox; None where not measured."
    )
    cpu_mechanism: Literal["cgroup2", "cgroup1", "none"] = Field(
        description=(
            "How cpu_s was counted: the sandbox's cgroup (v2 cpu.stat or v1 cpuacct: exact, whoever reaped "
            "whom; RUSAGE_CHILDREN would miss the processes a dying PID namespace reaps itself), or none."
        )
    )
    peak_memory_bytes: int | None = Field(
        description="Peak memory of the sandbox as a whole; None where not measured."
    )
    memory_mechanism: Literal["cgroup2", "cgroup1", "none"] = Field(
        description="How peak_memory_bytes was measured: the sandbox's memory cgroup, or none."
    )


class SupervisorReceipt(_Frozen, _VersionGate):
    """``receipt.json``: written last by the supervisor, out of the sandbox's reach."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(description="Id of this attempt.")
    outcome: Outcome = Field(description="The classification of this attempt.")
    outcome_reason: str = Field(description="Why this outcome, in words.")
    sandbox: Literal["bwrap", "none"] = Field(description="How the worker was contained.")
    exit_code: int | None = Field(default=None, description="Worker exit code; None if killed by a signal.")
    exit_signal: str | None = Field(default=None, description="Signal that killed the worker, if any.")
    deadline_s: float = Field(description="The wall-clock deadline.")
    grace_s: float = Field(description="Grace between SIGTERM and SIGKILL.")
    deadline_fired: bool = Field(description="The deadline passed before the worker exited.")
    stop_requested: bool = Field(description="An external stop (signal or stop file) was received.")
    signals_sent: list[SignalEvent] = Field(default_factory=list, description="Signals sent, in order.")
    started_at: float = Field(description="Unix time supervision started.")
    ended_at: float = Field(description="Unix time the receipt was built.")
    duration_s: float = Field(description="ended_at - started_at.")
    cleanup_confirmed: bool = Field(description="No descendant of the worker was left alive.")
    descendants_killed: int = Field(default=0, ge=0, description="Stray descendants killed after the worker.")
    temp_files_swept: int = Field(default=0, ge=0, description="Leftover temporary files removed.")
    last_checkpoint_seq: int | None = Field(default=None, description="Last intact journal seq, if any.")
    resumed_from: str | None = Field(
        default=None, description="Id of the earlier attempt this one was asked to continue, if any."
    )
    result_present: bool = Field(description="result.json existed after the worker exited.")
    result_valid: bool = Field(description="result.json parsed as a WorkerResult.")
    result_error: RunnerError | None = Field(default=None, description="The result's error, if any.")
    model_calls_captured: int | None = Field(
        default=None, description="Model-route lines in model_capture.jsonl; None without the egress proxy."
    )
    capture_bytes: int | None = Field(
        default=None, ge=0, description="Size of model_capture.jsonl; None without the egress proxy."
    )
    capture_failures: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Exchanges whose capture line could not be written (disk full, I/O error; the failed write is "
            "cut back off the file, never left torn); None without the egress proxy."
        ),
    )
    proxy_connections_refused: int | None = Field(
        default=None,
        ge=0,
        description="Connections to the egress proxy refused at accept (over the rollout's connection cap).",
    )
    budget_exceeded: str | None = Field(
        default=None,
        description=(
            "The per-rollout budget the policy exceeded (e.g. 'capture_bytes', 'memory_bytes', "
            "'workspace_bytes'), which ended the rollout as agent_error; None: none was."
        ),
    )
    budgets: list[BudgetUse] = Field(
        default_factory=list,
        description="Each per-rollout budget of the sandbox: its bound, mechanism and peak (bwrap only).",
    )
    usage: RolloutUsage | None = Field(
        default=None,
        description="CPU time and peak memory of the sandbox (bwrap only; None before this field).",
    )


class CapturedBody(_Model):
    """A body as captured: parsed JSON when it was JSON, else text, else base64; never more than one."""

    size: int = Field(ge=0, description="Bytes on the wire.")
    json_value: Any = Field(default=None, alias="json", description="The parsed body, when it was JSON.")
    text: str | None = Field(default=None, description="The body as UTF-8 text, when it was not JSON.")
    base64: str | None = Field(default=None, description="The body in base64, when it was not UTF-8.")
    truncated: bool = Field(
        default=False,
        description="The body was over the capture's bound: text/base64 hold only its first bytes.",
    )
    sha256: str | None = Field(default=None, description="Hex SHA-256 of the whole body, when truncated.")

    model_config = ConfigDict(
        extra="forbid", defer_build=True, populate_by_name=True, serialize_by_alias=True, allow_inf_nan=False
    )


class CapturedMessage(_Model):
    """The request or response half of a captured exchange."""

    headers: list[tuple[str, str]] = Field(description="Headers in order; credentials are '[redacted]'.")
    body: CapturedBody = Field(description="The body.")
    status: int | None = Field(default=None, description="HTTP status (responses only).")


class CaptureExchange(_Model):
    """One line of ``model_capture.jsonl``: one exchange through the egress proxy (outside the sandbox)."""

    seq: int = Field(ge=1, description="1-based position in the capture.")
    rollout_id: str = Field(description="The rollout whose sandbox made the request.")
    route: Literal["model", "resource", "denied"] = Field(
        description=(
            "The allowed route the path names (even when the proxy answered itself: 408, 413); denied: off "
            "the allow-list (403) or not a parseable request (400)."
        )
    )
    name: str | None = Field(description="The resource name (resource route), else None.")
    method: str = Field(description="HTTP method.")
    path: str = Field(description="The path the sandbox asked for.")
    upstream_url: str | None = Field(description="Where it was forwarded; None when it was not.")
    credential_added: bool = Field(description="Whether the proxy added the configured credential.")
    request: CapturedMessage = Field(description="What the sandbox sent (credentials redacted).")
    response: CapturedMessage | None = Field(description="What came back; None if nothing did.")
    status: int | None = Field(description="Response status; None if there was no response.")
    started_at: float = Field(description="Unix time the request arrived.")
    first_byte_at: float | None = Field(description="Unix time of the upstream's first response byte.")
    ended_at: float = Field(description="Unix time the exchange ended.")
    duration_s: float = Field(description="ended_at - started_at.")
    error: str | None = Field(description="What went wrong, if anything (upstream unreachable, size bound).")


# --------------------------------------------------------------------------- controller


class RolloutMetrics(_Model):
    """Per-rollout numbers the controller aggregates, computed once when the attempt ends."""

    model_calls: int = Field(default=0, description="Model calls made.")
    failed_model_calls: int = Field(default=0, description="Model calls that failed.")
    tool_calls: int = Field(
        default=0,
        description="Tool calls made (by a resumed rollout: not those answered from the earlier attempt's "
        "journal, which that attempt's record counts; re-run cells are made again and count).",
    )
    input_tokens: int | None = Field(default=None, description="Sum of reported prompt tokens.")
    output_tokens: int | None = Field(default=None, description="Sum of reported completion tokens.")
    total_tokens: int | None = Field(default=None, description="Sum of reported totals.")
    token_counts: TokenCoverage = Field(
        default="unobserved",
        description="complete: every answered model call reported its input and output tokens, so the sums "
        "are the rollout's; partial: the sums cover only the calls that did (or a call was interrupted); "
        "unobserved: none did, or there is no valid result.",
    )
    token_ids: TokenCoverage = Field(
        default="unobserved",
        description="complete: every answered model call has prompt and generation token ids and log "
        "probabilities (CallTokens.status observed); partial: some do; unobserved: none.",
    )
    duration_s: float = Field(default=0.0, description="Supervised wall time.")
    replayed_model_calls: int = Field(
        default=0,
        ge=0,
        description="Model calls of a resumed rollout answered from the earlier attempt's journal (calls "
        "saved); they are not in model_calls and their tokens are not in the sums (the earlier attempt's "
        "record counts them).",
    )


HealthVerdict = Literal["healthy", "unhealthy", "unobserved"]
"""A rollout's health: unhealthy (a check found something), else unobserved (a check could not run for
want of evidence), else healthy (every check ran and found nothing)."""


class RolloutHealth(_Frozen):
    """Health checks of one attempt, computed once from its result and receipt (checks by stable name).

    A check listed in neither ``findings`` nor ``unobserved`` ran and found nothing.
    """

    verdict: HealthVerdict = Field(description="See HealthVerdict; informational checks do not count.")
    findings: dict[str, int] = Field(
        default_factory=dict, description="Check name -> findings (calls, turns, or 1 for the rollout)."
    )
    unobserved: dict[str, str] = Field(
        default_factory=dict, description="Check name -> the evidence (capability) it lacked, in words."
    )
    successful_model_calls: int | None = Field(
        default=None,
        description="Model calls that were answered (for the per-task check); None: unobserved (no valid "
        "result).",
    )


class ResumeLink(_Frozen):
    """How an attempt relates to the earlier attempt it was asked to continue."""

    previous_rollout_id: str = Field(description="Id of the earlier attempt.")
    previous_dir: str = Field(description="Its directory (kept intact as evidence).")
    resumed: bool = Field(description="The attempt continued from the journal (else it started fresh).")
    boundary: int | None = Field(default=None, description="seq of the last journal record used, if resumed.")
    replayed_model_calls: int = Field(default=0, ge=0, description="Model calls answered from the journal.")
    reason: str | None = Field(default=None, description="Why it started fresh, if it did.")


class RolloutRecord(_Frozen, _VersionGate):
    """One line of ``rollouts.jsonl``: one finished attempt, as the controller saw it."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(description="Id of this attempt (derived from task id, sample and try).")
    task_id: str = Field(description="Dataset row id.")
    sample: int = Field(ge=0, description="Which of the --attempts samples of the task (for pass@k).")
    try_index: int = Field(ge=0, description="Infrastructure retry number of this sample.")
    outcome: Outcome = Field(description="The supervisor's classification.")
    graded: bool = Field(description="Whether the outcome allowed grading.")
    reward: float | None = Field(description="The grade; None when not graded.")
    masked: bool = Field(
        default=False,
        description="The environment asked to leave this sample out (NeMo Gym's mask_sample): its reward is "
        "kept as evidence but excluded from reward metrics and pass@k; train on it at your own risk.",
    )
    failure_kind: str | None = Field(
        default=None, description="The environment's label for why the sample failed (verify's failure_kind)."
    )
    grader: dict[str, Any] | None = Field(default=None, description="Grader name and detail.")
    termination_reason: TerminationReason | None = Field(default=None, description="From the result.")
    receipt: SupervisorReceipt = Field(description="The supervisor's receipt.")
    metrics: RolloutMetrics = Field(default_factory=RolloutMetrics, description="Token and timing metrics.")
    health: RolloutHealth = Field(description="Health checks, computed once when the attempt ended.")
    rollout_dir: str = Field(description="Path of the rollout directory.")
    resume: ResumeLink | None = Field(
        default=None, description="Set when the attempt was asked to continue an earlier one."
    )

    _result: WorkerResult | None = PrivateAttr(default=None)

    def result(self, run_dir: str | os.PathLike[str] | None = None) -> WorkerResult | None:
        """The attempt's ``WorkerResult``: its trajectory, turns and token data.

        The one the supervisor parsed when the attempt ended, when this process ran
        it (``rollcage.collect`` yields such records); else ``result.json`` read once
        (blocking, a regular file only) and kept. ``None`` when there is no valid one.

        Args:
            run_dir: For a record read back from a run's ``rollouts.jsonl``: that run's
                directory. The result is then read from the run's own
                ``rollouts/<rollout_id>/``, never from ``rollout_dir``, which a moved,
                copied or edited run makes wrong (``rollcage.runfiles``). ``None``:
                the record was made by this process, and ``rollout_dir`` is where it
                laid the attempt out.
        """
        if self._result is None and self.receipt.result_valid:
            if run_dir is None:
                directory = self.rollout_dir
            elif self.rollout_id in ("", ".", "..") or "/" in self.rollout_id or "\0" in self.rollout_id:
                return None  # not one file name: it cannot be a directory of the run
            else:
                directory = os.path.join(run_dir, "rollouts", self.rollout_id)
            # A regular file only, opened without blocking (durable.open_regular's rule; this module sits
            # below durable): a FIFO in its place must not hang the caller.
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            try:
                with os.fdopen(os.open(os.path.join(directory, "result.json"), flags), "rb") as file:
                    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                        return None
                    self._result = WorkerResult.model_validate_json(file.read())
            except (OSError, ValueError):
                return None
        return self._result

    def with_result(self, result: WorkerResult | None) -> RolloutRecord:
        """This record, holding ``result`` in memory for ``result()`` (nothing is written)."""
        self._result = result
        return self

    def __eq__(self, other: object) -> bool:
        """Records are equal when their fields are; a result held in memory does not count."""
        if not isinstance(other, RolloutRecord):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # fields hold dicts and lists: a record is not hashable


class HealthFinding(_Model):
    """One named health check over a run; names are stable so dashboards can key on them."""

    count: int = Field(ge=0, description="Findings: rollouts, calls or turns affected, per the check.")
    rollouts: list[str] = Field(
        default_factory=list, description="Affected rollout ids (task ids for task checks; first 100)."
    )
    detail: str = Field(default="", description="What the check looks for.")
    evaluated: int = Field(default=0, ge=0, description="Rollouts (or tasks) on which the check could run.")
    unobserved: int = Field(
        default=0, ge=0, description="Rollouts (or tasks) on which it could not, for want of evidence."
    )
    missing: dict[str, int] = Field(
        default_factory=dict, description="Why it could not: the missing evidence, and how often (first 20)."
    )


class Percentiles(_Model):
    """Distribution summary; ``None`` when there was nothing to measure."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


class RunMetrics(_Model, _VersionGate):
    """``metrics.json``: the summary of a run, rewritten atomically as the run progresses."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    dataset: str = Field(description="Path of the dataset.")
    tasks: int = Field(ge=0, description="Distinct task ids with at least one finished attempt.")
    rollouts: int = Field(ge=0, description="Finished attempts (records in rollouts.jsonl).")
    outcomes: dict[Outcome, int] = Field(
        description="Records per outcome (every outcome present, 0 if none)."
    )
    graded: int = Field(
        ge=0, description="Records that were graded and not masked (the reward metrics' base)."
    )
    masked: int = Field(default=0, ge=0, description="Graded records the environment masked (mask_sample).")
    failure_kinds: dict[str, int] = Field(
        default_factory=dict, description="Records per failure_kind the environment reported."
    )
    mean_reward: float | None = Field(description="Mean reward over graded records; None if none graded.")
    pass_at_1: float | None = Field(description="Mean over tasks of the fraction of samples that passed.")
    pass_at_k: float | None = Field(description="Unbiased pass@k over tasks, k = samples per task.")
    k: int = Field(ge=1, description="Samples per task (--attempts).")
    retries: int = Field(ge=0, description="Infrastructure retries made.")
    resumed_rollouts: int = Field(
        default=0, ge=0, description="Attempts that continued an earlier attempt from its journal."
    )
    model_calls_saved: int = Field(
        default=0, ge=0, description="Model calls resumed attempts answered from journals instead of sending."
    )
    invalid_rows: int = Field(default=0, ge=0, description="Dataset rows rejected as malformed.")
    tokens: TokenUsage = Field(default_factory=TokenUsage, description="Summed reported tokens.")
    tokens_partial: int = Field(
        default=0,
        ge=0,
        description="Rollouts whose token sums are partial or unobserved (RolloutMetrics.token_counts), so "
        "tokens undercounts by them.",
    )
    duration_s: Percentiles = Field(default_factory=Percentiles, description="Per-rollout wall time.")
    cpu_s: Percentiles = Field(
        default_factory=Percentiles,
        description="Per-rollout CPU time of the sandbox, over the rollouts where it was measured.",
    )
    peak_memory_bytes: Percentiles = Field(
        default_factory=Percentiles,
        description="Per-rollout peak memory of the sandbox, over the rollouts where it was measured.",
    )
    usage_mechanisms: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Rollouts per 'cpu:MECHANISM' and 'memory:MECHANISM' (cgroup2, cgroup1 or none): how cpu_s and "
            "peak_memory_bytes were measured (see RolloutUsage)."
        ),
    )
    wall_s: float = Field(default=0.0, description="Wall time of the run so far.")
    health: dict[str, HealthFinding] = Field(
        default_factory=dict, description="Health checks by stable name (NeMo Gym's where it has one)."
    )
    health_verdicts: dict[HealthVerdict, int] = Field(
        default_factory=dict, description="Rollouts per health verdict."
    )


def artifact_models() -> dict[str, type[BaseModel]]:
    """The artifact models by the name ``rollcage schema NAME`` uses."""
    return {
        "WorkerInput": WorkerInput,
        "WorkerResult": WorkerResult,
        "BoundaryRecord": BoundaryRecord,
        "Checkpoint": Checkpoint,
        "SupervisorReceipt": SupervisorReceipt,
        "CaptureExchange": CaptureExchange,
        "RolloutRecord": RolloutRecord,
        "RunMetrics": RunMetrics,
    }
