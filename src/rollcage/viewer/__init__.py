"""The terminal and HTML views of rollouts and runs (``rollcage show``, ``rollcage report``).

Reading is tolerant (``load_rollout`` lists what it could not read instead of
failing), one digest of a rollout feeds both views, and every piece of agent or
model text is treated as hostile: cleaned of terminal controls for the terminal,
embedded as escaped JSON and shown with ``textContent`` in the report.
"""

from rollcage.viewer._capture import CaptureComparison, CaptureDifference
from rollcage.viewer._load import (
    RolloutView,
    ViewTarget,
    load_rollout,
    resolve_target,
)
from rollcage.viewer._report import write_report
from rollcage.viewer._terminal import PARTIAL_LABEL, render_rollout, render_run, render_text

__all__ = [
    "PARTIAL_LABEL",
    "CaptureComparison",
    "CaptureDifference",
    "RolloutView",
    "ViewTarget",
    "load_rollout",
    "render_rollout",
    "render_run",
    "render_text",
    "resolve_target",
    "write_report",
]
