"""``receipt.json`` (:class:`SupervisorReceipt`): what the supervisor saw of one attempt, the outcome it
classified, and the budgets it enforced."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollcage.protocol._base import (
    SCHEMA_VERSION,
    ArtifactModel,
    FrozenArtifact,
    Outcome,
    RunnerError,
    VersionGate,
)

__all__ = ["BudgetMechanism", "BudgetName", "BudgetUse", "RolloutUsage", "SignalEvent", "SupervisorReceipt"]

# --------------------------------------------------------------------------- supervisor


class SignalEvent(ArtifactModel):
    """A signal the supervisor sent."""

    signal: str = Field(description="Signal name, e.g. 'SIGTERM'.")
    target: Literal["group", "descendants"] = Field(description="The worker's group, or stray descendants.")
    at: float = Field(description="Unix time it was sent.")
    reason: Literal["deadline", "stop", "budget", "grace_expired", "cleanup"] = Field(
        description="Why it was sent (budget: the rollout went over one of its budgets)."
    )


BudgetName = Literal[
    "memory_bytes",
    "processes",
    "workspace_bytes",
    "workspace_inodes",
    "tmp_bytes",
    "tmp_inodes",
    "shm_bytes",
    "shm_inodes",
]
"""The per-rollout budgets the supervisor enforces (see ``rollcage.cage``)."""

BudgetMechanism = Literal["cgroup2", "cgroup1", "rlimit", "tmpfs", "poll", "none"]
"""How a budget is enforced: a cgroup, a per-process rlimit only, a bounded tmpfs, a poll, or not at all."""


class BudgetUse(ArtifactModel):
    """One per-rollout budget, as the receipt reports it."""

    budget: BudgetName = Field(description="Which budget.")
    limit: int | None = Field(
        description="The bound (bytes, processes and threads, or entries); None: unbounded."
    )
    mechanism: BudgetMechanism = Field(
        description=(
            "How it was enforced: a cgroup (v2 or v1: the sandbox as a whole), rlimit (per process only: "
            "the machine allowed no cgroup), tmpfs (a hard bound), poll (measured every budget_poll_s: late "
            "by up to one poll), none."
        )
    )
    peak: int | None = Field(description="Highest use observed; None where it could not be measured.")
    exceeded: bool = Field(description="This budget ended the rollout.")


class RolloutUsage(ArtifactModel):
    """What one rollout's sandbox cost the machine, as the receipt reports it."""

    cpu_s: float | None = Field(
        description="CPU time (user + system) of every process of the sandbox; None where not measured."
    )
    cpu_mechanism: Literal["cgroup2", "cgroup1", "none"] = Field(
        description=(
            "How cpu_s was counted: the sandbox's cgroup (v2 cpu.stat or v1 cpuacct: exact, whoever reaped "
            "whom; RUSAGE_CHILDREN would miss the processes a dying PID namespace reaps itself), or none."
        )
    )
    peak_memory_bytes: int | None = Field(
        description="Peak memory of the sandbox as a whole; None where not measured."
    )
    memory_mechanism: Literal["cgroup2", "cgroup1", "none"] = Field(
        description="How peak_memory_bytes was measured: the sandbox's memory cgroup, or none."
    )


class SupervisorReceipt(FrozenArtifact, VersionGate):
    """``receipt.json``: written last by the supervisor, out of the sandbox's reach."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(description="Id of this attempt.")
    outcome: Outcome = Field(description="The classification of this attempt.")
    outcome_reason: str = Field(description="Why this outcome, in words.")
    sandbox: Literal["bwrap", "none"] = Field(description="How the worker was contained.")
    exit_code: int | None = Field(default=None, description="Worker exit code; None if killed by a signal.")
    exit_signal: str | None = Field(default=None, description="Signal that killed the worker, if any.")
    deadline_s: float = Field(description="The wall-clock deadline.")
    grace_s: float = Field(description="Grace between SIGTERM and SIGKILL.")
    deadline_fired: bool = Field(description="The deadline passed before the worker exited.")
    stop_requested: bool = Field(description="An external stop (signal or stop file) was received.")
    signals_sent: list[SignalEvent] = Field(default_factory=list, description="Signals sent, in order.")
    started_at: float = Field(description="Unix time supervision started.")
    ended_at: float = Field(description="Unix time the receipt was built.")
    duration_s: float = Field(description="ended_at - started_at.")
    cleanup_confirmed: bool = Field(description="No descendant of the worker was left alive.")
    descendants_killed: int = Field(default=0, ge=0, description="Stray descendants killed after the worker.")
    temp_files_swept: int = Field(default=0, ge=0, description="Leftover temporary files removed.")
    last_checkpoint_seq: int | None = Field(default=None, description="Last intact journal seq, if any.")
    resumed_from: str | None = Field(
        default=None, description="Id of the earlier attempt this one was asked to continue, if any."
    )
    result_present: bool = Field(description="result.json existed after the worker exited.")
    result_valid: bool = Field(description="result.json parsed as a WorkerResult.")
    result_error: RunnerError | None = Field(default=None, description="The result's error, if any.")
    model_calls_captured: int | None = Field(
        default=None, description="Model-route lines in model_capture.jsonl; None without the egress proxy."
    )
    capture_bytes: int | None = Field(
        default=None, ge=0, description="Size of model_capture.jsonl; None without the egress proxy."
    )
    capture_failures: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Exchanges whose capture line could not be written (disk full, I/O error; the failed write is "
            "cut back off the file, never left torn); None without the egress proxy."
        ),
    )
    proxy_connections_refused: int | None = Field(
        default=None,
        ge=0,
        description="Connections to the egress proxy refused at accept (over the rollout's connection cap).",
    )
    budget_exceeded: str | None = Field(
        default=None,
        description=(
            "The per-rollout budget the policy exceeded (e.g. 'capture_bytes', 'memory_bytes', "
            "'workspace_bytes'), which ended the rollout as agent_error; None: none was."
        ),
    )
    budgets: list[BudgetUse] = Field(
        default_factory=list,
        description="Each per-rollout budget of the sandbox: its bound, mechanism and peak (bwrap only).",
    )
    usage: RolloutUsage | None = Field(
        default=None,
        description="CPU time and peak memory of the sandbox (bwrap only; None before this field).",
    )
