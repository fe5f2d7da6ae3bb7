"""Tests of rollcage.durable: atomic publication and the checkpoint journal.

Real files, real processes, a real full disk. Failures are injected by wrapping
``os`` functions so that they fail only for files inside the test's directory.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import BaseModel

from rollcage.durable import (
    CheckpointJournal,
    JournalState,
    fsync_directory,
    is_temp_artifact,
    publish_bytes,
    publish_json,
    read_journal,
)
from rollcage.errors import DurableWriteError, JournalCorruptError
from tests.helpers.paths import HELPERS

HELPER = HELPERS / "durable_child.py"
LOGGER = "rollcage.durable"


# --------------------------------------------------------------------------- helpers


def listing(directory: Path) -> list[str]:
    """Every name in the directory: a leaked temporary file cannot hide from this."""
    return sorted(os.listdir(directory))


def fd_inside(directory: Path, fd: int) -> bool:
    """Whether a file descriptor refers to ``directory`` or something in it."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    return target == str(directory) or target.startswith(f"{directory}/")


def failing_for(directory: Path, real: Callable[..., Any], exc: OSError) -> Callable[..., Any]:
    """A wrapper of an fd-taking os function that fails for files in ``directory`` only."""

    def wrapper(fd: int, *args: Any) -> Any:
        if fd_inside(directory, fd):
            raise exc
        return real(fd, *args)

    return wrapper


def journal_lines(path: Path) -> list[bytes]:
    """The raw lines of a journal file; a trailing fragment without newline shows as a last item."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    assert lines[-1] == b"" or data == b"", f"journal ends in a fragment: {lines[-1][:80]!r}"
    return [line + b"\n" for line in lines[:-1]]


def line_for(seq: int, record: dict[str, Any]) -> bytes:
    """The line the journal must write for a record (the documented format)."""
    body = orjson.dumps({"seq": seq, **record})
    return body[:-1] + b',"crc32":"%08x"}\n' % zlib.crc32(body)


class Sample(BaseModel):
    """A small artifact model."""

    name: str
    values: list[int]


@pytest.fixture
def result_path(tmp_path: Path) -> Path:
    """A directory holding only an old result.json."""
    directory = tmp_path / "rollout"
    directory.mkdir()
    path = directory / "result.json"
    publish_json(path, {"old": True})
    return path


# --------------------------------------------------------------------------- publish_json


def test_publish_writes_model_and_leaves_only_the_target(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    publish_json(path, Sample(name="a", values=[1, 2]))
    assert Sample.model_validate_json(path.read_bytes()) == Sample(name="a", values=[1, 2])
    assert listing(tmp_path) == ["result.json"]


def test_publish_serialises_plain_values_and_nested_models(tmp_path: Path) -> None:
    path = tmp_path / "value.json"
    publish_json(str(path), {"items": [Sample(name="n", values=[])], "x": 1.5})
    assert orjson.loads(path.read_bytes()) == {"items": [{"name": "n", "values": []}], "x": 1.5}


def test_publish_replaces_previous_value(result_path: Path) -> None:
    publish_json(result_path, {"new": 1})
    assert orjson.loads(result_path.read_bytes()) == {"new": 1}
    assert listing(result_path.parent) == ["result.json"]


@pytest.mark.parametrize(
    ("function", "error"),
    [
        ("write", OSError(errno.ENOSPC, "No space left on device")),
        ("fchmod", OSError(errno.EPERM, "Operation not permitted")),
        ("fsync", OSError(errno.EIO, "Input/output error")),
    ],
)
def test_publish_failure_keeps_old_content_and_removes_temp(
    result_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, error: OSError
) -> None:
    monkeypatch.setattr(os, function, failing_for(result_path.parent, getattr(os, function), error))
    with pytest.raises(DurableWriteError, match=r"result\.json") as caught:
        publish_json(result_path, {"new": "x" * 10_000})
    assert caught.value.__cause__ is error
    assert caught.value.errno == error.errno
    assert orjson.loads(result_path.read_bytes()) == {"old": True}
    assert listing(result_path.parent) == ["result.json"]


def test_publish_failing_rename_keeps_old_content_and_removes_temp(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    error = OSError(errno.EXDEV, "Invalid cross-device link")

    def failing_replace(src: str, dst: str) -> None:
        raise error

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(DurableWriteError, match=r"result\.json") as caught:
        publish_json(result_path, {"new": 1})
    assert caught.value.__cause__ is error
    assert orjson.loads(result_path.read_bytes()) == {"old": True}
    assert listing(result_path.parent) == ["result.json"]


def test_publish_unserialisable_value_keeps_old_content(result_path: Path) -> None:
    with pytest.raises(DurableWriteError, match="not serialisable") as caught:
        publish_json(result_path, {"new": object()})
    assert isinstance(caught.value.__cause__, TypeError)
    assert orjson.loads(result_path.read_bytes()) == {"old": True}
    assert listing(result_path.parent) == ["result.json"]


def test_publish_interrupted_by_keyboard_interrupt_removes_temp(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def interrupted(fd: int) -> None:
        if fd_inside(result_path.parent, fd):
            raise KeyboardInterrupt
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        publish_json(result_path, {"new": 1})
    assert orjson.loads(result_path.read_bytes()) == {"old": True}
    assert listing(result_path.parent) == ["result.json"]


def test_publish_syncs_file_before_rename_and_directory_after(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append("fsync dir" if target == str(result_path.parent) else f"fsync {Path(target).name}")
        real_fsync(fd)

    def spy_replace(src: str, dst: str) -> None:
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    publish_json(result_path, {"new": 1})
    assert len(events) == 3, events
    assert is_temp_artifact(events[0].removeprefix("fsync ")), events
    assert events[1:] == ["replace", "fsync dir"]


def test_publish_without_directory_sync_leaves_that_sync_to_the_caller(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two files published into one directory share one directory sync, after both are in place."""
    events: list[str] = []
    real_fsync = os.fsync

    def spy_fsync(fd: int) -> None:
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append("fsync dir" if target == str(result_path.parent) else f"fsync {Path(target).name}")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    publish_json(result_path, {"new": 1}, sync_directory=False)
    publish_bytes(result_path.parent / "receipt.json", b"{}\n", sync_directory=False)
    assert len(events) == 2 and "fsync dir" not in events, events
    fsync_directory(result_path.parent)
    assert events[-1] == "fsync dir"
    assert listing(result_path.parent) == ["receipt.json", "result.json"]
    assert orjson.loads(result_path.read_bytes()) == {"new": 1}


