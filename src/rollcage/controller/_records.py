"""``rollouts.jsonl``: one ``RolloutRecord`` a line, appended and fsynced in order.

Records of rollouts that finish together share one ``write`` and one ``fsync`` (a group
commit): each append is acknowledged only once its line is synced, as if alone. A crash
(SIGKILL, power cut) can leave only one kind of damage: a torn last line, because every
batch is one ``write`` followed by ``fsync`` before the next. On
open the log is scanned as a stream: a last line without its newline, or one that
does not parse, is truncated away (and reported); a damaged line anywhere else is
an error naming its line, because silently dropping a finished record would make
resume run it twice.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from pydantic import ValidationError

from rollcage.durable import fsync_directory, open_regular
from rollcage.errors import ConfigError, DurableWriteError
from rollcage.procs import shielded
from rollcage.protocol import RolloutRecord, describe_validation_error

__all__ = ["LoadReport", "RecordLog", "load_records"]

logger = logging.getLogger("rollcage.controller")


@dataclass(frozen=True)
class LoadReport:
    """What reading an existing log found.

    Attributes:
        records: Intact records read.
        repaired_bytes: Bytes of a torn last line that were truncated away (0: none).
    """

    records: int
    repaired_bytes: int


def load_records(
    path: Path, on_record: Callable[[RolloutRecord], object], *, repair: bool = True
) -> LoadReport:
    """Stream the records of an existing log into ``on_record``, repairing a torn tail.

    Blocking (reads and may truncate the file); from async code run it in a thread.

    Args:
        path: The log; a missing file is an empty log.
        on_record: Called with each intact record, in file order.
        repair: Truncate a torn tail away (the run that owns the log); ``False`` only skips it
            (a reader such as ``rollcage export``, which must not write to a run's files).

    Raises:
        ConfigError: A line other than the last is damaged (the message names it), or the log is
            not a regular file (a FIFO would block the run forever, a device never ends).
        DurableWriteError: The torn tail could not be truncated.
    """
    try:
        handle = open_regular(path)
    except FileNotFoundError:
        return LoadReport(0, 0)
    except OSError as exc:
        raise ConfigError(
            f"{path} cannot be read as a run's record log: {exc.strerror or exc}; "
            "move it aside, or choose another output directory"
        ) from exc
    count = 0
    good_end = 0
    bad: tuple[int, str] | None = None  # (line number, reason) of a line that did not parse
    with handle:
        number = 0
        for raw in handle:
            number += 1
            if bad is not None:
                # A damaged line followed by more lines is not a torn tail.
                raise ConfigError(
                    f"{path} line {bad[0]} is damaged ({bad[1]}); records after it exist, so this is "
                    "not a crash's torn last line: move the file aside (or delete that line) to resume"
                )
            if not raw.endswith(b"\n"):
                bad = (number, "no newline: torn write")
                continue
            try:
                record = RolloutRecord.model_validate_json(raw)
            except ValidationError as exc:
                bad = (number, f"not a RolloutRecord: {describe_validation_error(exc, limit=1)}")
                continue
            on_record(record)
            count += 1
            good_end += len(raw)
        size = handle.tell()
    repaired = 0
    if bad is not None and repair:
        repaired = size - good_end
        logger.warning("%s: truncating a torn last line %d (%s, %d bytes)", path, bad[0], bad[1], repaired)
        try:
            with path.open("r+b") as fix:
                fix.truncate(good_end)
                fix.flush()
                os.fsync(fix.fileno())
        except OSError as exc:
            raise DurableWriteError(f"cannot repair {path}: {exc.strerror or exc}") from exc
    return LoadReport(count, repaired)


@dataclass(eq=False)
class _Pending:
    """One line waiting for its batch; ``error`` and ``written`` are set by the batch's thread."""

    line: bytes
    written: bool = False
    error: DurableWriteError | None = field(default=None)


class RecordLog:
    """The append side of ``rollouts.jsonl``; appends are serialised and fsynced, in batches.

    Use as ``async with RecordLog(path) as log: await log.append(record)``.
    """

    def __init__(self, path: Path) -> None:
        """Prepare to append to ``path`` (opened on enter)."""
        self._path = path
        self._fd: int | None = None
        self._lock = asyncio.Lock()
        # Lines handed in while a batch is being written: the next batch, written whole by
        # whichever waiter gets the lock first.
        self._pending: list[_Pending] = []

    @property
    def path(self) -> Path:
        """The log's path."""
        return self._path

    async def __aenter__(self) -> Self:
        """Open (creating if needed) the log for appending.

        Raises:
            DurableWriteError: The file cannot be opened.

        **Cancellation:** an open already handed to its thread completes and the
        descriptor it made is closed; then ``CancelledError`` propagates.
        """
        opening = asyncio.ensure_future(asyncio.to_thread(self._open))
        try:
            self._fd = await shielded(opening)
        except asyncio.CancelledError:
            # The thread cannot be stopped: close what it opened, or the descriptor leaks.
            if not opening.cancelled() and opening.exception() is None:
                os.close(opening.result())
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close the file (every append is already on disk).

        **Cancellation:** nothing to wait for: the file is closed at once.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _open(self) -> int:
        existed = self._path.exists()
        try:
            # O_NONBLOCK: a FIFO put in its place fails the open (ENXIO) instead of blocking it.
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
            fd = os.open(self._path, flags, 0o644)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise OSError(errno.EINVAL, "not a regular file")
            if not existed:
                fsync_directory(self._path.parent)
        except OSError as exc:
            raise DurableWriteError(f"cannot open {self._path}: {exc.strerror or exc}") from exc
        return fd

    async def append(self, record: RolloutRecord) -> None:
        """Append one record and return once it is on disk (written and fsynced).

        Appends are serialised, so records keep the order in which they were handed in.
        Records handed in while an earlier batch is being synced are written and synced
        together, in that order, by one ``write`` and one ``fsync`` (a group commit).

        Raises:
            DurableWriteError: Writing or syncing its batch failed; the partial batch, if any,
                was truncated away so the log stays well formed.

        **Cancellation:** a record whose batch was already handed to the thread is still
        written (it cannot be interrupted halfway), one still waiting is withdrawn; the
        caller sees ``CancelledError``.
        """
        if self._fd is None:
            raise RuntimeError("RecordLog is not open; use 'async with RecordLog(path)'")
        entry = _Pending(record.model_dump_json().encode() + b"\n")
        self._pending.append(entry)
        try:
            async with self._lock:
                # Still pending: no earlier batch took it, so this waiter writes every line pending now.
                if entry in self._pending and self._fd is not None:
                    batch, self._pending = self._pending, []
                    await shielded(asyncio.to_thread(self._write_batch, self._fd, batch))
        except asyncio.CancelledError:
            if entry in self._pending:
                self._pending.remove(entry)
            raise
        if entry.error is not None:
            raise entry.error
        if not entry.written:
            raise RuntimeError("RecordLog was closed before the record was written")

    def _write_batch(self, fd: int, batch: list[_Pending]) -> None:
        """Write and sync one batch (blocking; runs in a thread); each entry learns the outcome."""
        try:
            self._write(fd, b"".join(entry.line for entry in batch))
        except DurableWriteError as exc:
            for entry in batch:
                entry.error = exc
            return
        for entry in batch:
            entry.written = True

    def _write(self, fd: int, line: bytes) -> None:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(line)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fsync(fd)
        except OSError as exc:
            # Take back a half-written line so the next append does not glue onto it.
            try:
                os.ftruncate(fd, start)
                os.fsync(fd)
            except OSError:
                logger.exception("%s: cannot truncate a failed append", self._path)
            hint = " (disk full)" if exc.errno == errno.ENOSPC else ""
            raise DurableWriteError(f"cannot append to {self._path}{hint}: {exc.strerror or exc}") from exc
