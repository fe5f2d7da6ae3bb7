"""What every artifact shares: the schema version, the bounds on numbers and JSON, the outcome words, and
the model bases (unknown fields are an error; frozen where a value is published; versioned where a file
is read back by another rollcage)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollcage.errors import ErrorKind

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_TOKEN_COUNT",
    "MAX_TOKEN_ID",
    "SCHEMA_VERSION",
    "ArtifactModel",
    "FrozenArtifact",
    "Outcome",
    "ResponseItem",
    "RunnerError",
    "TerminationReason",
    "VersionGate",
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

Outcome = Literal["completed", "agent_error", "timeout", "cancelled", "infra_failure"]
"""How one attempt ended, as classified by the supervisor (see docs/reference/outcomes.md)."""

TerminationReason = Literal[
    "completed", "max_policy_calls", "max_tool_calls", "invalid_policy_output", "cancelled", "error"
]
"""Why the agent loop stopped."""

ResponseItem = dict[str, Any]
"""One Responses-API item (``message``, ``function_call``, ``function_call_output``, ``reasoning``)."""


class ArtifactModel(BaseModel):
    """Base of every artifact: unknown fields are an error."""

    # Infinity and NaN are not numbers any artifact means: a timeout of Infinity never fires.
    model_config = ConfigDict(extra="forbid", defer_build=True, allow_inf_nan=False)


class FrozenArtifact(ArtifactModel):
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


class VersionGate(BaseModel):
    """Mixin of the versioned artifacts: another ``schema_version`` is refused by name, first."""

    # The same settings as ArtifactModel: deferred, or importing the protocol would build (and pay for) it.
    model_config = ConfigDict(extra="forbid", defer_build=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _same_version(cls, data: Any) -> Any:
        return _check_version(data, cls.__name__)


class RunnerError(FrozenArtifact):
    """Why a rollout did not complete normally."""

    kind: ErrorKind = Field(description="transient: infrastructure; fatal: final; cancelled: stopped.")
    type: str = Field(description="The exception class name, e.g. 'TransientModelError'.")
    message: str = Field(description="What happened, in words a user can act on.")
