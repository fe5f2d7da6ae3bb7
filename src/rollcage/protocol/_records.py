"""The controller's artifacts: ``records.jsonl`` (:class:`RolloutRecord`: the one place a reward lives)
and ``metrics.json`` (:class:`RunMetrics`)."""

from __future__ import annotations

import os
import stat
import zlib
from typing import Any, Literal, Self

from pydantic import Field, PrivateAttr

from rollcage.protocol._base import (
    SCHEMA_VERSION,
    ArtifactModel,
    FrozenArtifact,
    Outcome,
    TerminationReason,
    VersionGate,
)
from rollcage.protocol._receipt import SupervisorReceipt
from rollcage.protocol._result import WorkerResult
from rollcage.protocol._trajectory import TokenCoverage, TokenUsage

__all__ = [
    "BranchLink",
    "FileSeal",
    "HealthFinding",
    "HealthVerdict",
    "Percentiles",
    "ResumeLink",
    "RolloutHealth",
    "RolloutMetrics",
    "RolloutRecord",
    "RunMetrics",
]

# --------------------------------------------------------------------------- controller


class RolloutMetrics(ArtifactModel):
    """Per-rollout numbers the controller aggregates, computed once when the attempt ends."""

    model_calls: int = Field(default=0, description="Model calls made.")
    failed_model_calls: int = Field(default=0, description="Model calls that failed.")
    tool_calls: int = Field(
        default=0,
        description="Tool calls made (by a resumed rollout: not those answered from the earlier attempt's "
        "journal, which that attempt's record counts; re-run cells are made again and count).",
    )
    input_tokens: int | None = Field(default=None, description="Sum of reported prompt tokens.")
    output_tokens: int | None = Field(default=None, description="Sum of reported completion tokens.")
    total_tokens: int | None = Field(default=None, description="Sum of reported totals.")
    token_counts: TokenCoverage = Field(
        default="unobserved",
        description="complete: every answered model call reported its input and output tokens, so the sums "
        "are the rollout's; partial: the sums cover only the calls that did (or a call was interrupted); "
        "unobserved: none did, or there is no valid result.",
    )
    token_ids: TokenCoverage = Field(
        default="unobserved",
        description="complete: every answered model call has prompt and generation token ids and log "
        "probabilities (CallTokens.status observed); partial: some do; unobserved: none.",
    )
    duration_s: float = Field(default=0.0, description="Supervised wall time.")
    replayed_model_calls: int = Field(
        default=0,
        ge=0,
        description="Model calls of a resumed rollout answered from the earlier attempt's journal (calls "
        "saved); they are not in model_calls and their tokens are not in the sums (the earlier attempt's "
        "record counts them).",
    )


HealthVerdict = Literal["healthy", "unhealthy", "unobserved"]
"""A rollout's health: unhealthy (a check found something), else unobserved (a check could not run for
want of evidence), else healthy (every check ran and found nothing)."""


class RolloutHealth(FrozenArtifact):
    """Health checks of one attempt, computed once from its result and receipt (checks by stable name).

    A check listed in neither ``findings`` nor ``unobserved`` ran and found nothing.
    """

    verdict: HealthVerdict = Field(description="See HealthVerdict; informational checks do not count.")
    findings: dict[str, int] = Field(
        default_factory=dict, description="Check name -> findings (calls, turns, or 1 for the rollout)."
    )
    unobserved: dict[str, str] = Field(
        default_factory=dict, description="Check name -> the evidence (capability) it lacked, in words."
    )
    successful_model_calls: int | None = Field(
        default=None,
        description="Model calls that were answered (for the per-task check); None: unobserved (no valid "
        "result).",
    )
    unfailed_model_calls: int | None = Field(
        default=None,
        description="Model calls NeMo Gym counts successful, for its task_no_successful_model_calls: no HTTP "
        "error status, no error, not failed (a call cut off in flight included); None: unobserved, or a "
        "record written before this field (successful_model_calls stands in).",
    )


class ResumeLink(FrozenArtifact):
    """How an attempt relates to the earlier attempt it was asked to continue."""

    previous_rollout_id: str = Field(description="Id of the earlier attempt.")
    previous_dir: str = Field(description="Its directory (kept intact as evidence).")
    resumed: bool = Field(description="The attempt continued from the journal (else it started fresh).")
    boundary: int | None = Field(default=None, description="seq of the last journal record used, if resumed.")
    replayed_model_calls: int = Field(default=0, ge=0, description="Model calls answered from the journal.")
    reason: str | None = Field(default=None, description="Why it started fresh, if it did.")


