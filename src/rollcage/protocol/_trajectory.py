"""What a rollout did: model calls (attempts, token data), tool calls, turns, and the trajectory that
holds them; the same records in ``result.json`` and in the journal."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from rollcage.protocol._base import MAX_TOKEN_ID, ArtifactModel, ResponseItem, RunnerError

__all__ = [
    "ATTEMPT_BODY_BYTES",
    "CallAttempt",
    "CallTokens",
    "ModelCall",
    "ResumedFrom",
    "TokenCoverage",
    "TokenField",
    "TokenUsage",
    "ToolCall",
    "ToolStatus",
    "Trajectory",
    "Turn",
    "TurnResolution",
    "TurnStart",
    "kept_body",
]

# --------------------------------------------------------------------------- trajectory

ATTEMPT_BODY_BYTES = 16 * 1024
"""At most this many bytes of a failed attempt's response body are kept in its ``CallAttempt``."""


def kept_body(body: bytes | None) -> tuple[str | None, bool]:
    """A failed attempt's body as its ``CallAttempt`` keeps it: the first ATTEMPT_BODY_BYTES, and whether cut.

    Decoding replaces undecodable bytes (one cut inside a character included) and NULs; a
    replacement character takes three bytes, so the text is cut again to stay within the cap.
    """
    if body is None:
        return None, False
    truncated = len(body) > ATTEMPT_BODY_BYTES
    text = body[:ATTEMPT_BODY_BYTES].decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    while len(text.encode()) > ATTEMPT_BODY_BYTES:
        text, truncated = text[: -max(1, (len(text.encode()) - ATTEMPT_BODY_BYTES) // 3)], True
    return text, truncated


class TokenUsage(ArtifactModel):
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


class CallTokens(ArtifactModel):
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


class CallAttempt(ArtifactModel):
    """One HTTP attempt of a model call (a retried call has several)."""

    index: int = Field(ge=0, description="0-based attempt number within the call.")
    status: Literal["completed", "failed", "incomplete"] = Field(
        description="completed: an answer came back and was used; failed: an error (error says which); "
        "incomplete: it was in flight when the rollout stopped."
    )
    http_status: int | None = Field(default=None, description="HTTP status of the answer; None: none came.")
    error: RunnerError | None = Field(default=None, description="Why the attempt failed, if it did.")
    response_body: str | None = Field(
        default=None,
        max_length=ATTEMPT_BODY_BYTES,
        description="A failed attempt's response body as the server sent it (UTF-8, undecodable bytes "
        "replaced), its first ATTEMPT_BODY_BYTES (16 KiB) bytes at most; None: no body came, the body "
        "could not be kept (a stream, one over the response bound), or the attempt completed (its answer "
        "is ModelCall.response).",
    )
    response_body_truncated: bool = Field(
        default=False, description="response_body is only the body's first ATTEMPT_BODY_BYTES bytes."
    )
    started_at: float = Field(description="Unix time the attempt started.")
    first_byte_at: float | None = Field(default=None, description="Unix time of its first response byte.")
    ended_at: float = Field(description="Unix time it ended (or was abandoned).")


class ModelCall(ArtifactModel):
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


class ToolCall(ArtifactModel):
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


class TurnStart(ArtifactModel):
    """The start of one turn, journaled before its model call is sent: an in-flight call leaves a trace."""

    index: int = Field(ge=0, description="0-based turn number.")
    id: str = Field(min_length=1, description="Unique id of the turn ('<rollout_id>:t<index>').")
    model_call_id: str = Field(min_length=1, description="Id of the model call the turn makes.")
    started_at: float = Field(description="Unix time the turn started (its model call is sent next).")
    input: list[ResponseItem] = Field(
        description="Responses-API items the turn adds to the conversation before its model call: the task's "
        "input for turn 0, then tool outputs and feedback."
    )


class Turn(ArtifactModel):
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


class ResumedFrom(ArtifactModel):
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


class Trajectory(ArtifactModel):
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
