"""The run's ledger: what each sample has done (for resume) and the metrics folded from it.

Everything here is folded from ``RolloutRecord``s one at a time, in log order, so
the controller's memory holds a few numbers per sample and never the records.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import get_args

from rollcage.controller._graders import reward_problem
from rollcage.controller._health import HEALTH_CHECKS, TASK_CHECKS, nemo_verdict
from rollcage.protocol import (
    HealthFinding,
    HealthVerdict,
    Outcome,
    Percentiles,
    RolloutHealth,
    RolloutRecord,
    RunMetrics,
    TokenUsage,
)

__all__ = ["FINAL_OUTCOMES", "RunLedger", "SampleState", "pass_at_k"]

FINAL_OUTCOMES: frozenset[Outcome] = frozenset({"completed", "agent_error", "timeout"})
"""Outcomes that end a sample for good: the policy's result, whatever it is."""

_OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
_MAX_IDS = 100
_MAX_REASONS = 20
_ROLLOUT_CHECKS = tuple(name for name in HEALTH_CHECKS if name not in TASK_CHECKS)


@dataclass(slots=True)
class SampleState:
    """One sample of one task, as far as the log says.

    Attributes:
        tries: Attempts recorded (the next attempt's try index).
        infra_failures: Of those, how many ended ``infra_failure``.
        last_outcome: Outcome of the latest attempt; ``None``: never attempted.
        graded: The latest attempt was graded (a reward exists).
        reward: Its reward.
        grader_failed: The outcome allowed grading but the grader could not grade.
        masked: The latest attempt was masked by its environment (left out of reward metrics).
        verdict: The latest attempt's health verdict.
        nemo_verdict: Its verdict over NeMo Gym's checks only, as NeMo Gym gives it (for its task checks).
        answered_calls: Its answered model calls; ``None``: unobserved (no valid result).
    """

    tries: int = 0
    infra_failures: int = 0
    last_outcome: Outcome | None = None
    graded: bool = False
    reward: float | None = None
    grader_failed: bool = False
    masked: bool = False
    verdict: HealthVerdict = "unobserved"
    nemo_verdict: HealthVerdict = "unobserved"
    answered_calls: int | None = None


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: ``1 - C(n-c, k) / C(n, k)`` (Chen et al., 2021).

    With fewer samples than ``k`` it is 1.0 when any passed, else 0.0.
    """
    if c <= 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class _Tally:
    """One check's counts over the run."""

    count: int = 0
    ids: list[str] = field(default_factory=list)
    evaluated: int = 0
    unobserved: int = 0
    missing: dict[str, int] = field(default_factory=dict)

    def add(self, ident: str, count: int) -> None:
        self.evaluated += 1
        if count <= 0:
            return
        self.count += count
        if len(self.ids) < _MAX_IDS:
            self.ids.append(ident)

    def lack(self, reason: str) -> None:
        self.unobserved += 1
        if reason in self.missing or len(self.missing) < _MAX_REASONS:
            self.missing[reason] = self.missing.get(reason, 0) + 1

    def finding(self, detail: str) -> HealthFinding:
        return HealthFinding(
            count=self.count,
            rollouts=list(self.ids),
            detail=detail,
            evaluated=self.evaluated,
            unobserved=self.unobserved,
            missing=dict(self.missing),
        )


