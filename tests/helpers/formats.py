"""Other projects' trajectory formats, restated in our words as pydantic models, to validate exports against.

* ATIF v1.7, the Agent Trajectory Interchange Format of Harbor (RFC 0001,
  ``harbor.models.trajectories``), which NOOA and NeMo Gym also write: every model
  forbids unknown fields; steps are numbered from 1; agent-only fields appear on
  agent steps only; an observation result names a tool call of its own step;
  ``llm_call_count == 0`` forbids metrics and reasoning.
* NeMo Gym's canonical trajectory record (``ng_trajectory``, schema 1.0,
  ``nemo_gym.rollout_observability``): invocations, turns, model calls, tool calls and
  gaps, with unique model-call ids and turn identity matching the record's.
* NeMo Gym's training items (``nemo_gym.openai_utils``): token arrays on an item come
  all together (``prompt_token_ids``, ``generation_token_ids``, ``generation_log_probs``).
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "AtifTrajectory",
    "NgTrajectoryRecord",
    "check_training_items",
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --------------------------------------------------------------------------- ATIF v1.7


class AtifToolCall(_Strict):
    tool_call_id: str
    function_name: str
    arguments: dict[str, Any]
    extra: dict[str, Any] | None = None


class AtifObservationResult(_Strict):
    source_call_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    subagent_trajectory_ref: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class AtifObservation(_Strict):
    results: list[AtifObservationResult]


class AtifMetrics(_Strict):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cost_usd: float | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    extra: dict[str, Any] | None = None


class AtifStep(_Strict):
    step_id: int = Field(ge=1)
    timestamp: str | None = None
    source: Literal["system", "user", "agent"]
    model_name: str | None = None
    reasoning_effort: str | float | None = None
    message: str | list[dict[str, Any]]
    reasoning_content: str | None = None
    tool_calls: list[AtifToolCall] | None = None
    observation: AtifObservation | None = None
    metrics: AtifMetrics | None = None
    is_copied_context: bool | None = None
    llm_call_count: int | None = Field(default=None, ge=0)
    extra: dict[str, Any] | None = None

    @field_validator("timestamp")
    @classmethod
    def _iso_8601(cls, value: str | None) -> str | None:
        if value is not None:
            datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        return value

    @model_validator(mode="after")
    def _agent_only(self) -> AtifStep:
        if self.source != "agent":
            for name in ("model_name", "reasoning_effort", "reasoning_content", "tool_calls", "metrics"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is only for agent steps")
        if self.source == "agent" and self.llm_call_count == 0 and (self.metrics or self.reasoning_content):
            raise ValueError("a deterministic (llm_call_count 0) step has no metrics or reasoning")
        if self.observation is not None:
            ids = {call.tool_call_id for call in self.tool_calls or []}
            for result in self.observation.results:
                if result.source_call_id is not None and result.source_call_id not in ids:
                    raise ValueError(f"observation names {result.source_call_id!r}, no tool call of its step")
        return self


class AtifAgent(_Strict):
    name: str
    version: str
    model_name: str | None = None
    tool_definitions: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class AtifFinalMetrics(_Strict):
    total_prompt_tokens: int | None = None
    total_completion_tokens: int | None = None
    total_cached_tokens: int | None = None
    total_cost_usd: float | None = None
    total_steps: int | None = Field(default=None, ge=0)
    extra: dict[str, Any] | None = None


class AtifTrajectory(_Strict):
    schema_version: Literal["ATIF-v1.7"]
    session_id: str | None = None
    trajectory_id: str | None = None
    agent: AtifAgent
    steps: list[AtifStep] = Field(min_length=1)
    notes: str | None = None
    final_metrics: AtifFinalMetrics | None = None
    continued_trajectory_ref: str | None = None
    extra: dict[str, Any] | None = None
    subagent_trajectories: list[AtifTrajectory] | None = None

    @model_validator(mode="after")
    def _sequential(self) -> AtifTrajectory:
        for position, step in enumerate(self.steps, start=1):
            if step.step_id != position:
                raise ValueError(f"steps[{position - 1}].step_id is {step.step_id}, not {position}")
        return self


# --------------------------------------------------------------------------- NeMo Gym's ng_trajectory


class NgModelCallRef(_Strict):
    model_call_id: str | None = None
    model_ref: dict[str, Any] | None = None
    response_id: str | None = None

    @model_validator(mode="after")
    def _joinable(self) -> NgModelCallRef:
        if not self.model_call_id and not (self.model_ref is not None and self.response_id):
            raise ValueError("model_call_id or both model_ref and response_id are required")
        return self


class NgTokenStats(_Strict):
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    reasoning_tokens: int | None = Field(default=None, ge=0)
    total_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)


class NgResponseMetadata(_Strict):
    response_id: str | None = None
    model_ref: dict[str, Any] | None = None
    model: str | None = None
    dialect: str | None = None
    status_code: int | None = None
    response_status: str | None = None
    finish_reason: str | None = None
    error_category: str | None = None
    latency_ttft_ms: float | None = Field(default=None, ge=0)


class NgModelCall(_Strict):
    model_call_id: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    request: Any = None
    response: Any = None
    response_metadata: NgResponseMetadata = Field(default_factory=NgResponseMetadata)
    token_stats: NgTokenStats = Field(default_factory=NgTokenStats)


class NgTurn(_Strict):
    invocation_id: str
    task_id: str
    rollout_id: str
    turn_no: int = Field(ge=1)
    timestamp: float
    question: Any = None
    answer: Any = None
    reasoning_content: Any = None
    resolved: bool | None = None
    step_count: int = Field(ge=0)
    model_calls: list[NgModelCallRef] = Field(default_factory=list)


class NgInvocation(_Strict):
    kind: Literal["agent_invocation"] = "agent_invocation"
    invocation_id: str
    parent_invocation_id: str | None = None
    spawned_by_tool_call_id: str | None = None
    status: Literal["completed", "failed", "incomplete", "unknown"] = "unknown"
    duration_ms: float | None = Field(default=None, ge=0)
    error_type: str | None = None
    model_calls: list[NgModelCallRef] = Field(default_factory=list)
    conversation: list[dict[str, Any]] = Field(default_factory=list)


class NgToolCall(_Strict):
    kind: Literal["tool_call"] = "tool_call"
    invocation_id: str
    tool_call_id: str
    sandbox_id: str | None = None
    tool_name: str | None = None
    started_at: float | None = None
    completed_at: float | None = None
    duration_ms: float | None = Field(default=None, ge=0)
    timing_source: Literal["executor", "artifact", "harness"] | None = None
    status: Literal["completed", "failed", "timeout", "cancelled", "incomplete", "unknown"] = "unknown"
    error_type: str | None = None
    output: Any = None

    @model_validator(mode="after")
    def _ordered(self) -> NgToolCall:
        if (
            self.started_at is not None
            and self.completed_at is not None
            and self.completed_at < self.started_at
        ):
            raise ValueError("completed_at must not precede started_at")
        return self


class NgGap(_Strict):
    code: str
    invocation_id: str | None = None
    detail: str | None = None


class NgTrajectoryRecord(_Strict):
    schema_version: Literal["1.0"] = "1.0"
    task_id: str
    rollout_id: str
    invocations: list[NgInvocation] = Field(default_factory=list)
    turns: list[NgTurn] = Field(default_factory=list)
    model_calls: list[NgModelCall] = Field(default_factory=list)
    tool_calls: list[NgToolCall] = Field(default_factory=list)
    gaps: list[NgGap] = Field(default_factory=list)

    @model_validator(mode="after")
    def _identity(self) -> NgTrajectoryRecord:
        ids = [call.model_call_id for call in self.model_calls if call.model_call_id]
        if len(ids) != len(set(ids)):
            raise ValueError("model_call_id must be unique within a trajectory")
        seen: set[tuple[str, int]] = set()
        for turn in self.turns:
            if (turn.task_id, turn.rollout_id) != (self.task_id, self.rollout_id):
                raise ValueError("turn identity must match the trajectory")
            if (turn.invocation_id, turn.turn_no) in seen:
                raise ValueError("turn number must be unique within an invocation")
            seen.add((turn.invocation_id, turn.turn_no))
        return self


# --------------------------------------------------------------------------- NeMo Gym's training items

_TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


def check_training_items(output: list[dict[str, Any]]) -> int:
    """Check token arrays on response items as NeMo Gym does; return how many items carry them."""
    carrying = 0
    for item in output:
        present = [name for name in _TOKEN_FIELDS if name in item]
        if not present:
            continue
        if len(present) != len(_TOKEN_FIELDS):
            raise ValueError(f"token metadata must include all of {_TOKEN_FIELDS}; has {present}")
        ids, probs = item["generation_token_ids"], item["generation_log_probs"]
        if not all(isinstance(t, int) for t in [*item["prompt_token_ids"], *ids]):
            raise ValueError("token ids must be integers")
        if not all(isinstance(p, float) for p in probs) or len(ids) != len(probs):
            raise ValueError("one float log probability per generated token")
        carrying += 1
    return carrying
