"""Comparing what crossed the egress proxy with what the worker says it sent.

``model_capture.jsonl`` is written by the supervisor, outside the sandbox, so it
is the independent witness of the worker's model traffic. The trajectory's
``model_calls[*].request`` is the worker's own account. When they disagree —
a call the proxy never saw, an exchange the trajectory does not mention, a
request that differs — the report shows where, as a diff.

Each line is a ``CaptureExchange`` (protocol): its request body is compared by
content (the ``json`` of the ``{"size", "json"}`` wrapper), and exchanges that
did not go to the model (``route`` resource or denied) are counted but not
compared. Lines of another shape are read defensively: a request body is looked
for under the usual names and a body given as JSON text is parsed.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from rollcage.durable import open_regular
from rollcage.protocol import CapturedBody, Trajectory
from rollcage.viewer._text import clean_text

__all__ = ["CaptureComparison", "CaptureDifference", "compare_capture"]

_MODEL_PATH_SUFFIXES = ("/chat/completions", "/responses")
_BODY_KEYS = frozenset(field.alias or name for name, field in CapturedBody.model_fields.items())
"""The keys of a captured body's wrapper, as the protocol defines them."""
_MAX_DIFF_LINES = 160
_MAX_DIFF_INPUT_LINES = 4000
_EXCERPT_CHARS = 600


@dataclass(frozen=True, slots=True)
class CaptureDifference:
    """One place where the capture and the trajectory disagree."""

    kind: Literal["differs", "missing_from_capture", "not_in_trajectory"]
    """``differs``: same position, different request; ``missing_from_capture``: the proxy never saw
    this trajectory call; ``not_in_trajectory``: a captured exchange the trajectory does not record."""
    call_index: int | None
    """The trajectory's model call index, where one is involved."""
    attempt: int | None
    """Which HTTP attempt of that call (1-based), where one is involved."""
    capture_index: int | None
    """0-based position among the captured model exchanges, where one is involved."""
    summary: str
    """One line saying what disagrees."""
    diff: str
    """A unified diff (trajectory ``-``, capture ``+``) of the pretty-printed requests, or an excerpt."""


@dataclass(frozen=True, slots=True)
class CaptureComparison:
    """The capture set against the trajectory."""

    trajectory_calls: int
    """Model calls in the trajectory."""
    trajectory_attempts: int
    """HTTP attempts the trajectory reports (each retry is a separate exchange at the proxy)."""
    captured: int
    """Model exchanges in ``model_capture.jsonl``."""
    other_exchanges: int
    """Captured exchanges to non-model paths (resource tools), not compared."""
    unreadable_lines: int
    """Capture lines that were not JSON objects (e.g. a torn last line)."""
    differences: list[CaptureDifference] = field(default_factory=list)
    """Every disagreement, in order."""
    agrees: bool = True
    """No differences: every attempt the trajectory reports was captured with the same request."""


def compare_capture(trajectory: Trajectory, capture_path: Path) -> CaptureComparison:
    """Compare ``model_capture.jsonl`` at ``capture_path`` with ``trajectory``.

    Each model call stands for ``attempts`` exchanges with its (last) request,
    because the model client retries transient failures with the same payload.

    Raises:
        OSError: the capture cannot be read.
    """
    captured: list[Any] = []
    other = 0
    unreadable = 0
    with open_regular(capture_path) as handle:
        for line in handle:
            if not line.strip():
                continue
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                unreadable += 1
                continue
            if not isinstance(entry, dict):
                unreadable += 1
                continue
            path, body = _request_of(entry)
            if path is not None and not path.split("?", 1)[0].rstrip("/").endswith(_MODEL_PATH_SUFFIXES):
                other += 1
                continue
            captured.append(body)

    expected: list[tuple[int, int, Any]] = []
    for call in trajectory.model_calls:
        for attempt in range(1, len(call.attempts) + 1):
            expected.append((call.index, attempt, call.request))

    left = [_canonical(body) for _, _, body in expected]
    right = [_canonical(body) for body in captured]
    differences: list[CaptureDifference] = []
    matcher = difflib.SequenceMatcher(a=left, b=right, autojunk=False)
    for tag, a0, a1, b0, b1 in matcher.get_opcodes():
        if tag == "equal":
            continue
        pairs = min(a1 - a0, b1 - b0) if tag == "replace" else 0
        for offset in range(pairs):
            call_index, attempt, request = expected[a0 + offset]
            differences.append(
                CaptureDifference(
                    kind="differs",
                    call_index=call_index,
                    attempt=attempt,
                    capture_index=b0 + offset,
                    summary=(
                        f"model call {call_index} (attempt {attempt}) and captured exchange "
                        f"{b0 + offset} sent different requests"
                    ),
                    diff=_diff(request, captured[b0 + offset]),
                )
            )
        for position in range(a0 + pairs, a1):
            call_index, attempt, request = expected[position]
            differences.append(
                CaptureDifference(
                    kind="missing_from_capture",
                    call_index=call_index,
                    attempt=attempt,
                    capture_index=None,
                    summary=f"model call {call_index} (attempt {attempt}) has no exchange in the capture",
                    diff=_excerpt(request),
                )
            )
        for position in range(b0 + pairs, b1):
            differences.append(
                CaptureDifference(
                    kind="not_in_trajectory",
                    call_index=None,
                    attempt=None,
                    capture_index=position,
                    summary=f"captured exchange {position} matches no model call in the trajectory",
                    diff=_excerpt(captured[position]),
                )
            )
    return CaptureComparison(
        trajectory_calls=len(trajectory.model_calls),
        trajectory_attempts=len(expected),
        captured=len(captured),
        other_exchanges=other,
        unreadable_lines=unreadable,
        differences=differences,
        agrees=not differences,
    )


