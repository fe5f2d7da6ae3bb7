"""Every artifact model by the name ``rollcage schema NAME`` prints it under."""

from __future__ import annotations

from pydantic import BaseModel

from rollcage.protocol._capture import CaptureExchange
from rollcage.protocol._checkpoint import BoundaryRecord, Checkpoint
from rollcage.protocol._input import WorkerInput
from rollcage.protocol._receipt import SupervisorReceipt
from rollcage.protocol._records import RolloutRecord, RunMetrics
from rollcage.protocol._result import WorkerResult

__all__ = ["artifact_models"]


def artifact_models() -> dict[str, type[BaseModel]]:
    """The artifact models by the name ``rollcage schema NAME`` uses."""
    return {
        "WorkerInput": WorkerInput,
        "WorkerResult": WorkerResult,
        "BoundaryRecord": BoundaryRecord,
        "Checkpoint": Checkpoint,
        "SupervisorReceipt": SupervisorReceipt,
        "CaptureExchange": CaptureExchange,
        "RolloutRecord": RolloutRecord,
        "RunMetrics": RunMetrics,
    }
