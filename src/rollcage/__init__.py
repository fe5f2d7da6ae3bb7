"""rollcage: crash-safe, sandboxed agent rollouts for reinforcement learning and evaluation.

The public face: the protocol models, ``load_checkpoint`` and the error root.
Everything else lives in modules with their own ``__all__``.
"""

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


def __getattr__(name: str) -> object:
    # load_checkpoint pulls in the journal reader; import it only when asked for.
    if name == "load_checkpoint":
        from rollcage.checkpoint import load_checkpoint

        return load_checkpoint
    raise AttributeError(f"module 'rollcage' has no attribute {name!r}")
