"""``model_capture.jsonl``: one :class:`CaptureExchange` a line, each request and response that crossed
the egress proxy."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from rollcage.protocol._base import ArtifactModel

__all__ = ["CaptureExchange", "CapturedBody", "CapturedMessage"]


class CapturedBody(ArtifactModel):
    """A body as captured: parsed JSON when it was JSON, else text, else base64; never more than one."""

    size: int = Field(ge=0, description="Bytes on the wire.")
    json_value: Any = Field(default=None, alias="json", description="The parsed body, when it was JSON.")
    text: str | None = Field(default=None, description="The body as UTF-8 text, when it was not JSON.")
    base64: str | None = Field(default=None, description="The body in base64, when it was not UTF-8.")
    truncated: bool = Field(
        default=False,
        description="The body was over the capture's bound: text/base64 hold only its first bytes.",
    )
    sha256: str | None = Field(default=None, description="Hex SHA-256 of the whole body, when truncated.")

    model_config = ConfigDict(
        extra="forbid", defer_build=True, populate_by_name=True, serialize_by_alias=True, allow_inf_nan=False
    )


class CapturedMessage(ArtifactModel):
    """The request or response half of a captured exchange."""

    headers: list[tuple[str, str]] = Field(description="Headers in order; credentials are '[redacted]'.")
    body: CapturedBody = Field(description="The body.")
    status: int | None = Field(default=None, description="HTTP status (responses only).")


class CaptureExchange(ArtifactModel):
    """One line of ``model_capture.jsonl``: one exchange through the egress proxy (outside the sandbox)."""

    seq: int = Field(ge=1, description="1-based position in the capture.")
    rollout_id: str = Field(description="The rollout whose sandbox made the request.")
    route: Literal["model", "resource", "denied"] = Field(
        description=(
            "The allowed route the path names (even when the proxy answered itself: 408, 413); denied: off "
            "the allow-list (403) or not a parseable request (400)."
        )
    )
    name: str | None = Field(description="The resource name (resource route), else None.")
    method: str = Field(description="HTTP method.")
    path: str = Field(description="The path the sandbox asked for.")
    upstream_url: str | None = Field(description="Where it was forwarded; None when it was not.")
    credential_added: bool = Field(description="Whether the proxy added the configured credential.")
    request: CapturedMessage = Field(description="What the sandbox sent (credentials redacted).")
    response: CapturedMessage | None = Field(description="What came back; None if nothing did.")
    status: int | None = Field(description="Response status; None if there was no response.")
    started_at: float = Field(description="Unix time the request arrived.")
    first_byte_at: float | None = Field(description="Unix time of the upstream's first response byte.")
    ended_at: float = Field(description="Unix time the exchange ended.")
    duration_s: float = Field(description="ended_at - started_at.")
    error: str | None = Field(description="What went wrong, if anything (upstream unreachable, size bound).")