class FileSeal(FrozenArtifact):
    """The size and checksum of a file published without a sync of its own, kept where it is durable.

    ``workspace.diff`` is derived evidence: it is written and renamed into place, but not synced,
    so a machine crash (not a killed process) can leave it missing, empty or torn beside a record
    that did reach the disk. The record's seal tells a reader which: a file that does not match
    it is never read as the diff.
    """

    size: int = Field(ge=0, description="The file's size in bytes, as published.")
    crc32: str = Field(
        pattern=r"^[0-9a-f]{8}$", description="zlib.crc32 of the whole file, as 8 lowercase hex digits."
    )

    @classmethod
    def of(cls, data: bytes) -> Self:
        """The seal of ``data``."""
        return cls(size=len(data), crc32=f"{zlib.crc32(data):08x}")

    def matches(self, data: bytes) -> bool:
        """Whether ``data`` is the content this seal was made of."""
        return len(data) == self.size and f"{zlib.crc32(data):08x}" == self.crc32


class BranchLink(FrozenArtifact):
    """Where a branch (``rollcage branch``) forked from: its prefix is the source's, replayed."""

    run: str = Field(description="The source's run directory.")
    rollout_id: str = Field(description="Id of the source rollout whose journal the prefix was replayed.")
    boundary: int = Field(ge=0, description="seq of the source journal's last record in the prefix.")
    turn: int = Field(ge=0, description="The first model call the branch made live (0-based turn).")


