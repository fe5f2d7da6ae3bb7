"""rollcage: crash-safe, sandboxed agent rollouts for reinforcement learning and evaluation.

The public face: the protocol models, ``load_checkpoint``, the error root, and
``collect`` and ``branch`` (the Python API for trainers: ``rollcage.controller``, imported
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
    from rollcage.controller import branch, collect

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
    "branch",
    "collect",
    "load_checkpoint",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``rollcage.collect`` and ``rollcage.branch``, imported when first asked for."""
    if name == "collect":
        from rollcage.controller import collect

        return collect
    if name == "branch":
        from rollcage.controller import branch

        return branch
    raise AttributeError(f"module 'rollcage' has no attribute {name!r}")
