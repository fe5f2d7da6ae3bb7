"""One exception hierarchy for everything rollcage raises.

The split that matters most is *whose fault* a failure is: the infrastructure's
(worth retrying the rollout, never trained on) or the request's/agent's (final).
Every error carries a ``kind`` that says which, so the worker can publish it as
``RunnerError.kind`` without guessing::

    RollcageError
    ├── ConfigError (ValueError)                 bad input, dataset row, config, CLI use   [fatal]
    │   ├── ControllerOnlyFieldError             controller state aimed at the sandbox      [fatal]
    │   └── ViewerError                          show/report given a path that is no rollout [fatal]
    ├── DurableWriteError (OSError)              publishing or appending to disk failed     [transient]
    ├── JournalCorruptError (ValueError)         a checkpoint journal is damaged mid-file   [fatal]
    ├── ResumeRefusedError                       a journal cannot be resumed from: start fresh [fatal]
    ├── ModelError                               the model endpoint                         [see below]
    │   ├── TransientModelError                  connection, timeout, 408/409/429/5xx,      [transient]
    │   │                                        a malformed/truncated body, 401/403/404
    │   │   └── ModelTimeoutError (TimeoutError) no answer within the deadline              [transient]
    │   └── FatalModelError                      a request the server rejects: 400/422,     [fatal]
    │                                            context length
    ├── ToolError                                a tool or the Python executor              [fatal]
    │   ├── ToolTimeoutError (TimeoutError)      a call ran past its timeout                [fatal]
    │   ├── ExecutorError                        the executor died or cannot start          [fatal]
    │   └── ResourceUnavailableError             a resource endpoint cannot be reached      [transient]
    ├── SandboxError                             bubblewrap missing or failing              [transient]
    ├── SupervisorError                          the supervisor could not do its job        [transient]
    ├── RunFailedError                           the controller itself failed mid-run       [transient]
    ├── RayTaskLostError                         a Ray task ended without a record          [transient]
    │   └── RayTaskOverdueError (TimeoutError)   it did not start or return in time         [transient]
    └── ArtifactsTooLargeError                   a rollout dir too large to ship to the driver [transient]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from rollcage.protocol import ModelCall

__all__ = [
    "ArtifactsTooLargeError",
    "ConfigError",
    "ControllerOnlyFieldError",
    "DurableWriteError",
    "ErrorKind",
    "ExecutorError",
    "FatalModelError",
    "JournalCorruptError",
    "ModelError",
    "ModelTimeoutError",
    "RayTaskLostError",
    "RayTaskOverdueError",
    "ResourceUnavailableError",
    "ResumeRefusedError",
    "RollcageError",
    "RunFailedError",
    "SandboxError",
    "SupervisorError",
    "ToolError",
    "ToolTimeoutError",
    "TransientModelError",
    "ViewerError",
]

ErrorKind = Literal["transient", "fatal"]
"""Whose fault a failure is: ``transient`` is the infrastructure's, ``fatal`` is final."""


class RollcageError(Exception):
    """Root of every error rollcage raises on purpose."""

    kind: ClassVar[ErrorKind] = "fatal"


class ConfigError(RollcageError, ValueError):
    """An input file, dataset row, config value or command line is wrong; the message says where."""


class ControllerOnlyFieldError(ConfigError):
    """Controller-only state (reference answers, rewards, credentials) was aimed at the sandbox."""


class ViewerError(ConfigError):
    """A path given to ``show`` or ``report`` is missing or is not a rollout or run artifact."""


class DurableWriteError(RollcageError, OSError):
    """Writing an artifact to disk failed (disk full, EIO, permissions); nothing was half-published."""

    kind: ClassVar[ErrorKind] = "transient"


class JournalCorruptError(RollcageError, ValueError):
    """A checkpoint journal has a damaged line that is not its torn last line."""


class ResumeRefusedError(RollcageError):
    """An earlier attempt's journal cannot be continued (unusable, inconsistent, or its replay diverged).

    Never ends a rollout: whoever meets it starts the rollout fresh and records the message.
    """


class ModelError(RollcageError):
    """The model endpoint failed to give a usable answer."""

    record: ModelCall | None = None
    """The failed call (status ``failed``, attempts counted), so it can be recorded; set by the client."""


class TransientModelError(ModelError):
    """The endpoint is unreachable, overloaded or broken: retry the rollout, never train on it."""

    kind: ClassVar[ErrorKind] = "transient"


class ModelTimeoutError(TransientModelError, TimeoutError):
    """The endpoint gave no (complete) answer within the configured deadline."""


class FatalModelError(ModelError):
    """The request itself is wrong (400, 422, context length): retrying cannot help, and it is the policy's.

    Credentials (401, 403) and a missing endpoint or model (404) are not: those are ``TransientModelError``.
    """


class ToolError(RollcageError):
    """A tool call failed in a way the agent loop must know about."""


class ToolTimeoutError(ToolError, TimeoutError):
    """A tool call ran past its timeout and was interrupted."""


class ExecutorError(ToolError):
    """The Python executor could not start, or died and could not be restarted."""


class ResourceUnavailableError(ToolError):
    """A resource endpoint could not be reached at all: infrastructure, not the agent."""

    kind: ClassVar[ErrorKind] = "transient"


class SandboxError(RollcageError):
    """The sandbox could not be set up (bubblewrap missing, namespaces refused)."""

    kind: ClassVar[ErrorKind] = "transient"


class SupervisorError(RollcageError):
    """The supervisor could not start or watch the worker."""

    kind: ClassVar[ErrorKind] = "transient"


class RayTaskLostError(RollcageError):
    """The Ray task running a rollout ended without a record (it is recorded as ``infra_failure``)."""

    kind: ClassVar[ErrorKind] = "transient"


class RayTaskOverdueError(RayTaskLostError, TimeoutError):
    """A Ray task did not start, or did not return, within its bound; it was killed."""


class ArtifactsTooLargeError(RollcageError):
    """A rollout directory holds more than the limit for shipping it to the driver."""

    kind: ClassVar[ErrorKind] = "transient"


class RunFailedError(RollcageError):
    """A run stopped because the controller itself failed (``rollouts.jsonl`` could not be written).

    The records written before are intact; fix the cause and run again to resume.
    """

    kind: ClassVar[ErrorKind] = "transient"
