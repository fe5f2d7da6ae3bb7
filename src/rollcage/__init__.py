"""rollcage: crash-safe, sandboxed agent rollouts for reinforcement learning and evaluation.

The public face: the protocol models, ``load_checkpoint`` and the error root.
Everything else lives in modules with their own ``__all__``.
"""

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
    "load_checkpoint",
]

__version__ = "0.1.0"
