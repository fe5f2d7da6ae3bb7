"""``checkpoint.jsonl``: one :class:`BoundaryRecord` a line, and the :class:`Checkpoint` a journal folds
into (``rollcage.load_checkpoint``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rollcage.protocol._base import ArtifactModel, ResponseItem
from rollcage.protocol._trajectory import ModelCall, ResumedFrom, ToolCall, Trajectory, TurnStart

__all__ = ["BoundaryRecord", "Checkpoint", "DeltaField", "ListDelta"]

DeltaField = Literal[
    "request.messages", "request.input", "input", "tokens.prompt_token_ids", "tokens.prompt_log_probs"
]


class ListDelta(ArtifactModel):
    """How a list of a model call extends the same list of an earlier call, so a journal line stays O(new).

    Every request repeats the conversation so far, and every prompt's token ids
    repeat the previous prompt's: the list named by ``field`` is the first ``keep``
    items of model call ``base``'s list followed by ``append``.
    """

    field: DeltaField = Field(description="Which list of the call the delta rebuilds (a dotted path).")
    base: int = Field(ge=0, description="Index of the earlier model call whose list this one extends.")
    keep: int = Field(ge=0, description="Leading items of the base list that are kept.")
    append: list[Any] = Field(description="Items that follow them.")


class BoundaryRecord(ArtifactModel):
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


class Checkpoint(ArtifactModel):
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
