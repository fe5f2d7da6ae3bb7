"""rollcage: crash-safe, sandboxed agent rollouts for reinforcement learning and evaluation.

The public face: the protocol models, ``load_checkpoint``, the error root, and
``collect`` (the Python API for trainers: ``rollcage.controller.collect``, imported
on first use, so that the worker, which imports this package, never pays for the
controller). Everything else lives in modules with their own ``__all__``.
"""

from typing import TYPE_CHECKING, Any

from rollcage.checkpoint import load_checkpoint
from rollcage.errors import RollcageError
from rollcage.protocol import (
    Checkpoint,
    ModelCall,
    Outcome,
    RolloutRecord,
    RunnerError,
    SupervisorReceipt,
    ToolCall,
    Trajectory,
    WorkerInput,
    WorkerResult,
)

if TYPE_CHECKING:
    from rollcage.controller import collect

__all__ = [
    "Checkpoint",
    "ModelCall",
    "Outcome",
    "RollcageError",
    "RolloutRecord",
    "RunnerError",
    "SupervisorReceipt",
    "ToolCall",
    "Trajectory",
    "WorkerInput",
    "WorkerResult",
    "collect",
    "load_checkpoint",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``rollcage.collect``, imported when first asked for."""
    if name == "collect":
        from rollcage.controller import collect

        return collect
    raise AttributeError(f"module 'rollcage' has no attribute {name!r}")