def _request_of(entry: dict[str, Any]) -> tuple[str | None, Any]:
    """The path and request body of one capture line.

    A line is a ``CaptureExchange``: ``route`` says whether it went to the model,
    and the body is wrapped as ``{"size", "json"|"text"|"base64"}`` (``CapturedBody``),
    of which the content, not the wrapper, is what the worker sent. Lines of another
    shape are read loosely, the body looked for under the usual names.
    """
    request = entry.get("request")
    path = _first_str(entry.get("path"), entry.get("url"))
    route = entry.get("route")
    if isinstance(route, str) and route != "model":
        path = f"/{route}{path or ''}"  # a resource call or a refused request: never a model exchange
    body: Any = None
    if isinstance(request, dict):
        path = path or _first_str(request.get("path"), request.get("url"), request.get("target"))
        for key in ("body", "json", "payload", "content"):
            if key in request:
                body = request[key]
                break
        else:
            body = request
    elif request is not None:
        body = request
    else:
        body = entry.get("request_body", entry.get("body"))
    body = _unwrap(body)
    if isinstance(body, str | bytes):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # keep the text: a non-JSON body is still evidence to compare
    return path, body


def _unwrap(body: Any) -> Any:
    """The content of a ``CapturedBody`` wrapper; anything else as it is."""
    if isinstance(body, dict) and isinstance(body.get("size"), int) and body.keys() <= _BODY_KEYS:
        for key in ("json", "text", "base64"):
            if key in body:
                return body[key]
        return None  # an empty body
    return body


def _first_str(*values: Any) -> str | None:
    return next((value for value in values if isinstance(value, str) and value), None)


def _canonical(body: Any) -> bytes:
    try:
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)
    except TypeError:
        return repr(body).encode()


def _pretty(body: Any) -> list[str]:
    if isinstance(body, str):
        return body.splitlines()
    try:
        return json.dumps(body, indent=1, sort_keys=True, ensure_ascii=False, default=repr).splitlines()
    except (TypeError, ValueError):
        return repr(body).splitlines()


def _diff(trajectory_body: Any, captured_body: Any) -> str:
    before, after = _pretty(trajectory_body), _pretty(captured_body)
    if len(before) > _MAX_DIFF_INPUT_LINES or len(after) > _MAX_DIFF_INPUT_LINES:
        # difflib is quadratic in the worst case; a huge request would stall the report.
        return (
            f"(requests too large to diff line by line: {len(before):,} and {len(after):,} lines)\n"
            + _excerpt(trajectory_body)
        )
    lines = list(
        difflib.unified_diff(before, after, fromfile="trajectory", tofile="capture", n=2, lineterm="")
    )
    if len(lines) > _MAX_DIFF_LINES:
        lines = [*lines[:_MAX_DIFF_LINES], f"… [{len(lines) - _MAX_DIFF_LINES:,} more diff lines]"]
    return clean_text("\n".join(lines))


def _excerpt(body: Any) -> str:
    text = clean_text("\n".join(_pretty(body)))
    if len(text) > _EXCERPT_CHARS:
        return f"{text[:_EXCERPT_CHARS]}… [{len(text) - _EXCERPT_CHARS:,} more characters]"
    return text
