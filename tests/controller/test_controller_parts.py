"""Controller parts on their own: graders, workspace reading, pass@k, the record log."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from rollcage.controller import (
    ExactGrader,
    NormalizedGrader,
    NumericGrader,
    RecordLog,
    RegexGrader,
    load_records,
    pass_at_k,
)
from rollcage.controller._graders import grade_builtin, read_workspace_files, verify_remote
from rollcage.controller._ledger import RunLedger, percentiles
from rollcage.errors import ConfigError, DurableWriteError
from rollcage.protocol import RolloutHealth, RolloutRecord, RolloutUsage, SupervisorReceipt


@pytest.mark.parametrize(
    ("spec", "expected", "answer", "reward"),
    [
        (ExactGrader(), "cold;sum=42", " cold;sum=42\n", 1.0),
        (ExactGrader(), "cold;sum=42", "Cold;sum=42", 0.0),
        (ExactGrader(), ["4", "four"], "four", 1.0),
        (NormalizedGrader(), "The  Answer.", "the answer", 1.0),
        (NumericGrader(), 42, "so it is 41.9999999", 1.0),
        (NumericGrader(), "1,000", "about 1,000", 1.0),
        (NumericGrader(tolerance=0.01, relative=True), 200, "201", 1.0),
        (NumericGrader(), 42, "no idea", 0.0),
        (RegexGrader(pattern=r"sum=\d+"), None, "cold;sum=42", 1.0),
        (RegexGrader(ignore_case=True), "COLD", "cold;sum=42", 1.0),
    ],
)
def test_builtin_graders(spec: object, expected: object, answer: str, reward: float) -> None:
    assert grade_builtin(spec, expected=expected, answer=answer).reward == reward  # type: ignore[arg-type]


def test_grader_that_cannot_grade_gives_no_reward_and_says_why() -> None:
    result = grade_builtin(NumericGrader(), expected="many", answer="3")
    assert result.reward is None and result.as_record() == {"name": "numeric", "error": result.error}
    assert grade_builtin(RegexGrader(pattern="(", ignore_case=False), expected=None, answer="").reward is None


async def test_unreachable_verify_endpoint_is_an_error_not_a_zero() -> None:
    result = await verify_remote("http://127.0.0.1:9", token=None, payload=b"{}", timeout_s=2)
    assert result.reward is None and result.error is not None and "verify request failed" in result.error


def test_workspace_reading_never_follows_links_or_blocks(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "sub").mkdir(parents=True)
    (workspace / "solution.py").write_text("ok")
    (workspace / "sub" / "x.py").write_text("nested")
    secret = tmp_path / "secret"
    secret.write_text("controller secret")
    (workspace / "link.py").symlink_to(secret)
    (workspace / "dirlink").symlink_to(tmp_path)
    os.mkfifo(workspace / "fifo.py")
    (workspace / "big.py").write_bytes(b"x" * (300 * 1024))
    names = [
        "solution.py",
        "sub/x.py",
        "link.py",
        "dirlink/secret",
        "fifo.py",
        "big.py",
        "../secret",
        "/etc/passwd",
    ]
    started = time.monotonic()
    assert read_workspace_files(str(workspace), names) == {"solution.py": "ok", "sub/x.py": "nested"}
    assert time.monotonic() - started < 2


def test_pass_at_k_is_unbiased() -> None:
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(2, 1, 4) == 1.0  # fewer samples than k


def test_percentiles_nearest_rank() -> None:
    p = percentiles([float(v) for v in range(1, 101)])
    assert (p.p50, p.p90, p.p99, p.max, p.mean) == (50.0, 90.0, 99.0, 100.0, 50.5)
    assert percentiles([]).p50 is None


def record(rollout_id: str) -> RolloutRecord:
    now = time.time()
    receipt = SupervisorReceipt(
        rollout_id=rollout_id,
        outcome="completed",
        outcome_reason="ok",
        sandbox="none",
        deadline_s=1,
        grace_s=1,
        deadline_fired=False,
        stop_requested=False,
        started_at=now,
        ended_at=now,
        duration_s=0.0,
        cleanup_confirmed=True,
        result_present=True,
        result_valid=True,
    )
    return RolloutRecord(
        rollout_id=rollout_id,
        task_id=rollout_id,
        sample=0,
        try_index=0,
        outcome="completed",
        graded=False,
        reward=None,
        receipt=receipt,
        health=RolloutHealth(verdict="healthy"),
        rollout_dir="/x",
    )


def test_metrics_carry_each_rollouts_cpu_and_peak_memory_and_how_they_were_measured() -> None:
    ledger = RunLedger(dataset="d", k=1, max_infra_retries=0)
    usages = [
        RolloutUsage(
            cpu_s=0.2, cpu_mechanism="cgroup1", peak_memory_bytes=30 << 20, memory_mechanism="cgroup1"
        ),
        RolloutUsage(
            cpu_s=0.4, cpu_mechanism="cgroup1", peak_memory_bytes=50 << 20, memory_mechanism="cgroup1"
        ),
        RolloutUsage(cpu_s=None, cpu_mechanism="none", peak_memory_bytes=None, memory_mechanism="none"),
        None,  # a record from before the field, or without a sandbox
    ]
    for index, usage in enumerate(usages):
        base = record(f"r{index}")
        ledger.add(base.model_copy(update={"receipt": base.receipt.model_copy(update={"usage": usage})}))
    metrics = ledger.snapshot(1.0)
    assert (metrics.cpu_s.mean, metrics.cpu_s.max) == (pytest.approx(0.3), 0.4)
    assert (metrics.peak_memory_bytes.p50, metrics.peak_memory_bytes.max) == (30 << 20, 50 << 20)
    assert metrics.usage_mechanisms == {
        "cpu:cgroup1": 2,
        "memory:cgroup1": 2,
        "cpu:none": 1,
        "memory:none": 1,
    }


async def test_record_log_appends_whole_lines_in_order(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    async with RecordLog(path) as log:
        for i in range(5):
            await log.append(record(f"r{i}"))
    seen: list[str] = []
    report = load_records(path, lambda r: seen.append(r.rollout_id))
    assert seen == [f"r{i}" for i in range(5)] and report.repaired_bytes == 0


async def test_record_log_group_commits_records_that_arrive_during_a_sync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nine records handed in while the first one's fsync runs share the next fsync, in order,
    and none of them is acknowledged before that fsync has returned."""
    path = tmp_path / "rollouts.jsonl"
    real_fsync = os.fsync
    entered, gate = threading.Event(), threading.Event()
    syncs: list[int] = []  # the file's size at each fsync of the log

    def gated_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            entered.set()
            assert gate.wait(60)
            syncs.append(os.fstat(fd).st_size)
        real_fsync(fd)

    async with RecordLog(path) as log:
        monkeypatch.setattr(os, "fsync", gated_fsync)
        first = asyncio.ensure_future(log.append(record("r0")))
        assert await asyncio.to_thread(entered.wait, 60)
        rest = [asyncio.ensure_future(log.append(record(f"r{i}"))) for i in range(1, 10)]
        await asyncio.sleep(0)  # one turn of the loop: each new append runs until it waits for the lock
        assert not any(task.done() for task in [first, *rest])  # nothing acknowledged before its sync
        gate.set()
        async with asyncio.timeout(60):
            await asyncio.gather(first, *rest)
    assert len(syncs) == 2 and syncs[-1] == path.stat().st_size
    seen: list[str] = []
    load_records(path, lambda r: seen.append(r.rollout_id))
    assert seen == [f"r{i}" for i in range(10)]