class RunLedger:
    """Per-sample state and running metrics of one output directory."""

    def __init__(self, *, dataset: str, k: int, max_infra_retries: int, pass_threshold: float = 1.0) -> None:
        """Start empty.

        Args:
            dataset: Dataset path, as metrics.json shows it.
            k: Samples per task (``--attempts``).
            max_infra_retries: Retries of an ``infra_failure`` per sample.
            pass_threshold: A graded sample passes when its reward is at least this.
        """
        self.dataset = dataset
        self.k = k
        self.max_infra_retries = max_infra_retries
        self.pass_threshold = pass_threshold
        self._samples: dict[tuple[str, int], SampleState] = {}
        self._model_success: set[str] = set()
        self._unfailed_calls: set[str] = set()
        self._outcomes: dict[Outcome, int] = dict.fromkeys(_OUTCOMES, 0)
        self._graded = 0
        self._masked = 0
        self._failure_kinds: dict[str, int] = {}
        self._grader_errors = 0
        self._reward_sum = 0.0
        self._retries = 0
        self._resumed = 0
        self._calls_saved = 0
        self._tokens: list[int | None] = [None, None, None]
        self._tokens_partial = 0
        self._durations = array("d")
        self._cpu_s = array("d")
        self._peak_memory = array("d")
        self._mechanisms: dict[str, int] = {}
        self._health: dict[str, _Tally] = {name: _Tally() for name in _ROLLOUT_CHECKS}
        self._verdicts: dict[HealthVerdict, int] = {"healthy": 0, "unhealthy": 0, "unobserved": 0}
        self._copies: dict[str, int] = {}
        self.invalid_rows = 0
        self.rollouts = 0

    # ------------------------------------------------------------------ resume

    def state(self, task_id: str, sample: int) -> SampleState:
        """The sample's state (a fresh one if it has no record)."""
        return self._samples.get((task_id, sample)) or SampleState()

    def is_done(self, task_id: str, sample: int) -> bool:
        """Whether the sample needs no further attempt.

        Done: a final outcome (completed, agent_error, timeout), or infrastructure
        failures beyond the retry budget. Not done: no record, ``cancelled`` (rerun on
        resume) or an ``infra_failure`` with budget left.
        """
        state = self._samples.get((task_id, sample))
        if state is None or state.last_outcome is None:
            return False
        if state.last_outcome in FINAL_OUTCOMES:
            return True
        return state.last_outcome == "infra_failure" and state.infra_failures > self.max_infra_retries

    def next_try(self, task_id: str, sample: int) -> int:
        """The try index of the sample's next attempt."""
        return self.state(task_id, sample).tries

    # ------------------------------------------------------------------ folding

    def add(self, record: RolloutRecord) -> SampleState:
        """Fold one record (in log order), its health included; return the sample's new state."""
        key = (record.task_id, record.sample)
        state = self._samples.get(key)
        if state is None:
            state = self._samples[key] = SampleState()
        if record.try_index > 0 and state.last_outcome == "infra_failure":
            self._retries += 1
        state.tries = max(state.tries, record.try_index + 1)
        state.last_outcome = record.outcome
        if record.outcome == "infra_failure":
            state.infra_failures += 1
        # A reward no grader may give any more (not finite, beyond REWARD_LIMIT: a record of an older run,
        # or an edited one) is read as the grader failing, so no aggregate can overflow on it.
        sensible = record.reward is None or reward_problem(record.reward) is None
        state.graded = record.graded and record.reward is not None and sensible
        state.reward = record.reward if state.graded else None
        state.grader_failed = (record.grader is not None and "error" in record.grader) or not sensible
        state.masked = state.graded and record.masked
        health = self._identity_checked(record.rollout_id, record.health)
        state.verdict = health.verdict
        state.nemo_verdict = nemo_verdict(health)
        state.answered_calls = record.health.successful_model_calls

        self.rollouts += 1
        if record.resume is not None and record.resume.resumed:
            self._resumed += 1
        self._calls_saved += record.metrics.replayed_model_calls
        self._outcomes[record.outcome] += 1
        if state.masked:
            self._masked += 1
        elif state.graded and record.reward is not None:
            self._graded += 1
            self._reward_sum += record.reward
        if state.grader_failed:
            self._grader_errors += 1
        if record.failure_kind is not None and (
            record.failure_kind in self._failure_kinds or len(self._failure_kinds) < _MAX_IDS
        ):
            self._failure_kinds[record.failure_kind] = self._failure_kinds.get(record.failure_kind, 0) + 1
        m = record.metrics
        for index, value in enumerate((m.input_tokens, m.output_tokens, m.total_tokens)):
            if value is not None:
                self._tokens[index] = (self._tokens[index] or 0) + value
        if m.token_counts != "complete":
            self._tokens_partial += 1
        self._durations.append(record.receipt.duration_s)
        usage = record.receipt.usage
        if usage is not None:
            if usage.cpu_s is not None:
                self._cpu_s.append(usage.cpu_s)
            if usage.peak_memory_bytes is not None:
                self._peak_memory.append(usage.peak_memory_bytes)
            for name in (f"cpu:{usage.cpu_mechanism}", f"memory:{usage.memory_mechanism}"):
                self._mechanisms[name] = self._mechanisms.get(name, 0) + 1
        if record.health.successful_model_calls:
            self._model_success.add(record.task_id)
        unfailed = record.health.unfailed_model_calls
        if unfailed if unfailed is not None else record.health.successful_model_calls:
            self._unfailed_calls.add(record.task_id)
        if not sensible and not health.findings.get("grader_error"):
            health = health.model_copy(update={"findings": {**health.findings, "grader_error": 1}})
        self._fold_health(record.rollout_id, health)
        return state

    def _identity_checked(self, rollout_id: str, health: RolloutHealth) -> RolloutHealth:
        """NeMo Gym's ``rollout_duplicate_identity``: every record of an attempt another record claims too.

        The log is read in order, so the second copy counts the first as well (NeMo Gym
        flags each copy); a copy is unhealthy.
        """
        copies = self._copies[rollout_id] = self._copies.get(rollout_id, 0) + 1
        if copies < 2:
            return health
        findings = {**health.findings, "rollout_duplicate_identity": 2 if copies == 2 else 1}
        return health.model_copy(update={"findings": findings, "verdict": "unhealthy"})

    def _fold_health(self, rollout_id: str, health: RolloutHealth) -> None:
        self._verdicts[health.verdict] += 1
        for name, tally in self._health.items():
            reason = health.unobserved.get(name)
            if reason is not None:
                tally.lack(reason)
            else:
                tally.add(rollout_id, health.findings.get(name, 0))

    # ------------------------------------------------------------------ reading

    @property
    def outcomes(self) -> dict[Outcome, int]:
        """Records per outcome so far."""
        return dict(self._outcomes)

    def all_infra_failures(self) -> bool:
        """True when at least one sample ended and every ended sample ended in ``infra_failure``."""
        ended = [s.last_outcome for s in self._samples.values() if s.last_outcome not in (None, "cancelled")]
        return bool(ended) and all(o == "infra_failure" for o in ended)

    def all_grader_errors(self) -> bool:
        """True when rollouts were up for grading and the grader failed on every one of them."""
        return self._grader_errors > 0 and self._graded == 0 and self._masked == 0

    def _pass_rates(self) -> tuple[float | None, float | None]:
        # pass@k counts samples whose result is the policy's: final outcomes whose
        # grading did not fail. Infrastructure-exhausted samples, grader failures and
        # masked samples are left out rather than counted as the policy failing.
        per_task: dict[str, list[int]] = {}
        for (task_id, _), state in self._samples.items():
            if state.last_outcome not in FINAL_OUTCOMES or state.grader_failed or state.masked:
                continue
            counts = per_task.setdefault(task_id, [0, 0])
            counts[0] += 1
            if state.graded and state.reward is not None and state.reward >= self.pass_threshold:
                counts[1] += 1
        if not per_task:
            return None, None
        p1 = sum(c / n for n, c in per_task.values()) / len(per_task)
        pk = sum(pass_at_k(n, c, self.k) for n, c in per_task.values()) / len(per_task)
        return p1, pk

    def snapshot(self, wall_s: float) -> RunMetrics:
        """The metrics so far, as ``metrics.json`` holds them."""
        pass1, passk = self._pass_rates()
        health = {name: tally.finding(HEALTH_CHECKS[name].detail) for name, tally in self._health.items()}
        health.update(self._task_health())
        i, o, t = self._tokens
        return RunMetrics(
            dataset=self.dataset,
            tasks=len({task for task, _ in self._samples}),
            rollouts=self.rollouts,
            outcomes=dict(self._outcomes),
            graded=self._graded,
            masked=self._masked,
            failure_kinds=dict(self._failure_kinds),
            mean_reward=self._reward_sum / self._graded if self._graded else None,  # |reward| <= REWARD_LIMIT
            pass_at_1=pass1,
            pass_at_k=passk,
            k=self.k,
            retries=self._retries,
            resumed_rollouts=self._resumed,
            model_calls_saved=self._calls_saved,
            invalid_rows=self.invalid_rows,
            tokens=TokenUsage(input_tokens=i, output_tokens=o, total_tokens=t),
            tokens_partial=self._tokens_partial,
            duration_s=percentiles(self._durations),
            cpu_s=percentiles(self._cpu_s),
            peak_memory_bytes=percentiles(self._peak_memory),
            usage_mechanisms=dict(self._mechanisms),
            wall_s=wall_s,
            health=health,
            health_verdicts=dict(self._verdicts),
        )

    def _task_health(self) -> dict[str, HealthFinding]:
        """The task checks, over each task's repeats (the latest attempt of each sample)."""
        repeats: dict[str, list[SampleState]] = {}
        for (task_id, _), state in self._samples.items():
            repeats.setdefault(task_id, []).append(state)
        no_success, no_answer, unhealthy = _Tally(), _Tally(), _Tally()
        for task_id, states in repeats.items():
            observed = all(state.answered_calls is not None for state in states)
            for tally, succeeded in ((no_success, self._unfailed_calls), (no_answer, self._model_success)):
                if task_id in succeeded:
                    tally.add(task_id, 0)
                elif observed:
                    tally.add(task_id, 1)
                else:
                    tally.lack("a repeat has no valid result.json")
            # NeMo Gym's rule, over its own checks' verdicts (rollcage's own checks do not count here).
            computable = [state for state in states if state.nemo_verdict != "unobserved"]
            if len(computable) < 2:
                unhealthy.lack("fewer than two repeats with a computable verdict")
            else:
                unhealthy.add(task_id, int(all(state.nemo_verdict == "unhealthy" for state in computable)))
        return {
            "task_no_successful_model_calls": no_success.finding(
                HEALTH_CHECKS["task_no_successful_model_calls"].detail
            ),
            "task_no_answered_model_calls": no_answer.finding(
                HEALTH_CHECKS["task_no_answered_model_calls"].detail
            ),
            "task_consistently_unhealthy": unhealthy.finding(
                HEALTH_CHECKS["task_consistently_unhealthy"].detail
            ),
        }


def percentiles(values: Iterable[float]) -> Percentiles:
    """Mean, p50, p90, p99 and max (nearest rank); all ``None`` when empty."""
    ordered = sorted(values)
    if not ordered:
        return Percentiles()

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return Percentiles(mean=_mean(ordered), p50=rank(0.5), p90=rank(0.9), p99=rank(0.99), max=ordered[-1])


def _mean(values: list[float]) -> float:
    """The mean of finite values, which cannot overflow (``sum`` of two 1e308s is infinity)."""
    count = len(values)
    return math.fsum(value / count for value in values)
