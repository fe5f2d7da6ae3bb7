"""``result.json`` (:class:`WorkerResult`): what the worker publishes once, at the end. No reward, ever."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollcage.protocol._base import (
    SCHEMA_VERSION,
    ArtifactModel,
    FrozenArtifact,
    ResponseItem,
    RunnerError,
    TerminationReason,
    VersionGate,
)
from rollcage.protocol._trajectory import TokenUsage, Trajectory

__all__ = ["ResponseOutput", "WorkerResult"]


class ResponseOutput(ArtifactModel):
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


class WorkerResult(FrozenArtifact, VersionGate):
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
