"""Whose fault a failure is: said by the error's type, published as the same ``kind`` words as ever."""

from __future__ import annotations

import inspect

import pytest

import rollcage.errors as errors
import rollcage.protocol as protocol
from rollcage.errors import (
    ArtifactsTooLargeError,
    BranchReplayError,
    ConfigError,
    ControllerOnlyFieldError,
    DurableWriteError,
    ExecutorError,
    FatalModelError,
    HarnessError,
    HarnessUnavailableError,
    HeaderValueError,
    InfrastructureError,
    JournalCorruptError,
    ModelEndpointNotFoundError,
    ModelTimeoutError,
    PolicyError,
    RayTaskLostError,
    RayTaskOverdueError,
    ResourceUnavailableError,
    ResumeRefusedError,
    RollcageError,
    RunFailedError,
    SandboxError,
    SupervisorError,
    TransientModelError,
    ViewerError,
)

# The published RunnerError.kind of each error, as it was when kind lived in a ClassVar.
PUBLISHED_KIND = {
    ConfigError: "fatal",
    ControllerOnlyFieldError: "fatal",
    ViewerError: "fatal",
    DurableWriteError: "transient",
    JournalCorruptError: "fatal",
    ResumeRefusedError: "fatal",
    TransientModelError: "transient",
    ModelTimeoutError: "transient",
    ModelEndpointNotFoundError: "transient",
    FatalModelError: "fatal",
    ExecutorError: "fatal",
    ResourceUnavailableError: "transient",
    SandboxError: "transient",
    SupervisorError: "transient",
    RayTaskLostError: "transient",
    RayTaskOverdueError: "transient",
    ArtifactsTooLargeError: "transient",
    RunFailedError: "transient",
    BranchReplayError: "transient",
    HarnessError: "fatal",
    HarnessUnavailableError: "transient",
    HeaderValueError: "fatal",
    errors.ImageReferenceError: "fatal",
    errors.ImageRefusedError: "fatal",
    errors.ImagePullError: "transient",
}


def _public_errors() -> list[type[RollcageError]]:
    return [
        cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, RollcageError) and name in errors.__all__
    ]


@pytest.mark.parametrize("cls", list(PUBLISHED_KIND), ids=lambda cls: cls.__name__)
def test_the_published_kind_follows_the_type(cls: type[RollcageError]) -> None:
    error = cls(5, "message") if issubclass(cls, OSError) else cls("message")
    assert error.kind == PUBLISHED_KIND[cls]
    assert isinstance(error, InfrastructureError) == (error.kind == "transient")


def test_every_error_has_its_published_kind_pinned() -> None:
    abstract = {RollcageError, InfrastructureError, PolicyError, errors.ModelError, errors.ToolError}
    assert set(_public_errors()) - abstract == set(PUBLISHED_KIND)


def test_infrastructure_and_policy_faults_are_never_the_same_error() -> None:
    for cls in _public_errors():
        assert not (issubclass(cls, InfrastructureError) and issubclass(cls, PolicyError)), cls
    assert issubclass(FatalModelError, PolicyError) and issubclass(TransientModelError, InfrastructureError)
    # A harness that ran and failed is the agent failing; one that could not start is the machine.
    assert issubclass(HarnessError, PolicyError) and issubclass(HarnessUnavailableError, InfrastructureError)


def test_standard_bases_are_kept_for_callers_that_catch_them() -> None:
    assert issubclass(ModelTimeoutError, TimeoutError) and issubclass(RayTaskOverdueError, TimeoutError)
    assert issubclass(DurableWriteError, OSError) and issubclass(ConfigError, ValueError)


def test_error_kind_is_defined_once() -> None:
    assert protocol.ErrorKind is errors.ErrorKind


def test_the_drawn_tree_names_every_public_error() -> None:
    doc = errors.__doc__ or ""
    assert [cls.__name__ for cls in _public_errors() if cls.__name__ not in doc] == []


def test_a_new_error_cannot_claim_a_kind_its_type_does_not_have() -> None:
    with pytest.raises(TypeError, match="kind follows the type"):

        class _Sneaky(ConfigError):
            kind = "transient"
