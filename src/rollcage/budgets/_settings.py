"""The budgets a sandbox is given: one model, read by the supervisor's config and by the command line.

:class:`BudgetSettings` holds every per-rollout budget and how it is enforced;
:class:`rollcage.supervisor.BwrapSandbox` is built on it (its fields are the
config's), and ``rollcage supervise`` generates its budget flags from it, so a
budget added here is a config key and a flag without another word spelled.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["BudgetSettings"]

_MIB = 1 << 20
_GIB = 1 << 30


class BudgetSettings(BaseModel):
    """The per-rollout budgets on the whole sandbox, and how each is enforced.

    A rollout that exceeds a budget is ended as the policy's fault (``agent_error``, the
    reason naming the budget); the receipt records each budget, how it was enforced and its
    peak use (see :mod:`rollcage.budgets`).
    """

    # Infinity and NaN are never a meaningful bound or poll period. Built on first use, as the
    # protocol's models are: the cage imports this room, and building a model loads pydantic's
    # plugins (importlib.metadata and the email package, ~40 modules) into every process that does.
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False)

    memory_bytes: int | None = Field(
        default=4 * _GIB,
        ge=64 * _MIB,
        description=(
            "Budget: total memory of the sandbox, all processes together (a cgroup where the machine allows "
            "one; otherwise only address_space_bytes per process bounds it). Exceeding it ends the rollout. "
            "None: no total bound."
        ),
    )
    max_processes: int | None = Field(
        default=256,
        ge=8,
        description=(
            "Budget: processes and threads in the sandbox together (a pids cgroup where the machine "
            "allows one, else RLIMIT_NPROC, counted per user namespace). Reaching it under a cgroup ends "
            "the rollout."
        ),
    )
    workspace_bytes: int = Field(
        default=1 * _GIB,
        ge=_MIB,
        description=(
            "Budget: bytes in the workspace. As root a tmpfs of this size (memory-backed: it counts toward "
            "memory_bytes too), copied to the rollout directory at the end; otherwise a poll of the host "
            "directory (late by up to budget_poll_s)."
        ),
    )
    workspace_inodes: int = Field(
        default=65_536, ge=64, description="Budget: files, directories and links in the workspace."
    )
    tmp_size_bytes: int = Field(
        default=256 * _MIB, ge=_MIB, description="Budget: bytes in the private /tmp (memory-backed)."
    )
    tmp_inodes: int = Field(
        default=16_384, ge=64, description="Budget: files, directories and links in /tmp."
    )
    shm_bytes: int = Field(
        default=64 * _MIB, ge=_MIB, description="Budget: bytes in the private /dev/shm (memory-backed)."
    )
    shm_inodes: int = Field(default=1024, ge=16, description="Budget: files and directories in /dev/shm.")
    budget_poll_s: float = Field(
        default=0.5, gt=0, le=60, description="How often the supervisor reads the budgets' counters."
    )
    cgroups: Literal["auto", "off"] = Field(
        default="auto",
        description=(
            "auto: a cgroup per rollout for memory_bytes and max_processes where the machine allows it "
            "(cgroup v2 with delegated controllers, or writable v1 memory/pids hierarchies); off: rlimits "
            "only."
        ),
    )
    disk_budgets: Literal["auto", "poll"] = Field(
        default="auto",
        description=(
            "auto: as root, size- and inode-bounded tmpfs mounts for the workspace, /tmp and /dev/shm (a "
            "hard bound); poll: bubblewrap's size-bounded tmpfs and a poll (the only way without root)."
        ),
    )
    require_budgets: bool = Field(
        default=False,
        description=(
            "Refuse to run (a SandboxError before anything starts) when a budget asked for cannot be a hard "
            "bound here: memory_bytes or max_processes without a cgroup (a per-process rlimit only), or a "
            "disk budget that is only polled (no bounded tmpfs without root). False: such budgets are "
            "named in one warning when the run starts, and in every receipt."
        ),
    )