async def test_record_log_withdraws_a_cancelled_record_still_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rollouts.jsonl"
    real_fsync = os.fsync
    entered, gate = threading.Event(), threading.Event()

    def gated_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            entered.set()
            assert gate.wait(60)
        real_fsync(fd)

    async with RecordLog(path) as log:
        monkeypatch.setattr(os, "fsync", gated_fsync)
        first = asyncio.ensure_future(log.append(record("r0")))
        assert await asyncio.to_thread(entered.wait, 60)
        waiting = asyncio.ensure_future(log.append(record("r1")))
        kept = asyncio.ensure_future(log.append(record("r2")))
        await asyncio.sleep(0)  # one turn of the loop: both wait for the lock
        waiting.cancel()
        gate.set()
        async with asyncio.timeout(60):
            await asyncio.gather(first, kept)
        with pytest.raises(asyncio.CancelledError):
            await waiting
    seen: list[str] = []
    load_records(path, lambda r: seen.append(r.rollout_id))
    assert seen == ["r0", "r2"]


@pytest.mark.parametrize("tail", [b'{"schema_version": 1, "rollout', b"\x00\x00\x00\n"])
def test_torn_tail_is_truncated_and_reported(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "rollouts.jsonl"
    good = record("r0").model_dump_json().encode() + b"\n"
    path.write_bytes(good + tail)
    report = load_records(path, lambda r: None)
    assert (report.records, report.repaired_bytes) == (1, len(tail))
    assert path.read_bytes() == good


def test_damage_before_the_last_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    good = record("r0").model_dump_json().encode() + b"\n"
    path.write_bytes(good + b"junk\n" + good)
    with pytest.raises(ConfigError, match="line 2 is damaged"):
        load_records(path, lambda r: None)
    assert path.read_bytes() == good + b"junk\n" + good  # nothing was changed


async def test_failed_append_takes_back_its_partial_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "rollouts.jsonl"
    async with RecordLog(path) as log:
        await log.append(record("r0"))
        real_write = os.write

        def half_then_fail(fd: int, data: bytes | memoryview) -> int:
            if len(data) > 10:
                real_write(fd, bytes(data[:10]))
                raise OSError(28, "No space left on device")
            return real_write(fd, data)

        monkeypatch.setattr(os, "write", half_then_fail)
        with pytest.raises(DurableWriteError, match="disk full"):
            await log.append(record("r1"))
        monkeypatch.undo()
        await log.append(record("r2"))
    seen: list[str] = []
    assert load_records(path, lambda r: seen.append(r.rollout_id)).repaired_bytes == 0
    assert seen == ["r0", "r2"]


async def test_record_log_cancelled_while_opening_closes_what_its_thread_opened(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    log = RecordLog(path)
    entered, release = threading.Event(), threading.Event()
    opened: list[int] = []
    real_open = log._open

    def slow_open() -> int:
        entered.set()
        release.wait(60)
        opened.append(real_open())
        return opened[0]

    log._open = slow_open  # type: ignore[method-assign]
    opening = asyncio.ensure_future(log.__aenter__())
    assert await asyncio.to_thread(entered.wait, 60)
    opening.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert not _fd_names(opened[0], path)


def _fd_names(fd: int, path: Path) -> bool:
    """Whether descriptor ``fd`` of this process is open on ``path``."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == str(path)
    except FileNotFoundError:
        return False


def test_a_stale_rollout_directory_that_cannot_be_moved_is_kept_never_deleted(
    tiny_tmpfs: Path, tmp_path: Path
) -> None:
    # A mount point cannot be renamed (EBUSY): the stale directory must survive, journal and all.
    from rollcage.controller._unit import set_aside

    (tiny_tmpfs / "checkpoint.jsonl").write_text('{"seq": 1}\n')
    with pytest.raises(DurableWriteError, match=r"cannot set aside .*tiny.*move it out of the run directory"):
        set_aside(tiny_tmpfs, tmp_path / "interrupted")
    assert (tiny_tmpfs / "checkpoint.jsonl").read_text() == '{"seq": 1}\n'
