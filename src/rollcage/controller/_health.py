"""Health checks over a run: stable names, so dashboards and alerts can key on them.

Each check looks for a way a run can *look* fine while its data is not: a reward
computed over rollouts where the model never answered, token counts nobody
reported, a capture that disagrees with what the worker says it did. A count the
check cannot establish (e.g. no token counts reported) is counted as
*unobserved*, never silently as healthy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from rollcage.protocol import RolloutRecord

__all__ = ["HEALTH_CHECKS", "TASK_CHECK", "inspect_rollout", "load_result"]

HEALTH_CHECKS: dict[str, str] = {
    "no_model_turn": "rollouts whose result records no model call at all",
    "hollow_turn": "completed model calls with neither answer text nor tool calls (count: calls)",
    "failed_model_call": "model calls that failed (count: calls)",
    "unobserved_tokens": "model calls without input or output token counts: unobserved, not healthy "
    "(count: calls)",
    "zero_completion_tokens": "model calls that reported 0 output tokens (count: calls)",
    "runaway_generation": "model calls stopped by the output length limit (count: calls)",
    "token_total_mismatch": "rollouts whose per-call token counts do not add up to the rollout's "
    "or a call's total is not input + output",
    "capture_mismatch": "rollouts whose model_capture.jsonl exchange count differs from the HTTP attempts "
    "the worker's trajectory records",
    "grader_error": "rollouts the outcome allowed to grade but whose grader failed (no reward)",
    "task_without_model_success": "tasks with no completed model call in any attempt (ids: task ids)",
}
"""Every check's stable name and what it looks for; all appear in metrics.json, 0 when clean."""

TASK_CHECK = "task_without_model_success"
"""The one check counted per task (the others are per rollout or per call)."""

_LENGTH_REASONS = frozenset({"length", "max_output_tokens", "max_tokens"})


def load_result(rollout_dir: Path) -> dict[str, Any] | None:
    """``result.json`` of a rollout as plain JSON, or ``None`` when absent or unreadable (blocking)."""
    try:
        value = orjson.loads((rollout_dir / "result.json").read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _has_answer(output: list[Any]) -> bool:
    for item in output:
        if not isinstance(item, Mapping):
            continue
        if item.get("type") == "function_call":
            return True
        if item.get("type") == "message":
            for part in item.get("content") or []:
                if isinstance(part, Mapping) and str(part.get("text") or "").strip():
                    return True
    return False


def _sum(values: list[int | None]) -> int | None:
    return None if not values or any(v is None for v in values) else sum(v for v in values if v is not None)


def inspect_rollout(record: RolloutRecord, result: Mapping[str, Any] | None) -> dict[str, int]:
    """The per-rollout health counts of one finished attempt (only checks that fired).

    Args:
        record: The attempt's record (its receipt and grader detail are used).
        result: Its ``result.json`` as plain JSON, when the receipt says it is valid.

    Returns:
        Check name → count (rollout checks count 1, call checks count calls).
    """
    found: dict[str, int] = {}
    if record.grader is not None and "error" in record.grader:
        found["grader_error"] = 1
    if result is None or not record.receipt.result_valid:
        return found
    trajectory = result.get("trajectory") or {}
    calls = [c for c in trajectory.get("model_calls") or [] if isinstance(c, Mapping)]
    if not calls:
        found["no_model_turn"] = 1
    per_call: dict[str, int] = {}
    inputs: list[int | None] = []
    outputs: list[int | None] = []
    attempts = 0
    mismatch = False
    for call in calls:
        attempts += int(call.get("attempts") or 1)
        status = call.get("status")
        usage = call.get("usage") or {}
        if status == "failed":
            per_call["failed_model_call"] = per_call.get("failed_model_call", 0) + 1
            continue
        if status == "completed" and not _has_answer(call.get("output") or []):
            per_call["hollow_turn"] = per_call.get("hollow_turn", 0) + 1
        if status == "incomplete" and call.get("incomplete_reason") in _LENGTH_REASONS:
            per_call["runaway_generation"] = per_call.get("runaway_generation", 0) + 1
        i, o, t = usage.get("input_tokens"), usage.get("output_tokens"), usage.get("total_tokens")
        inputs.append(i)
        outputs.append(o)
        if i is None or o is None:
            per_call["unobserved_tokens"] = per_call.get("unobserved_tokens", 0) + 1
        elif o == 0:
            per_call["zero_completion_tokens"] = per_call.get("zero_completion_tokens", 0) + 1
        if i is not None and o is not None and t is not None and t != i + o:
            mismatch = True
    found.update(per_call)
    response = result.get("response")
    totals = (response or {}).get("usage") or {} if isinstance(response, Mapping) else {}
    for key, parts in (("input_tokens", inputs), ("output_tokens", outputs)):
        summed, reported = _sum(parts), totals.get(key)
        if summed is not None and reported is not None and summed != reported:
            mismatch = True
    if mismatch:
        found["token_total_mismatch"] = 1
    captured = record.receipt.model_calls_captured
    if captured is not None and captured != attempts:
        found["capture_mismatch"] = 1
    return found
