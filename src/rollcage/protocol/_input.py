"""``input.json`` (:class:`WorkerInput`): the complete allow-list of what enters the sandbox, with the
endpoint, tools, agent, harness and checkpoint settings it holds, and the checks that refuse
controller-only keys and JSON that cannot be kept."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:
    from pydantic import ValidationError

from rollcage.errors import ControllerOnlyFieldError
from rollcage.protocol._base import MAX_JSON_DEPTH, SCHEMA_VERSION, ArtifactModel, ResponseItem, VersionGate

__all__ = [
    "MAX_INPUT_BYTES",
    "RESERVED_REQUEST_FIELDS",
    "AgentSettings",
    "BashToolSpec",
    "BuiltinHarness",
    "CheckpointSettings",
    "CommandHarness",
    "EditorToolSpec",
    "ExecutorSettings",
    "FunctionToolChoice",
    "HarnessEnvironment",
    "HarnessSpec",
    "ImageSandbox",
    "ModelEndpoint",
    "NooaHarness",
    "PythonToolSpec",
    "ReasoningParams",
    "ResourceEndpoint",
    "ResourceToolSpec",
    "ResumeRequest",
    "SamplingParams",
    "TextFormat",
    "TextParams",
    "ToolSpec",
    "WorkerInput",
    "describe_validation_error",
    "json_problem",
]

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
        "parallel_tool_calls",
        "tool_choice",
        "reasoning",
        "text",
    }
)
"""Request fields rollcage builds itself, never taken from ``SamplingParams.extra_body``: the conversation,
the tools, streaming, the typed sampling settings, and ``n`` (rollcage reads one choice)."""

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

# --------------------------------------------------------------------------- input


class FunctionToolChoice(ArtifactModel):
    """``tool_choice`` naming one function the model must call."""

    type: Literal["function"] = Field(description="Always 'function'.")
    name: str = Field(min_length=1, description="The function the model must call.")


class ReasoningParams(ArtifactModel):
    """The Responses API's ``reasoning`` request field (Chat Completions: ``reasoning_effort``)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        default=None, description="How hard the model reasons; None: the server's default."
    )
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        default=None,
        description="Responses only: which summary of the reasoning to return (Chat Completions servers "
        "return the reasoning as they do, in full where they do).",
    )


class TextFormat(ArtifactModel):
    """The Responses API's ``text.format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"] = Field(description="The kind of output asked for.")
    name: str | None = Field(default=None, min_length=1, description="json_schema: the schema's name.")
    json_schema: dict[str, Any] | None = Field(
        default=None, alias="schema", description="json_schema: the JSON Schema the output follows."
    )
    description: str | None = Field(default=None, description="json_schema: what the output is for.")
    strict: bool | None = Field(default=None, description="json_schema: follow the schema exactly.")

    model_config = ConfigDict(
        extra="forbid", defer_build=True, allow_inf_nan=False, populate_by_name=True, serialize_by_alias=True
    )

    @model_validator(mode="after")
    def _schema_for_json_schema(self) -> TextFormat:
        named = self.name is not None and self.json_schema is not None
        if self.type == "json_schema" and not named:
            raise ValueError("text.format of type json_schema needs its name and schema")
        if self.type != "json_schema" and (self.name, self.json_schema, self.strict) != (None, None, None):
            raise ValueError(f"text.format of type {self.type} takes no name, schema or strict")
        return self


class TextParams(ArtifactModel):
    """The Responses API's ``text`` request field (Chat Completions: ``response_format``, ``verbosity``)."""

    format: TextFormat | None = Field(default=None, description="The output's format; None: text.")
    verbosity: Literal["low", "medium", "high"] | None = Field(
        default=None, description="How long the answer is; None: the server's default."
    )


class SamplingParams(ArtifactModel):
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
    parallel_tool_calls: bool | None = Field(
        default=None,
        description="Whether the model may ask for several tool calls in one answer (sent only with tools); "
        "None: the server's default.",
    )
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoice | None = Field(
        default=None,
        description="Whether the model must, may or must not call a tool, or which function it must call "
        "({'type': 'function', 'name': ...}); None: the server's default (auto).",
    )
    reasoning: ReasoningParams | None = Field(
        default=None,
        description="Reasoning effort and summary (Responses' reasoning; Chat Completions: "
        "reasoning_effort).",
    )
    text: TextParams | None = Field(
        default=None,
        description="Output format and verbosity (Responses' text; Chat Completions: response_format and "
        "verbosity).",
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


class ModelEndpoint(ArtifactModel):
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


class ResourceEndpoint(ArtifactModel):
    """An HTTP resource server the agent's tools call (the NeMo Gym convention: JSON POST per tool)."""

    base_url: str = Field(description="Base URL as seen from inside the sandbox.")
    uds: str | None = Field(default=None, description="Unix socket of the egress proxy; None: direct.")
    timeout_s: float = Field(default=30.0, gt=0, le=_DAY_S, description="Deadline for one tool request.")


class PythonToolSpec(ArtifactModel):
    """The persistent Python executor, offered as a tool (function_calling) or as code blocks (codeact)."""

    type: Literal["python"] = "python"
    name: str = Field(default="python", description="Tool name the model sees.")
    description: str = Field(
        default="Run Python code in a persistent session; returns stdout, stderr and the last value.",
        description="Tool description the model sees.",
    )


class BashToolSpec(ArtifactModel):
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


class EditorToolSpec(ArtifactModel):
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


class ResourceToolSpec(ArtifactModel):
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
    strict: bool | None = Field(
        default=None,
        description="Sent as the function tool's strict (the model's arguments must follow the schema "
        "exactly, on both APIs); None: false, as rollcage sends a tool that does not say.",
    )


ToolSpec = Annotated[
    PythonToolSpec | BashToolSpec | EditorToolSpec | ResourceToolSpec, Field(discriminator="type")
]
"""A tool offered to the agent, tagged by ``type``."""


_ARG_MAX_CHARS = 65_536
_HARNESS_GRACE_S = 3.0


class BuiltinHarness(ArtifactModel):
    """rollcage's own agent loop (:mod:`rollcage.agent`): the default."""

    type: Literal["builtin"] = Field(default="builtin", description="rollcage's own agent loop.")


class NooaHarness(ArtifactModel):
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


class CommandHarness(ArtifactModel):
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


class HarnessEnvironment(ArtifactModel):
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


class ImageSandbox(ArtifactModel):
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


class AgentSettings(ArtifactModel):
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


class ExecutorSettings(ArtifactModel):
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


class CheckpointSettings(ArtifactModel):
    """The append-only checkpoint journal."""

    enabled: bool = Field(default=True, description="Write a boundary record after every model/tool step.")


class ResumeRequest(ArtifactModel):
    """Continue an earlier attempt of this rollout from its journal instead of starting over.

    The journal itself is not in ``input.json``: the controller copies the earlier
    attempt's ``checkpoint.jsonl`` beside the result as ``resume.jsonl`` (worker-only,
    hidden from agent code), and the worker validates it as evidence before using it.
    """

    previous_rollout_id: str = Field(
        min_length=1, max_length=512, description="Id of the attempt whose journal is replayed."
    )
    strict: bool = Field(
        default=False,
        description="A branch (rollcage.branch): a journal that cannot be replayed, or a replay that "
        "diverges, ends the rollout as an infrastructure failure with the reason instead of a fresh start.",
    )


class WorkerInput(ArtifactModel, VersionGate):
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
