"""One exception hierarchy for everything rollcage raises.

The split that matters most is *whose fault* a failure is, and it is the type
that says so: an :class:`InfrastructureError` is the machinery's (the endpoint,
the disk, the sandbox, the cluster: worth retrying the rollout, never trained
on); a :class:`PolicyError` is the policy's own doing (final, and part of what is
trained on); a :class:`ConfigError` is the user's input. ``isinstance`` answers
the question everywhere, and :attr:`RollcageError.kind` is the word the worker
publishes as ``RunnerError.kind`` (``transient`` for the infrastructure's,
``fatal`` for anything final)::

    RollcageError                                    anything raised on purpose             [fatal]
    ├── InfrastructureError                          the machinery failed: retry, never train [transient]
    │   ├── DurableWriteError (OSError)              publishing or appending to disk failed
    │   ├── TransientModelError (ModelError)         connection, timeout, 408/409/429/5xx,
    │   │   │                                        a malformed/truncated body, 401/403/404
    │   │   ├── ModelTimeoutError (TimeoutError)     no answer within the deadline
    │   │   └── ModelEndpointNotFoundError           404: no such endpoint or model; stops the run
    │   ├── ResourceUnavailableError (ToolError)     a resource endpoint cannot be reached
    │   ├── SandboxError                             bubblewrap missing or failing
    │   ├── SupervisorError                          the supervisor could not do its job
    │   ├── RunFailedError                           the controller itself failed mid-run
    │   ├── BranchReplayError                        a branch's prefix could not be replayed exactly
    │   ├── HarnessUnavailableError                  a harness could not be started or installed
    │   ├── ImagePullError                           a registry unreachable, refusing, or failing
    │   ├── RayTaskLostError                         a Ray task ended without a record
    │   │   └── RayTaskOverdueError (TimeoutError)   it did not start or return in time
    │   └── ArtifactsTooLargeError                   a rollout dir too large to ship to the driver
    ├── PolicyError                                  the policy's own doing: final           [fatal]
    │   ├── FatalModelError (ModelError)             a request the server rejects: 400/422, context length
    │   └── HarnessError                             a nooa/command harness failed, or ended without an answer
    ├── ConfigError (ValueError)                     bad input, dataset row, config, CLI use [fatal]
    │   ├── ControllerOnlyFieldError                 controller state aimed at the sandbox
    │   ├── ViewerError                              show/report given a path that is no rollout
    │   ├── ImageReferenceError                      an image reference that cannot be parsed
    │   └── ImageRefusedError                        an image that is unsafe, corrupt or too large
    ├── JournalCorruptError (ValueError)             a checkpoint journal is damaged mid-file [fatal]
    ├── HeaderValueError (ValueError)                a value cannot be sent in an HTTP header [fatal]
    ├── ResumeRefusedError                           an earlier journal cannot be resumed: start fresh [fatal]
    ├── ModelError                                   the model endpoint (both kinds above)
    └── ToolError                                    a tool or the Python executor          [fatal]
        └── ExecutorError                            the executor died or cannot start

Whether a ``fatal`` error makes a rollout the policy's ``agent_error`` or an
``infra_failure`` is the supervisor's call (``rollcage.supervisor.classify_outcome``):
before any model response, nothing the policy did can be at fault.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from rollcage.protocol import ModelCall

__all__ = [
    "ArtifactsTooLargeError",
    "BranchReplayError",
    "ConfigError",
    "ControllerOnlyFieldError",
    "DurableWriteError",
    "ErrorKind",
    "ExecutorError",
    "FatalModelError",
    "HarnessError",
    "HarnessUnavailableError",
    "HeaderValueError",
    "ImagePullError",
    "ImageReferenceError",
    "ImageRefusedError",
    "InfrastructureError",
    "JournalCorruptError",
    "ModelEndpointNotFoundError",
    "ModelError",
    "ModelTimeoutError",
    "PolicyError",
    "RayTaskLostError",
    "RayTaskOverdueError",
    "ResourceUnavailableError",
    "ResumeRefusedError",
    "RollcageError",
    "RunFailedError",
    "SandboxError",
    "SupervisorError",
    "ToolError",
    "TransientModelError",
    "ViewerError",
]

ErrorKind = Literal["transient", "fatal", "cancelled"]
"""How a rollout's run ended in error, as ``RunnerError.kind`` publishes it: ``transient``, the
infrastructure's fault (retry it); ``fatal``, final; ``cancelled``, stopped from outside."""


class RollcageError(Exception):
    """Root of every error rollcage raises on purpose."""

    kind: ClassVar[Literal["transient", "fatal"]] = "fatal"
    """What ``RunnerError.kind`` publishes. Set here and on :class:`InfrastructureError` only: it
    follows from the type (``transient`` exactly for the infrastructure's errors)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in vars(cls) and cls.__name__ != "InfrastructureError":
            raise TypeError(f"{cls.__name__}: kind follows the type; derive from InfrastructureError instead")


class InfrastructureError(RollcageError):
    """The machinery failed, not the policy: retry the rollout, never train on it."""

    kind: ClassVar[Literal["transient", "fatal"]] = "transient"


class PolicyError(RollcageError):
    """The policy's own doing (what it asked for, what its code did): final, and trained on."""