def test_publish_directory_sync_failure_is_reported(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_fsync = os.fsync

    def failing_dir_fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}") == str(result_path.parent):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", failing_dir_fsync)
    with pytest.raises(DurableWriteError, match="may not survive a crash"):
        publish_json(result_path, {"new": 1})
    assert listing(result_path.parent) == ["result.json"]


def test_publish_temp_names_are_recognised_by_is_temp_artifact(
    result_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []

    def failing_replace(src: str, dst: str) -> None:
        seen.append(os.path.basename(src))
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "replace", failing_replace)
    for _ in range(2):
        with pytest.raises(DurableWriteError):
            publish_json(result_path, {"new": 1})
    assert len(set(seen)) == 2, "temporary names must be unique per call"
    assert all(name.startswith(".result.json.") and is_temp_artifact(name) for name in seen), seen
    assert is_temp_artifact(str(result_path.parent / seen[0]))
    for name in (
        "result.json",
        ".result.json",
        "result.json.tmp",
        ".result.json.xyz.tmp",
        "checkpoint.jsonl",
    ):
        assert not is_temp_artifact(name), name


@pytest.mark.parametrize("umask", [0o077, 0o000])
def test_publish_mode_is_exact_regardless_of_umask(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        publish_json(tmp_path / "shared.json", {"a": 1}, mode=0o640)
        publish_json(tmp_path / "private.json", {"a": 1})
    finally:
        os.umask(previous)
    assert (tmp_path / "shared.json").stat().st_mode & 0o7777 == 0o640
    assert (tmp_path / "private.json").stat().st_mode & 0o7777 == 0o600


def test_publish_rejects_a_mode_that_is_not_a_permission_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mode"):
        publish_json(tmp_path / "x.json", {}, mode=0o100000)
    assert listing(tmp_path) == []


def _values_written(writers: int, per_writer: int) -> dict[tuple[int, int], int]:
    return {(w, i): (w * 7919 + i * 104_729) % 20_000 for w in range(writers) for i in range(per_writer)}


def assert_one_complete_value(path: Path, expected: dict[tuple[int, int], int]) -> None:
    value = orjson.loads(path.read_bytes())
    key = (value["writer"], value["i"])
    assert key in expected
    assert value["size"] == expected[key] == len(value["pad"])
    assert listing(path.parent) == [path.name]


def test_concurrent_publishes_from_threads_leave_one_complete_value(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    expected = _values_written(200, 1)

    def publish(writer: int) -> None:
        pad = "p" * expected[(writer, 0)]
        publish_json(path, {"writer": writer, "i": 0, "size": len(pad), "pad": pad})

    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(publish, range(200)))
    assert_one_complete_value(path, expected)


def test_concurrent_publishes_from_processes_leave_one_complete_value(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    writers, per_writer = 8, 25
    procs = [
        subprocess.Popen(
            [sys.executable, str(HELPER), "publish", str(path), str(w), str(per_writer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for w in range(writers)
    ]
    try:
        # Every writer is started and waiting before any publishes, so they overlap.
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline() == b"ready\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.close()
        for proc in procs:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert_one_complete_value(path, _values_written(writers, per_writer))


# --------------------------------------------------------------------------- journal format and reader


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_append_assigns_consecutive_seq_in_the_documented_line_format(
    inline: bool, tmp_path: Path
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    records: list[dict[str, Any]] = [
        {"kind": "start", "at": 1.5},
        {},
        {"kind": "tool_call", "output": "é\n" * 3},
    ]
    async with CheckpointJournal(path, inline=inline) as journal:
        seqs = [await journal.append(record) for record in records]
        assert journal.seq == 3
    assert seqs == [1, 2, 3]
    assert journal_lines(path) == [line_for(seq, record) for seq, record in zip(seqs, records, strict=True)]
    assert read_journal(path) == [{"seq": seq, **record} for seq, record in zip(seqs, records, strict=True)]
    assert listing(tmp_path) == ["checkpoint.jsonl"]


def test_read_journal_of_missing_file_is_empty(tmp_path: Path) -> None:
    assert read_journal(tmp_path / "absent.jsonl") == []


async def test_an_inline_journal_writes_and_syncs_on_the_callers_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the worker buys with inline=True: no writer thread, no hand-over; the line is on disk
    # (synced, by this thread) when append returns.
    synced_on: list[int] = []
    real = os.fdatasync

    def recording(fd: int) -> None:
        synced_on.append(threading.get_ident())
        real(fd)

    monkeypatch.setattr(os, "fdatasync", recording)
    threads = threading.active_count()
    path = tmp_path / "checkpoint.jsonl"
    async with CheckpointJournal(path, inline=True) as journal:
        assert threading.active_count() == threads
        assert await journal.append({"n": 1}) == 1
        assert synced_on == [threading.get_ident()]
        assert journal_lines(path) == [line_for(1, {"n": 1})]
    assert journal.state is JournalState.CLOSED
    with pytest.raises(RuntimeError, match="closed"):
        await journal.append({"n": 2})


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_reopened_journal_continues_seq(inline: bool, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    async with CheckpointJournal(path, inline=inline) as journal:
        await journal.append({"n": 1})
        await journal.append({"n": 2})
    async with CheckpointJournal(path, inline=inline) as journal:
        assert journal.seq == 2
        assert await journal.append({"n": 3}) == 3
    assert [r["seq"] for r in read_journal(path)] == [1, 2, 3]


def write_lines(path: Path, *lines: bytes) -> None:
    path.write_bytes(b"".join(lines))


def test_torn_last_line_is_ignored_and_reported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "checkpoint.jsonl"
    third = line_for(3, {"n": 3})
    write_lines(path, line_for(1, {"n": 1}), line_for(2, {"n": 2}), third[: len(third) // 2])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_journal(path) == [{"seq": 1, "n": 1}, {"seq": 2, "n": 2}]
    assert "line 3 is torn" in caplog.text


def test_last_line_with_bad_checksum_is_ignored_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    write_lines(path, line_for(1, {"n": 1}), line_for(2, {"n": 2}).replace(b'"n":2', b'"n":7'))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_journal(path) == [{"seq": 1, "n": 1}]
    assert "line 2" in caplog.text and "checksum" in caplog.text


def test_corrupt_middle_line_raises_naming_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    damaged = line_for(2, {"n": 2}).replace(b'"n":2', b'"n":9')
    write_lines(path, line_for(1, {"n": 1}), damaged, line_for(3, {"n": 3}))
    with pytest.raises(JournalCorruptError, match="line 2 is corrupt"):
        read_journal(path)


def test_line_without_checksum_in_the_middle_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    write_lines(path, line_for(1, {"n": 1}), b'{"seq":2,"n":2}\n', line_for(3, {"n": 3}))
    with pytest.raises(JournalCorruptError, match="line 2"):
        read_journal(path)


def test_seq_gap_is_corruption(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    write_lines(path, line_for(1, {}), line_for(3, {}), line_for(4, {}))
    with pytest.raises(JournalCorruptError, match="line 2"):
        read_journal(path)


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_reopening_cuts_off_a_torn_tail_before_appending(
    inline: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    write_lines(path, line_for(1, {"n": 1}), line_for(2, {"n": 2, "pad": "x" * 500})[:300])
    async with CheckpointJournal(path, inline=inline) as journal:
        assert journal.seq == 1
        assert await journal.append({"n": 2}) == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_journal(path) == [{"seq": 1, "n": 1}, {"seq": 2, "n": 2}]
    assert caplog.text == ""
    assert journal_lines(path) == [line_for(1, {"n": 1}), line_for(2, {"n": 2})]


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_opening_a_journal_corrupt_in_the_middle_raises(inline: bool, tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    write_lines(path, line_for(1, {}), b"garbage\n", line_for(3, {}))
    journal = CheckpointJournal(path, inline=inline)
    with pytest.raises(JournalCorruptError, match="line 2"):
        await journal.__aenter__()
    assert journal.state is JournalState.CLOSED


async def test_record_with_reserved_or_unserialisable_content_is_rejected(tmp_path: Path) -> None:
    async with CheckpointJournal(tmp_path / "checkpoint.jsonl") as journal:
        with pytest.raises(ValueError, match="seq"):
            await journal.append({"seq": 5})
        with pytest.raises(ValueError, match="crc32"):
            await journal.append({"crc32": "0"})
        with pytest.raises(TypeError, match="serialisable"):
            await journal.append({"x": object()})
        with pytest.raises(TypeError, match="dict"):
            await journal.append([1, 2])  # type: ignore[arg-type]
        assert await journal.append({"ok": True}) == 1


async def test_lifecycle_misuse_fails_loudly(tmp_path: Path) -> None:
    journal = CheckpointJournal(tmp_path / "checkpoint.jsonl")
    states = [journal.state]
    with pytest.raises(RuntimeError, match="unopened"):
        await journal.append({})
    async with journal:
        states.append(journal.state)
        with pytest.raises(RuntimeError, match="only once"):
            await journal.__aenter__()
    states.append(journal.state)
    assert states == [JournalState.UNOPENED, JournalState.OPEN, JournalState.CLOSED]
    with pytest.raises(RuntimeError, match="closed"):
        await journal.append({})
    with pytest.raises(RuntimeError, match="only once"):
        await journal.__aenter__()
    await journal.aclose()  # closing twice is a no-op
    never_opened = CheckpointJournal(tmp_path / "other.jsonl")
    await never_opened.aclose()
    assert never_opened.state is JournalState.CLOSED
    assert listing(tmp_path) == ["checkpoint.jsonl"]


async def test_creating_a_journal_syncs_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def spy_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    async with CheckpointJournal(tmp_path / "checkpoint.jsonl"):
        pass
    assert synced == [str(tmp_path)], "a new journal's name must be made durable"


@pytest.mark.parametrize("umask", [0o077, 0o000])
async def test_journal_mode_is_exact_regardless_of_umask(tmp_path: Path, umask: int) -> None:
    previous = os.umask(umask)
    try:
        async with CheckpointJournal(tmp_path / "shared.jsonl", mode=0o640) as journal:
            await journal.append({})
        async with CheckpointJournal(tmp_path / "private.jsonl") as journal:
            await journal.append({})
    finally:
        os.umask(previous)
    assert (tmp_path / "shared.jsonl").stat().st_mode & 0o7777 == 0o640
    assert (tmp_path / "private.jsonl").stat().st_mode & 0o7777 == 0o600


# --------------------------------------------------------------------------- journal writer behaviour


class BlockingSync:
    """An ``os.fdatasync`` replacement that counts calls and can hold one until released."""

    def __init__(self, hold_call: int | None = 1) -> None:
        self.real = os.fdatasync
        self.calls = 0
        self.hold_call = hold_call
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == self.hold_call:
            self.entered.set()
            self.release.wait(10)
        self.real(fd)

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 10), "fdatasync was never reached"


async def test_concurrent_appends_share_one_fdatasync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    async with CheckpointJournal(path) as journal:
        sync = BlockingSync(hold_call=1)
        monkeypatch.setattr(os, "fdatasync", sync)
        first = asyncio.create_task(journal.append({"i": 0}))
        await sync.wait_entered()
        rest = [asyncio.create_task(journal.append({"i": i})) for i in range(1, 100)]
        # Callbacks run in FIFO order, so this runs after every task above has queued its record.
        asyncio.get_running_loop().call_soon(sync.release.set)
        seqs = await asyncio.gather(first, *rest)
    assert seqs == list(range(1, 101))
    assert sync.calls == 2, "the 99 appends queued during the first sync must be synced together"
    assert [r["i"] for r in read_journal(path)] == list(range(100))


async def test_event_loop_keeps_running_while_fdatasync_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with CheckpointJournal(tmp_path / "checkpoint.jsonl") as journal:
        sync = BlockingSync(hold_call=1)
        monkeypatch.setattr(os, "fdatasync", sync)
        append = asyncio.create_task(journal.append({"n": 1}))
        await sync.wait_entered()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            for _ in range(100):
                await asyncio.sleep(0)
                ticks += 1

        await asyncio.wait_for(ticker(), timeout=5)
        assert ticks == 100
        assert not append.done(), "append returned before its line was synced"
        sync.release.set()
        assert await append == 1


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_failing_fdatasync_raises_and_later_appends_succeed(
    inline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    real = os.fdatasync
    error = OSError(errno.EIO, "Input/output error")
    async with CheckpointJournal(path, inline=inline) as journal:
        assert await journal.append({"n": 1}) == 1
        monkeypatch.setattr(os, "fdatasync", failing_for(tmp_path, real, error))
        with pytest.raises(DurableWriteError, match=r"checkpoint\.jsonl") as caught:
            await journal.append({"n": "lost", "pad": "x" * 1000})
        assert caught.value.errno == errno.EIO
        assert caught.value.__cause__ is error
        assert journal.failures == 1
        assert journal.seq == 1
        monkeypatch.setattr(os, "fdatasync", real)
        assert await journal.append({"n": 2}) == 2
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert read_journal(path) == [{"seq": 1, "n": 1}, {"seq": 2, "n": 2}]
    assert caplog.text == ""
    assert journal_lines(path) == [line_for(1, {"n": 1}), line_for(2, {"n": 2})]


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_partially_written_batch_is_cut_off_before_the_next_write(
    inline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    real_pwrite = os.pwrite
    armed = True

    def short_then_enospc(fd: int, data: bytes, offset: int) -> int:
        nonlocal armed
        if armed and fd_inside(tmp_path, fd):
            armed = False
            real_pwrite(fd, bytes(data)[: len(data) - 7], offset)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    async with CheckpointJournal(path, inline=inline) as journal:
        await journal.append({"n": 1})
        monkeypatch.setattr(os, "pwrite", short_then_enospc)
        with pytest.raises(DurableWriteError) as caught:
            await journal.append({"n": "torn", "pad": "x" * 3000})
        assert caught.value.errno == errno.ENOSPC
        assert await journal.append({"n": 2}) == 2
        assert await journal.append({"n": 3}) == 3
    assert journal_lines(path) == [line_for(i, {"n": i}) for i in (1, 2, 3)]


@pytest.mark.parametrize("inline", [False, True], ids=["writer-thread", "inline"])
async def test_append_writes_only_its_own_line(
    inline: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    written: list[int] = []
    real_pwrite = os.pwrite

    def counting_pwrite(fd: int, data: bytes, offset: int) -> int:
        written.append(len(data))
        return real_pwrite(fd, data, offset)

    async with CheckpointJournal(path, inline=inline) as journal:
        for i in range(50):
            await journal.append({"n": i, "pad": "x" * 4096})
        monkeypatch.setattr(os, "pwrite", counting_pwrite)
        seq = await journal.append({"small": True})
    assert written == [len(line_for(seq, {"small": True}))]


async def test_aclose_writes_every_queued_record(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.jsonl"
    journal = CheckpointJournal(path, timeout_s=10)
    await journal.__aenter__()
    # gather starts the appends in order before aclose, so all are queued when it runs.
    *seqs, _ = await asyncio.gather(*(journal.append({"i": i}) for i in range(50)), journal.aclose())
    assert seqs == list(range(1, 51))
    assert journal.state is JournalState.CLOSED
    assert [r["i"] for r in read_journal(path)] == list(range(50))


async def test_append_gives_up_after_timeout_when_the_disk_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.jsonl"
    sync = BlockingSync(hold_call=1)
    async with CheckpointJournal(path, timeout_s=0.2) as journal:
        monkeypatch.setattr(os, "fdatasync", sync)
        try:
            with pytest.raises(DurableWriteError, match="not confirmed") as caught:
                await journal.append({"n": 1})
            assert caught.value.errno == errno.ETIMEDOUT
            assert journal.failures == 1
        finally:
            sync.release.set()
    assert read_journal(path) == [{"seq": 1, "n": 1}]


async def test_cancelled_append_is_still_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.jsonl"
    async with CheckpointJournal(path) as journal:
        sync = BlockingSync(hold_call=1)
        monkeypatch.setattr(os, "fdatasync", sync)
        append = asyncio.create_task(journal.append({"n": 1}))
        await sync.wait_entered()
        append.cancel()
        with pytest.raises(asyncio.CancelledError):
            await append
        sync.release.set()
        assert await journal.append({"n": 2}) == 2
    assert read_journal(path) == [{"seq": 1, "n": 1}, {"seq": 2, "n": 2}]


# --------------------------------------------------------------------------- a real full disk


async def test_full_disk_gives_clear_errors_and_keeps_old_artifacts(tiny_tmpfs: Path) -> None:
    result = tiny_tmpfs / "result.json"
    journal_path = tiny_tmpfs / "checkpoint.jsonl"
    publish_json(result, {"old": True})
    async with CheckpointJournal(journal_path) as journal:
        assert await journal.append({"n": 1}) == 1

        with pytest.raises(DurableWriteError, match=r"result\.json") as caught:
            publish_json(result, {"new": "x" * 64_000})
        assert caught.value.errno == errno.ENOSPC
        assert orjson.loads(result.read_bytes()) == {"old": True}
        assert listing(tiny_tmpfs) == ["checkpoint.jsonl", "result.json"]

        for _ in range(100):
            try:
                await journal.append({"pad": "y" * 3000})
            except DurableWriteError as exc:
                assert exc.errno == errno.ENOSPC
                assert "checkpoint.jsonl" in str(exc)
                break
        else:
            pytest.fail("a 16 KiB disk never filled up")
        assert journal.failures == 1
        durable = journal.seq
        assert [r["seq"] for r in read_journal(journal_path)] == list(range(1, durable + 1))
        journal_lines(journal_path)  # no fragment left by the failed write
        assert listing(tiny_tmpfs) == ["checkpoint.jsonl", "result.json"]

        # The disk recovers: the journal carries on where it stopped.
        result.unlink()
        assert await journal.append({"n": "after"}) == durable + 1
    assert [r["seq"] for r in read_journal(journal_path)] == list(range(1, durable + 2))
    publish_json(result, {"new": True})
    assert orjson.loads(result.read_bytes()) == {"new": True}
    assert listing(tiny_tmpfs) == ["checkpoint.jsonl", "result.json"]


# --------------------------------------------------------------------------- SIGKILL campaigns


class Forker:
    """Drives ``tests/helpers/durable_child.py forker``: one interpreter, a fork per writer."""

    def __init__(self, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(HELPER), "forker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                bufsize=0,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin = self.proc.stdin
        self.fd = self.proc.stdout.fileno()
        self.buffer = b""
        self.live: int | None = None
        self.early: list[list[str]] = []

    def send(self, line: str) -> None:
        self.stdin.write(line.encode() + b"\n")

    def line(self, timeout: float = 20.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(remaining, 0))
            if not ready:
                raise TimeoutError(f"no line from the forker in {timeout} s; stderr: {self.stderr()}")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise EOFError(f"the forker exited; stderr: {self.stderr()}")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line.decode().split()

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-2000:]

    def spawn(self, kind: str, path: Path) -> int:
        self.send(f"{kind} {path}")
        # The child shares the forker's stdout and may acknowledge a write before the forker
        # has printed its pid: keep such acks for the calls below instead of assuming an order.
        while (words := self.line())[0] == "ack":
            self.early.append(words)
        assert words[0] == "pid", words
        self.live = int(words[1])
        assert all(int(ack[1]) == self.live for ack in self.early), (self.live, self.early)
        return self.live

    def wait_for_ack(self, pid: int, acks: list[int]) -> None:
        words = self.early.pop(0) if self.early else self.line()
        assert words[0] == "ack" and int(words[1]) == pid, words
        acks.append(int(words[2]))

    def kill_and_reap(self, pid: int, acks: list[int]) -> int:
        os.kill(pid, signal.SIGKILL)
        acks.extend(int(words[2]) for words in self.early)
        self.early.clear()
        self.send(f"reap {pid}")
        while True:
            words = self.line()
            if words[0] == "ack":
                acks.append(int(words[2]))
            else:
                assert words[:2] == ["reaped", str(pid)], words
                self.live = None
                return int(words[2])

    def close(self) -> None:
        if self.live is not None:
            os.kill(self.live, signal.SIGKILL)
        self.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def forker(tmp_path: Path) -> Iterator[Forker]:
    """The forking helper process; every child it made is dead when the test ends."""
    driver = Forker(tmp_path / "forker.err")
    try:
        yield driver
    finally:
        driver.close()


def kill_writer_at_random(forker: Forker, kind: str, path: Path, rng: random.Random, wait: bool) -> list[int]:
    """Start a writer, let it write, SIGKILL it at a random moment; returns what it acknowledged."""
    acks: list[int] = []
    pid = forker.spawn(kind, path)
    if wait:
        forker.wait_for_ack(pid, acks)
    # Randomises where in its write/sync cycle the kill lands; nothing waits on it.
    time.sleep(rng.uniform(0, 0.004))
    status = forker.kill_and_reap(pid, acks)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"the writer exited by itself (status {status}); stderr: {forker.stderr()}"
    )
    return acks


@pytest.mark.slow
def test_sigkilled_appender_leaves_a_gap_free_prefix_with_every_acknowledged_record(
    tmp_path: Path, forker: Forker, caplog: pytest.LogCaptureFixture
) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    kills, per_journal = 240, 24
    torn = 0
    for i in range(kills):
        if i % per_journal == 0:
            directory = tmp_path / f"journal-{i // per_journal}"
            directory.mkdir()
            path = directory / "checkpoint.jsonl"
            acknowledged = previous = 0
        # Most kills land while the writer is appending; every fifth may land while it opens.
        acks = kill_writer_at_random(forker, "journal", path, rng, wait=i % 5 != 4)
        acknowledged = max([acknowledged, *acks])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            records = read_journal(path)
        torn += "ignoring the last line" in caplog.text
        seqs = [r["seq"] for r in records]
        context = f"kill {i}, seed {seed}"
        assert seqs == list(range(1, len(seqs) + 1)), context
        assert len(records) >= acknowledged, f"{context}: acknowledged seq {acknowledged} was lost"
        assert len(records) >= previous, f"{context}: reopening lost intact records"
        assert all(set(r) == {"seq", "pid", "n", "pad"} for r in records), context
        assert listing(directory) in ([], ["checkpoint.jsonl"]), context
        previous = len(records)
    print(f"{kills} SIGKILLs, {torn} left a torn last line (seed {seed})")


@pytest.mark.slow
def test_sigkilled_publisher_leaves_a_complete_value_and_only_recognisable_temps(
    tmp_path: Path, forker: Forker
) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    path = tmp_path / "result.json"
    publish_json(path, {"pid": 0, "gen": 0, "size": 0, "pad": ""})
    leftovers = 0
    for i in range(100):
        acks = kill_writer_at_random(forker, "publish", path, rng, wait=i % 5 != 4)
        value = orjson.loads(path.read_bytes())
        context = f"kill {i}, seed {seed}"
        assert value["size"] == len(value["pad"]), context
        if acks:
            assert value["gen"] >= max(acks), f"{context}: an acknowledged publish was lost"
        temps = [name for name in listing(tmp_path) if name not in ("result.json", "forker.err")]
        assert all(is_temp_artifact(name) for name in temps), f"{context}: {temps}"
        # Sweep as the supervisor will.
        for name in temps:
            (tmp_path / name).unlink()
        leftovers += len(temps)
    print(f"100 SIGKILLs, {leftovers} temporary files swept (seed {seed})")