class RolloutRecord(FrozenArtifact, VersionGate):
    """One line of ``rollouts.jsonl``: one finished attempt, as the controller saw it."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    rollout_id: str = Field(description="Id of this attempt (derived from task id, sample and try).")
    task_id: str = Field(description="Dataset row id.")
    task_index: int | None = Field(
        default=None,
        ge=0,
        description="The task's dataset row: its own _ng_task_index (NeMo Gym rows), else its 0-based line; "
        "None in records written before rollcage kept it.",
    )
    sample: int = Field(ge=0, description="Which of the --attempts samples of the task (for pass@k).")
    try_index: int = Field(ge=0, description="Infrastructure retry number of this sample.")
    outcome: Outcome = Field(description="The supervisor's classification.")
    graded: bool = Field(description="Whether the outcome allowed grading.")
    reward: float | None = Field(description="The grade; None when not graded.")
    masked: bool = Field(
        default=False,
        description="The environment asked to leave this sample out (NeMo Gym's mask_sample): its reward is "
        "kept as evidence but excluded from reward metrics and pass@k; train on it at your own risk.",
    )
    failure_kind: str | None = Field(
        default=None, description="The environment's label for why the sample failed (verify's failure_kind)."
    )
    grader: dict[str, Any] | None = Field(default=None, description="Grader name and detail.")
    termination_reason: TerminationReason | None = Field(default=None, description="From the result.")
    receipt: SupervisorReceipt = Field(description="The supervisor's receipt.")
    metrics: RolloutMetrics = Field(default_factory=RolloutMetrics, description="Token and timing metrics.")
    health: RolloutHealth = Field(description="Health checks, computed once when the attempt ended.")
    rollout_dir: str = Field(description="Path of the rollout directory.")
    resume: ResumeLink | None = Field(
        default=None, description="Set when the attempt was asked to continue an earlier one."
    )
    branched_from: BranchLink | None = Field(
        default=None, description="Set on a branch: the source rollout and the boundary it forked at."
    )
    workspace_diff: FileSeal | None = Field(
        default=None,
        description="The seal of the rollout's workspace.diff as the controller published it (unsynced: a "
        "reader checks the file against it and treats one that differs as torn); None: none was published, "
        "or a record written before rollcage sealed it (the file, if any, is then read unchecked).",
    )

    _result: WorkerResult | None = PrivateAttr(default=None)

    def result(self, run_dir: str | os.PathLike[str] | None = None) -> WorkerResult | None:
        """The attempt's ``WorkerResult``: its trajectory, turns and token data.

        The one the supervisor parsed when the attempt ended, when this process ran
        it (``rollcage.collect`` yields such records); else ``result.json`` read once
        (blocking, a regular file only) and kept. ``None`` when there is no valid one.

        Args:
            run_dir: For a record read back from a run's ``rollouts.jsonl``: that run's
                directory. The result is then read from the run's own
                ``rollouts/<rollout_id>/``, never from ``rollout_dir``, which a moved,
                copied or edited run makes wrong (``rollcage.runfiles``). ``None``:
                the record was made by this process, and ``rollout_dir`` is where it
                laid the attempt out.
        """
        if self._result is None and self.receipt.result_valid:
            if run_dir is None:
                directory = self.rollout_dir
            elif self.rollout_id in ("", ".", "..") or "/" in self.rollout_id or "\0" in self.rollout_id:
                return None  # not one file name: it cannot be a directory of the run
            else:
                directory = os.path.join(run_dir, "rollouts", self.rollout_id)
            # A regular file only, opened without blocking (durable.open_regular's rule; this module sits
            # below durable): a FIFO in its place must not hang the caller.
            flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
            try:
                with os.fdopen(os.open(os.path.join(directory, "result.json"), flags), "rb") as file:
                    if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                        return None
                    self._result = WorkerResult.model_validate_json(file.read())
            except (OSError, ValueError):
                return None
        return self._result

    def with_result(self, result: WorkerResult | None) -> RolloutRecord:
        """This record, holding ``result`` in memory for ``result()`` (nothing is written)."""
        self._result = result
        return self

    def __eq__(self, other: object) -> bool:
        """Records are equal when their fields are; a result held in memory does not count."""
        if not isinstance(other, RolloutRecord):
            return NotImplemented
        return self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # fields hold dicts and lists: a record is not hashable


class HealthFinding(ArtifactModel):
    """One named health check over a run; names are stable so dashboards can key on them."""

    count: int = Field(ge=0, description="Findings: rollouts, calls or turns affected, per the check.")
    rollouts: list[str] = Field(
        default_factory=list, description="Affected rollout ids (task ids for task checks; first 100)."
    )
    detail: str = Field(default="", description="What the check looks for.")
    evaluated: int = Field(default=0, ge=0, description="Rollouts (or tasks) on which the check could run.")
    unobserved: int = Field(
        default=0, ge=0, description="Rollouts (or tasks) on which it could not, for want of evidence."
    )
    missing: dict[str, int] = Field(
        default_factory=dict, description="Why it could not: the missing evidence, and how often (first 20)."
    )


class Percentiles(ArtifactModel):
    """Distribution summary; ``None`` when there was nothing to measure."""

    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None


class RunMetrics(ArtifactModel, VersionGate):
    """``metrics.json``: the summary of a run, rewritten atomically as the run progresses."""

    schema_version: Literal[2] = Field(default=SCHEMA_VERSION, description="Artifact format version.")
    dataset: str = Field(description="Path of the dataset.")
    tasks: int = Field(ge=0, description="Distinct task ids with at least one finished attempt.")
    rollouts: int = Field(ge=0, description="Finished attempts (records in rollouts.jsonl).")
    outcomes: dict[Outcome, int] = Field(
        description="Records per outcome (every outcome present, 0 if none)."
    )
    graded: int = Field(
        ge=0, description="Records that were graded and not masked (the reward metrics' base)."
    )
    masked: int = Field(default=0, ge=0, description="Graded records the environment masked (mask_sample).")
    failure_kinds: dict[str, int] = Field(
        default_factory=dict, description="Records per failure_kind the environment reported."
    )
    mean_reward: float | None = Field(description="Mean reward over graded records; None if none graded.")
    pass_at_1: float | None = Field(description="Mean over tasks of the fraction of samples that passed.")
    pass_at_k: float | None = Field(description="Unbiased pass@k over tasks, k = samples per task.")
    k: int = Field(ge=1, description="Samples per task (--attempts).")
    retries: int = Field(ge=0, description="Infrastructure retries made.")
    resumed_rollouts: int = Field(
        default=0, ge=0, description="Attempts that continued an earlier attempt from its journal."
    )
    model_calls_saved: int = Field(
        default=0, ge=0, description="Model calls resumed attempts answered from journals instead of sending."
    )
    invalid_rows: int = Field(default=0, ge=0, description="Dataset rows rejected as malformed.")
    tokens: TokenUsage = Field(default_factory=TokenUsage, description="Summed reported tokens.")
    tokens_partial: int = Field(
        default=0,
        ge=0,
        description="Rollouts whose token sums are partial or unobserved (RolloutMetrics.token_counts), so "
        "tokens undercounts by them.",
    )
    duration_s: Percentiles = Field(default_factory=Percentiles, description="Per-rollout wall time.")
    cpu_s: Percentiles = Field(
        default_factory=Percentiles,
        description="Per-rollout CPU time of the sandbox, over the rollouts where it was measured.",
    )
    peak_memory_bytes: Percentiles = Field(
        default_factory=Percentiles,
        description="Per-rollout peak memory of the sandbox, over the rollouts where it was measured.",
    )
    usage_mechanisms: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Rollouts per 'cpu:MECHANISM' and 'memory:MECHANISM' (cgroup2, cgroup1 or none): how cpu_s and "
            "peak_memory_bytes were measured (see RolloutUsage)."
        ),
    )
    wall_s: float = Field(default=0.0, description="Wall time of the run so far.")
    health: dict[str, HealthFinding] = Field(
        default_factory=dict, description="Health checks by stable name (NeMo Gym's where it has one)."
    )
    health_verdicts: dict[HealthVerdict, int] = Field(
        default_factory=dict, description="Rollouts per health verdict."
    )