class ConfigError(RollcageError, ValueError):
    """An input file, dataset row, config value or command line is wrong; the message says where."""


class ControllerOnlyFieldError(ConfigError):
    """Controller-only state (reference answers, rewards, credentials) was aimed at the sandbox."""


class ViewerError(ConfigError):
    """A path given to ``show`` or ``report`` is missing or is not a rollout or run artifact."""


class DurableWriteError(InfrastructureError, OSError):
    """Writing an artifact to disk failed (disk full, EIO, permissions); nothing was half-published."""


class JournalCorruptError(RollcageError, ValueError):
    """A checkpoint journal has a damaged line that is not its torn last line."""


class HeaderValueError(RollcageError, ValueError):
    """A value someone else supplied (a cookie, an id, a credential) cannot be sent in an HTTP header.

    Raised by :mod:`rollcage.headers` before any HTTP library sees the value; whoever meets it
    says whose fault it is (an environment's cookie: the environment's, as infrastructure).
    """


class ResumeRefusedError(RollcageError):
    """An earlier attempt's journal cannot be continued (unusable, inconsistent, or its replay diverged).

    Never ends a rollout: whoever meets it starts the rollout fresh and records the message.
    """


class ModelError(RollcageError):
    """The model endpoint failed to give a usable answer: a ``TransientModelError`` or ``FatalModelError``."""

    record: ModelCall | None = None
    """The failed call (status ``failed``, attempts counted), so it can be recorded; set by the client."""


class TransientModelError(ModelError, InfrastructureError):
    """The endpoint is unreachable, overloaded or broken: retry the rollout, never train on it."""


class ModelTimeoutError(TransientModelError, TimeoutError):
    """The endpoint gave no (complete) answer within the configured deadline."""


class ModelEndpointNotFoundError(TransientModelError):
    """The endpoint answered 404 (or a not-found error): no such route or model where the configuration says.

    Infrastructure, so never graded as the policy's; and final, as NOOA treats it: every
    attempt would meet the same answer, so the controller stops the run at the first one
    (completed rollouts kept) instead of retrying it as infrastructure.
    """


class FatalModelError(ModelError, PolicyError):
    """The request itself is wrong (400, 422, context length): retrying cannot help, and it is the policy's.

    Credentials (401, 403) and a missing endpoint or model (404: ``ModelEndpointNotFoundError``) are not:
    those are ``TransientModelError``.
    """


class HarnessError(PolicyError):
    """A harness (nooa, command) ran and failed, or exited without a final answer.

    The policy's: the harness is the agent's own program, driven by the policy's answers, so a
    crash or a missing answer once it runs is the agent failing, as the builtin loop ending
    without an answer is (a harness that failed right after the model endpoint did raises
    ``TransientModelError`` instead, and one that cannot even start raises
    :class:`HarnessUnavailableError`). Before any model response nothing the policy did can be
    at fault, so the supervisor still classifies such a rollout ``infra_failure``.
    """


class HarnessUnavailableError(InfrastructureError):
    """A harness could not be started or installed (its interpreter missing or not executable, pip failed).

    The machine's, not the policy's: no model call was made through it, so the rollout is retried.
    """


class ToolError(RollcageError):
    """A tool call failed in a way the agent loop must know about."""


class ExecutorError(ToolError):
    """The Python executor could not start, or died and could not be restarted."""


class ResourceUnavailableError(ToolError, InfrastructureError):
    """A resource endpoint could not be reached at all: infrastructure, not the agent."""


class SandboxError(InfrastructureError):
    """The sandbox could not be set up (bubblewrap missing, namespaces refused)."""


class SupervisorError(InfrastructureError):
    """The supervisor could not start or watch the worker."""


class RayTaskLostError(InfrastructureError):
    """The Ray task running a rollout ended without a record (it is recorded as ``infra_failure``)."""


class RayTaskOverdueError(RayTaskLostError, TimeoutError):
    """A Ray task did not start, or did not return, within its bound; it was killed."""


class ArtifactsTooLargeError(InfrastructureError):
    """A rollout directory holds more than the limit for shipping it to the driver."""


class BranchReplayError(InfrastructureError):
    """A branch's prefix could not be replayed from its source's journal exactly (``rollcage.branch``).

    The branch ends as ``infra_failure`` with the reason, never as a silent fresh start: what the
    model saw would no longer be the source's prefix.
    """


class RunFailedError(InfrastructureError):
    """A run stopped because the controller itself failed (``rollouts.jsonl`` could not be written).

    The records written before are intact; fix the cause and run again to resume.
    """


class ImageReferenceError(ConfigError):
    """An image reference (``docker://…``, ``oci:…``, ``docker-archive:…``, ``dir:…``) is malformed.

    The message names the part that is wrong.
    """


class ImageRefusedError(ConfigError):
    """An image is refused: a digest that does not match, a layer that escapes its root, a device node,
    more bytes than the store's limit, a manifest that cannot be read. Nothing of it is used.
    """


class ImagePullError(InfrastructureError):
    """A registry could not be reached, refused the credentials, or failed (5xx); a later pull resumes."""
