"""Health checks over a run: stable names, so dashboards and alerts can key on them.

Each check looks for a way a run can *look* fine while its data is not: a reward
computed over rollouts where the model never answered, token counts nobody
reported, a capture that disagrees with what the worker says it did. A count the
check cannot establish (e.g. no token counts reported) is counted as
*unobserved*, never silently as healthy: a rollout whose ``result.json`` is
missing or invalid is counted by ``unobserved_result`` (its calls could not be
checked), never passed as clean.

Rollouts the run itself stopped (Ctrl-C, shutdown: outcome ``cancelled``) are
counted apart, by ``cancelled_by_run``: they did not fail, they were not allowed
to finish, so "no model turn" says nothing about the model there. A rollout that
was stopped (cancelled or timed out) may have had one exchange in flight that the
proxy captured and the worker never recorded; the capture check allows for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

from rollcage.protocol import RolloutRecord

__all__ = ["HEALTH_CHECKS", "TASK_CHECK", "inspect_rollout", "load_result"]

HEALTH_CHECKS: dict[str, str] = {
    "unobserved_result": "rollouts whose result.json is missing or invalid: no per-call check could be "
    "made (unobserved, not healthy)",
    "cancelled_by_run": "rollouts the run itself stopped (Ctrl-C, shutdown) before they finished; reported "
    "apart, not as model findings",
    "no_model_turn": "rollouts whose result records no answered model call (none made, or every one failed)",
    "hollow_turn": "completed model calls with neither answer text nor tool calls (count: calls)",
    "failed_model_call": "model calls that failed (count: calls)",
    "unobserved_tokens": "model calls without input or output token counts: unobserved, not healthy "
    "(count: calls)",
    "zero_completion_tokens": "model calls that reported 0 output tokens, length-limited calls exempt "
    "(count: calls)",
    "runaway_generation": "model calls stopped by the output length limit (count: calls)",
    "token_total_mismatch": "rollouts whose per-call token counts do not add up to the rollout's "
    "or a call's total is not input + output",
    "capture_mismatch": "rollouts whose model_capture.jsonl exchange count differs from the HTTP attempts "
    "the worker's trajectory records (a stopped rollout may have one more, in flight when it was stopped)",
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
        result: Its ``result.json`` as plain JSON, when the receipt says it is valid
            and it could be read; ``None`` otherwise (counted as unobserved).

    Returns:
        Check name → count (rollout checks count 1, call checks count calls).
    """
    found: dict[str, int] = {}
    if record.grader is not None and "error" in record.grader:
        found["grader_error"] = 1
    cancelled = record.outcome == "cancelled"
    if cancelled:
        found["cancelled_by_run"] = 1
    trajectory = result.get("trajectory") if result is not None and record.receipt.result_valid else None
    if not isinstance(trajectory, Mapping):
        found["unobserved_result"] = 1
        return found
    calls = [c for c in trajectory.get("model_calls") or [] if isinstance(c, Mapping)]
    per_call, attempts, mismatch, inputs, outputs = _inspect_calls(calls)
    found.update(per_call)
    if not cancelled and not any(call.get("status") != "failed" for call in calls):
        found["no_model_turn"] = 1
    response = result.get("response") if result is not None else None
    totals = (response.get("usage") or {}) if isinstance(response, Mapping) else {}
    for key, parts in (("input_tokens", inputs), ("output_tokens", outputs)):
        summed, reported = _sum(parts), totals.get(key) if isinstance(totals, Mapping) else None
        if summed is not None and reported is not None and summed != reported:
            mismatch = True
    if mismatch:
        found["token_total_mismatch"] = 1
    captured = record.receipt.model_calls_captured
    # A stopped worker may have had one exchange in flight: captured by the proxy, never recorded.
    in_flight = 1 if record.outcome in ("cancelled", "timeout") else 0
    if captured is not None and not attempts <= captured <= attempts + in_flight:
        found["capture_mismatch"] = 1
    return found


def _inspect_calls(
    calls: list[Mapping[str, Any]],
) -> tuple[dict[str, int], int, bool, list[int | None], list[int | None]]:
    """Per-call counts, HTTP attempts, whether a call's total is off, and the token counts per call."""
    per_call: dict[str, int] = {}
    inputs: list[int | None] = []
    outputs: list[int | None] = []
    attempts = 0
    mismatch = False

    def count(name: str) -> None:
        per_call[name] = per_call.get(name, 0) + 1

    for call in calls:
        attempts += _int(call.get("attempts")) or 1
        status = call.get("status")
        raw_usage = call.get("usage")
        usage: Mapping[str, Any] = raw_usage if isinstance(raw_usage, Mapping) else {}
        if status == "failed":
            count("failed_model_call")
            continue
        length_limited = status == "incomplete" and call.get("incomplete_reason") in _LENGTH_REASONS
        if status == "completed" and not _has_answer(call.get("output") or []):
            count("hollow_turn")
        if length_limited:
            count("runaway_generation")
        i, o, t = (_int(usage.get(key)) for key in ("input_tokens", "output_tokens", "total_tokens"))
        inputs.append(i)
        outputs.append(o)
        if i is None or o is None:
            count("unobserved_tokens")
        elif o == 0 and not length_limited:
            count("zero_completion_tokens")
        if i is not None and o is not None and t is not None and t != i + o:
            mismatch = True
    return per_call, attempts, mismatch, inputs, outputs


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
