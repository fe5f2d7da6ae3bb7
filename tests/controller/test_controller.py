"""The scheduler against a fake supervisor: concurrency, retries, resume, stop, records, metrics."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import (
    EXIT_ALL_INFRA,
    EXIT_INTERRUPTED,
    EXIT_OK,
    HEALTH_CHECKS,
    Controller,
    LocalBackend,
    ModelEndpointConfig,
    NullReporter,
    RunConfig,
    RunSummary,
    rollout_id,
)
from rollcage.controller.testing import FakePlan, FakeSupervisor
from rollcage.errors import ConfigError, SupervisorError
from rollcage.protocol import RolloutRecord, RunMetrics, WorkerInput
from tests.helpers.paths import EXAMPLES


def write_rows(path: Path, rows: list[dict[str, Any] | str]) -> Path:
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def row(task_id: str, expected: str = "42", **extra: Any) -> dict[str, Any]:
    return {"id": task_id, "input": f"question {task_id}", "expected": expected, **extra}


def config(tmp_path: Path, dataset: Path, **overrides: Any) -> RunConfig:
    values: dict[str, Any] = {
        "dataset": dataset,
        "out": tmp_path / "out",
        "model": ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        "sandbox": "none",
        "retry_backoff_s": 0.0,
        "metrics_interval_s": 0.01,
        "concurrency": 4,
    }
    values.update(overrides)
    return RunConfig(**values)


async def run(cfg: RunConfig, fake: Any, stop: asyncio.Event | None = None) -> RunSummary:
    backend = LocalBackend(cfg.rollout_settings(), supervise=fake)
    return await Controller(cfg, backend=backend, stop=stop).run()


def records(out: Path) -> list[RolloutRecord]:
    path = out / "rollouts.jsonl"
    return [RolloutRecord.model_validate_json(line) for line in path.read_bytes().splitlines()]


def metrics(out: Path) -> RunMetrics:
    return RunMetrics.model_validate_json((out / "metrics.json").read_bytes())


async def test_every_sample_is_recorded_once_and_graded_outside(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b"), row("c", expected="7")])
    fake = FakeSupervisor({"a": "42", "b": "41", "c": "7"})
    cfg = config(tmp_path, dataset, attempts=2)
    summary = await run(cfg, fake)
    got = records(cfg.out)
    assert sorted((r.task_id, r.sample) for r in got) == [(t, s) for t in "abc" for s in (0, 1)]
    assert {r.task_id: r.reward for r in got} == {"a": 1.0, "b": 0.0, "c": 1.0}
    assert all(r.graded and r.grader == {"name": "exact", "match": r.reward == 1.0} for r in got)
    assert summary.exit_code == EXIT_OK
    m = metrics(cfg.out)
    assert m == summary.metrics.model_copy(update={"wall_s": m.wall_s})
    assert (m.tasks, m.rollouts, m.graded, m.k) == (3, 6, 6, 2)
    assert m.outcomes == {"completed": 6, "agent_error": 0, "timeout": 0, "cancelled": 0, "infra_failure": 0}
    assert m.mean_reward == pytest.approx(4 / 6)
    assert m.pass_at_1 == pytest.approx(2 / 3)
    assert m.pass_at_k == pytest.approx(2 / 3)
    assert m.tokens.total_tokens == 6 * 15


async def test_rollout_ids_and_directories_are_derived_from_task_sample_and_try(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("weird id/1")])
    fake = FakeSupervisor(outcomes={"weird id/1": ["infra_failure", "completed"]})
    cfg = config(tmp_path, dataset)
    await run(cfg, fake)
    got = records(cfg.out)
    assert [r.rollout_id for r in got] == [rollout_id("weird id/1", 0, 0), rollout_id("weird id/1", 0, 1)]
    assert [Path(r.rollout_dir) for r in got] == [cfg.out / "rollouts" / r.rollout_id for r in got]
    assert all((Path(r.rollout_dir) / "receipt.json").is_file() for r in got)


async def test_infra_failure_is_retried_in_a_new_directory_until_it_completes(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])
    fake = FakeSupervisor(
        {"a": "42", "b": "42"}, outcomes={"a": ["infra_failure", "infra_failure", "completed"]}
    )
    cfg = config(tmp_path, dataset, max_infra_retries=2)
    summary = await run(cfg, fake)
    got = [r for r in records(cfg.out) if r.task_id == "a"]
    assert [(r.try_index, r.outcome, r.graded) for r in got] == [
        (0, "infra_failure", False),
        (1, "infra_failure", False),
        (2, "completed", True),
    ]
    assert len({r.rollout_dir for r in got}) == 3
    assert summary.metrics.retries == 2
    assert summary.metrics.outcomes["infra_failure"] == 2
    assert summary.metrics.pass_at_1 == 1.0  # infrastructure failures never count against the policy


async def test_exhausted_infra_retries_end_the_sample_and_all_infra_exits_3(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a")])
    fake = FakeSupervisor(outcomes={"a": ["infra_failure"]})
    cfg = config(tmp_path, dataset, max_infra_retries=1)
    summary = await run(cfg, fake)
    assert [r.try_index for r in records(cfg.out)] == [0, 1]
    assert summary.exit_code == EXIT_ALL_INFRA
    assert summary.metrics.pass_at_1 is None
    again = await run(cfg, FakeSupervisor())
    assert again.attempts_run == 0  # exhausted is finished: a rerun does not retry it


async def test_supervisor_exception_becomes_a_retried_infra_failure(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a")])
    inner = FakeSupervisor({"a": "42"})
    calls = 0

    async def flaky(rollout_dir: Path, cfg: Any, *, stop: asyncio.Event | None = None) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise SupervisorError("cannot create the egress socket")
        return await inner(rollout_dir, cfg, stop=stop)

    cfg = config(tmp_path, dataset)
    await run(cfg, flaky)
    first, second = records(cfg.out)
    assert first.outcome == "infra_failure" and "egress socket" in first.receipt.outcome_reason
    assert (second.outcome, second.try_index, second.reward) == ("completed", 1, 1.0)


async def test_concurrency_bounds_rollouts_in_flight(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row(f"t{i}") for i in range(12)])
    fake = FakeSupervisor(delay_s=0.02)
    cfg = config(tmp_path, dataset, concurrency=3)
    await run(cfg, fake)
    assert fake.max_in_flight == 3
    assert len(records(cfg.out)) == 12


async def test_grading_follows_the_outcome_table(tmp_path: Path) -> None:
    rows = [row("done"), row("broke"), row("slow"), row("lost")]
    dataset = write_rows(tmp_path / "d.jsonl", rows)

    def plan(worker_input: WorkerInput, try_index: int) -> FakePlan:
        outcome = {"done": "completed", "broke": "agent_error", "slow": "timeout", "lost": "infra_failure"}
        return FakePlan(outcome=outcome[worker_input.task_id], answer="42")  # type: ignore[arg-type]

    cfg = config(tmp_path, dataset, max_infra_retries=0)
    await run(cfg, FakeSupervisor(plan=plan))
    graded = {r.task_id: (r.graded, r.reward) for r in records(cfg.out)}
    assert graded == {"done": (True, 1.0), "broke": (True, 1.0), "slow": (False, None), "lost": (False, None)}

    cfg2 = config(tmp_path, dataset, out=tmp_path / "out2", grade_timeouts=True, max_infra_retries=0)
    await run(cfg2, FakeSupervisor(plan=plan))
    assert {r.task_id: r.graded for r in records(cfg2.out)}["slow"] is True


async def test_controller_only_fields_stay_out_of_input_json(tmp_path: Path) -> None:
    canary = "CANARY-expected-7f3a"
    rows = [row("a", expected=canary, grader={"type": "regex", "pattern": "CANARY-pattern-91c2"})]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    cfg = config(tmp_path, dataset)
    await run(cfg, FakeSupervisor())
    (record,) = records(cfg.out)
    text = (Path(record.rollout_dir) / "input.json").read_text()
    assert canary not in text and "CANARY-pattern" not in text
    assert "expected" not in json.loads(text) and "grader" not in json.loads(text)


async def test_malformed_rows_are_named_by_line_and_the_others_run(tmp_path: Path) -> None:
    rows: list[dict[str, Any] | str] = [row("a"), "{not json", row("b"), {"id": "c"}, row("a")]
    dataset = write_rows(tmp_path / "d.jsonl", rows)
    cfg = config(tmp_path, dataset)
    summary = await run(cfg, FakeSupervisor({"a": "42", "b": "42"}))
    assert [(bad.line, bad.task_id) for bad in summary.invalid_rows] == [(2, None), (4, "c"), (5, "a")]
    assert "not valid JSON" in summary.invalid_rows[0].reason
    assert "input" in summary.invalid_rows[1].reason
    assert "duplicate id 'a' (first on line 1)" in summary.invalid_rows[2].reason
    assert sorted(r.task_id for r in records(cfg.out)) == ["a", "b"]
    assert metrics(cfg.out).invalid_rows == 3
    assert summary.exit_code == EXIT_OK


async def test_strict_stops_before_running_anything(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), "[1, 2]"])
    fake = FakeSupervisor()
    cfg = config(tmp_path, dataset, strict=True)
    with pytest.raises(ConfigError, match="line 2"):
        await run(cfg, fake)
    assert fake.calls == []
    assert not (cfg.out / "rollouts.jsonl").exists()


async def test_rerun_skips_finished_samples_and_runs_new_ones(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])
    cfg = config(tmp_path, dataset)
    await run(cfg, FakeSupervisor({"a": "42", "b": "42"}))
    write_rows(dataset, [row("a"), row("b"), row("c")])
    fake = FakeSupervisor({"c": "42"})
    summary = await run(cfg, fake)
    assert fake.calls == [rollout_id("c", 0, 0)]
    assert sorted(r.task_id for r in records(cfg.out)) == ["a", "b", "c"]
    assert summary.metrics.rollouts == 3 and summary.metrics.pass_at_1 == 1.0


async def test_torn_last_line_is_truncated_and_its_sample_rerun(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])
    cfg = config(tmp_path, dataset)
    await run(cfg, FakeSupervisor({"a": "42", "b": "42"}))
    log = cfg.out / "rollouts.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(lines[0] + lines[1][: len(lines[1]) // 2])  # a crash mid-append of the second
    torn_task = RolloutRecord.model_validate_json(lines[1]).task_id
    fake = FakeSupervisor({"a": "42", "b": "42"})
    await run(cfg, fake)
    assert fake.calls == [rollout_id(torn_task, 0, 0)]
    got = records(cfg.out)
    assert sorted(r.task_id for r in got) == ["a", "b"]
    assert (cfg.out / "interrupted").is_dir()  # the torn attempt's directory kept as evidence


async def test_damaged_line_before_the_end_stops_with_its_line_number(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])
    cfg = config(tmp_path, dataset)
    await run(cfg, FakeSupervisor())
    log = cfg.out / "rollouts.jsonl"
    lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(b'{"garbage": 1}\n' + lines[1])
    with pytest.raises(ConfigError, match="line 1 is damaged"):
        await run(cfg, FakeSupervisor())


async def test_stop_cancels_in_flight_rollouts_and_resume_reruns_them(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row(f"t{i}") for i in range(6)])
    stop = asyncio.Event()
    hanging = FakeSupervisor(plan=lambda wi, t: FakePlan(hang=True))
    cfg = config(tmp_path, dataset, concurrency=2)
    async with asyncio.TaskGroup() as group:
        job = group.create_task(run(cfg, hanging, stop))
        async with asyncio.timeout(10):
            await hanging.started.wait()
        stop.set()
    summary = job.result()
    assert summary.interrupted and summary.exit_code == EXIT_INTERRUPTED
    first = records(cfg.out)
    assert len(first) == 2 and {r.outcome for r in first} == {"cancelled"}
    assert all(not r.graded for r in first)

    fake = FakeSupervisor({f"t{i}": "42" for i in range(6)})
    again = await run(cfg, fake, asyncio.Event())
    assert again.exit_code == EXIT_OK
    done = [r for r in records(cfg.out) if r.outcome == "completed"]
    assert sorted(r.task_id for r in done) == [f"t{i}" for i in range(6)]
    cancelled_tasks = {r.task_id for r in first}
    assert {r.try_index for r in done if r.task_id in cancelled_tasks} == {1}


async def test_cancelling_the_run_leaves_a_consistent_log(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row(f"t{i}") for i in range(8)])
    fake = FakeSupervisor(plan=lambda wi, t: FakePlan(hang=wi.task_id != "t0", answer="42"))
    cfg = config(tmp_path, dataset, concurrency=3)
    recorded = asyncio.Event()
    reporter = NullReporter()
    reporter.record = lambda record, sample_done: recorded.set()  # type: ignore[method-assign]
    controller = Controller(
        cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=fake), reporter=reporter
    )
    task = asyncio.get_running_loop().create_task(controller.run())
    async with asyncio.timeout(10):
        await recorded.wait()
    await fake.wait_in_flight(3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    got = records(cfg.out)
    assert [r.task_id for r in got] == ["t0"]
    assert metrics(cfg.out).rollouts == 1
    assert controller.summary(interrupted=True).exit_code == EXIT_INTERRUPTED


async def test_a_second_controller_on_the_same_output_is_refused(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a")])
    cfg = config(tmp_path, dataset)
    fake = FakeSupervisor(plan=lambda wi, t: FakePlan(hang=True))
    stop = asyncio.Event()
    async with asyncio.TaskGroup() as group:
        job = group.create_task(run(cfg, fake, stop))
        async with asyncio.timeout(10):
            await fake.started.wait()
        with pytest.raises(ConfigError, match="another rollcage run"):
            await run(cfg, FakeSupervisor())
        stop.set()
    assert job.result().interrupted


async def test_health_findings_have_stable_names_and_count_unobserved_tokens(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])

    def plan(worker_input: WorkerInput, try_index: int) -> FakePlan:
        return FakePlan(answer="42" if worker_input.task_id == "a" else "", usage=None)

    cfg = config(tmp_path, dataset)
    summary = await run(cfg, FakeSupervisor(plan=plan))
    health = summary.metrics.health
    assert set(health) == set(HEALTH_CHECKS)  # every check, NeMo Gym's and rollcage's, 0 when clean
    missing = health["model_call_missing_token_counts"]
    assert (missing.count, missing.evaluated) == (2, 2)
    zero = health["model_call_zero_completion_tokens"]
    assert (zero.count, zero.evaluated) == (0, 2)  # unreported counts are neither healthy nor zero
    hollow = health["agent_turn_hollow"]
    assert (hollow.count, hollow.rollouts) == (1, [rollout_id("b", 0, 0)])
    # The fake runs without an egress proxy: the capture cannot be compared, and says why.
    capture = health["trajectory_capture_accounting"]
    assert (capture.evaluated, capture.unobserved, list(capture.missing)) == (
        0,
        2,
        ["no egress capture (the rollout ran without the proxy)"],
    )
    assert summary.metrics.tokens.total_tokens is None and summary.metrics.tokens_partial == 2
    assert summary.metrics.health_verdicts == {"healthy": 0, "unhealthy": 2, "unobserved": 0}


async def test_resume_reads_health_from_the_records_and_opens_no_rollout_directory(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])

    def plan(worker_input: WorkerInput, try_index: int) -> FakePlan:
        return FakePlan(answer="42" if worker_input.task_id == "a" else "", usage=None)

    cfg = config(tmp_path, dataset)
    first = await run(cfg, FakeSupervisor(plan=plan))
    shutil.rmtree(cfg.out / "rollouts")  # health computed once: the records carry it
    again = await run(cfg, FakeSupervisor(plan=plan))
    assert again.attempts_run == 0
    assert again.metrics.health == first.metrics.health
    assert again.metrics.health_verdicts == first.metrics.health_verdicts


async def test_resume_sweeps_the_temporary_files_a_killed_run_left(tmp_path: Path) -> None:
    dataset = write_rows(tmp_path / "d.jsonl", [row("a")])
    cfg = config(tmp_path, dataset)
    out = cfg.out
    # What a controller SIGKILLed mid-publish leaves: metrics.json's temporary file, and an unfinished
    # rollout directory (no record) with input.json's, which resume sets aside into interrupted/.
    unfinished = out / "rollouts" / rollout_id("a", 0, 0)
    earlier = out / "interrupted" / "b-s0-t0.20240101T000000Z"
    for directory in (unfinished, earlier):
        directory.mkdir(parents=True)
        (directory / "input.json").write_text("{}")
    leftovers = [
        out / ".metrics.json.0123456789abcdef.tmp",
        unfinished / ".input.json.fedcba9876543210.tmp",
        earlier / ".receipt.json.00112233445566aa.tmp",
    ]
    for path in leftovers:
        path.write_text("partial")
    kept = earlier / ".notes.tmp"  # not a name publish_json makes: left alone
    kept.write_text("mine")
    summary = await run(cfg, FakeSupervisor({"a": "42"}))
    assert summary.exit_code == EXIT_OK
    assert not any(path.exists() for path in leftovers)
    (moved,) = [p for p in (out / "interrupted").iterdir() if p.name.startswith(unfinished.name)]
    assert sorted(p.name for p in moved.iterdir()) == ["input.json"]
    assert sorted(p.name for p in earlier.iterdir()) == [".notes.tmp", "input.json"]


async def test_a_machine_that_cannot_sandbox_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    real_which = shutil.which

    def which(name: str, mode: int = 1, path: str | None = None) -> str | None:
        return None if name == "bwrap" else real_which(name, mode, path)

    monkeypatch.setattr(shutil, "which", which)
    dataset = write_rows(tmp_path / "d.jsonl", [row("a"), row("b")])
    cfg = config(tmp_path, dataset, sandbox="bwrap")
    with pytest.raises(ConfigError, match=r"bubblewrap \(bwrap\) is not installed"):
        await Controller(cfg).run()
    assert not cfg.out.exists(), "nothing may be written when the sandbox cannot run"


async def test_a_second_cancellation_while_the_servers_close_still_stops_the_policy_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    import httpx

    from rollcage.controller import EmbeddedPolicyConfig
    from rollcage.controller._servers import EnvironmentPool

    policy = EXAMPLES / "calc-weather" / "policy.yaml"
    dataset = write_rows(tmp_path / "d.jsonl", [row("t0")])
    cfg = config(tmp_path, dataset, model=EmbeddedPolicyConfig(script=policy))
    fake = FakeSupervisor(plan=lambda wi, t: FakePlan(hang=True))
    closing, release = threading.Event(), threading.Event()
    close = EnvironmentPool.close

    def slow_close(pool: EnvironmentPool) -> None:
        closing.set()
        release.wait(30)  # the environments take their time to stop
        close(pool)

    monkeypatch.setattr(EnvironmentPool, "close", slow_close)
    urls: list[str] = []
    reporter = NullReporter()
    reporter.notice = lambda line: urls.extend(line.split()[-1:] if "serving on" in line else [])  # type: ignore[method-assign]
    controller = Controller(
        cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=fake), reporter=reporter
    )
    task = asyncio.get_running_loop().create_task(controller.run())
    try:
        await fake.wait_in_flight(1)
        (base_url,) = urls
        task.cancel()  # the first Ctrl-C: the run winds down and starts closing its servers
        assert await asyncio.to_thread(closing.wait, 30)
        task.cancel()  # the second, while the environments close
    finally:
        release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient(trust_env=False) as client:
            await client.get(f"{base_url}/models", timeout=5)
