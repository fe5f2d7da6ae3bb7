"""The typed artifacts: every file a rollout or a run leaves, and the input that enters the sandbox.

These are the shapes that cross a process boundary *as files other programs read*:
``input.json`` (:mod:`._input`), ``result.json`` (:mod:`._result`), ``checkpoint.jsonl``
(:mod:`._checkpoint`), ``receipt.json`` (:mod:`._receipt`), ``model_capture.jsonl``
(:mod:`._capture`), ``records.jsonl`` and ``metrics.json`` (:mod:`._records`), with the
trajectory they share (:mod:`._trajectory`). ``rollcage schema`` prints each one's JSON
Schema, and the version they share is :data:`SCHEMA_VERSION`.

Every model forbids unknown fields, so a typo or a smuggled field is an error at
the boundary rather than silently ignored state. Nothing the worker writes has a
reward or grade field: grading happens outside the sandbox, on the controller's
side, and only ``RolloutRecord`` carries a reward.

Response items (``message``, ``function_call``, ``function_call_output``,
``reasoning``) are kept as plain JSON objects shaped like the OpenAI Responses
API, because they are carried through verbatim rather than interpreted.

Not here: the private conversations between two of rollcage's own processes, which
no other program reads and no file keeps. Each lives with the two ends that speak it:

* supervisor → warm template: :class:`rollcage.warm.WarmRequest` (JSON, descriptors
  beside it) and the template's byte replies (:mod:`rollcage.warm`,
  :mod:`rollcage.supervisor.warm`);
* worker → executor template: the fork requests and replies of
  :mod:`rollcage.tools._forked` and :mod:`rollcage.tools._executor_template`;
* worker ↔ Python executor child: the framed ``init``/``run``/``tool_result`` and
  ``ready``/``done``/``tool_call`` messages of :mod:`rollcage.tools._repl` and
  :mod:`rollcage.tools._repl_child`;
* worker → file editor child: one JSON request and reply (:mod:`rollcage.tools._editor`,
  :mod:`rollcage.tools._editor_child`);
* harness → worker → supervisor: a harness's events and the boundaries the worker relays
  (:mod:`rollcage.harness._events`; what they carry is a :class:`BoundaryRecord`).
"""

from rollcage.errors import ErrorKind
from rollcage.protocol._base import (
    MAX_JSON_DEPTH,
    MAX_TOKEN_COUNT,
    MAX_TOKEN_ID,
    SCHEMA_VERSION,
    Outcome,
    ResponseItem,
    RunnerError,
    TerminationReason,
)
from rollcage.protocol._capture import CapturedBody, CapturedMessage, CaptureExchange
from rollcage.protocol._checkpoint import BoundaryRecord, Checkpoint, DeltaField, ListDelta
from rollcage.protocol._input import (
    MAX_INPUT_BYTES,
    RESERVED_REQUEST_FIELDS,
    AgentSettings,
    BashToolSpec,
    BuiltinHarness,
    CheckpointSettings,
    CommandHarness,
    EditorToolSpec,
    ExecutorSettings,
    FunctionToolChoice,
    HarnessEnvironment,
    HarnessSpec,
    ImageSandbox,
    ModelEndpoint,
    NooaHarness,
    PythonToolSpec,
    ResourceEndpoint,
    ResourceToolSpec,
    ResumeRequest,
    SamplingParams,
    ToolSpec,
    WorkerInput,
    describe_validation_error,
    json_problem,
)
from rollcage.protocol._receipt import (
    BudgetMechanism,
    BudgetName,
    BudgetUse,
    RolloutUsage,
    SignalEvent,
    SupervisorReceipt,
)
from rollcage.protocol._records import (
    BranchLink,
    FileSeal,
    HealthFinding,
    HealthVerdict,
    Percentiles,
    ResumeLink,
    RolloutHealth,
    RolloutMetrics,
    RolloutRecord,
    RunMetrics,
)
from rollcage.protocol._result import ResponseOutput, WorkerResult
from rollcage.protocol._schemas import artifact_models
from rollcage.protocol._trajectory import (
    ATTEMPT_BODY_BYTES,
    CallAttempt,
    CallTokens,
    ModelCall,
    ResumedFrom,
    TokenCoverage,
    TokenField,
    TokenUsage,
    ToolCall,
    ToolStatus,
    Trajectory,
    Turn,
    TurnResolution,
    TurnStart,
    kept_body,
)

__all__ = [
    "ATTEMPT_BODY_BYTES",
    "MAX_INPUT_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_TOKEN_COUNT",
    "MAX_TOKEN_ID",
    "RESERVED_REQUEST_FIELDS",
    "SCHEMA_VERSION",
    "AgentSettings",
    "BashToolSpec",
    "BoundaryRecord",
    "BranchLink",
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
    "FileSeal",
    "FunctionToolChoice",
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
    "kept_body",
]
