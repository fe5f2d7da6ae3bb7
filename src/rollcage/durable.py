"""Durable storage: atomic publication of JSON artifacts and the checkpoint journal.

Two ways of putting evidence on disk so that a crash (SIGKILL, power cut, full
disk) never leaves a half-written artifact behind:

* :func:`publish_json` replaces a whole file atomically (``result.json``,
  ``receipt.json``): readers see the old value or the new one, never a mix.
* :class:`CheckpointJournal` appends one self-checking JSON line per boundary to
  ``checkpoint.jsonl``; :func:`read_journal` returns the intact prefix.

Journal line format (one JSON object per line)::

    {"seq":3,"kind":"tool_call",...,"crc32":"1c291ca3"}\\n

where the checksum is ``zlib.crc32`` of the same line with the ``crc32`` member
removed, i.e. of ``orjson.dumps({"seq": 3, **record})``. The checksum is always
the last member and has a fixed width, so a reader verifies a line by cutting
off a fixed-length suffix, with no re-serialisation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import logging
import os
import queue
import re
import secrets
import shutil
import stat
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import IO, Any, Final, Self

import orjson
from pydantic import BaseModel

from rollcage.errors import DurableWriteError, JournalCorruptError
from rollcage.procs import AsyncClosing, wait_shared

__all__ = [
    "AppendCursor",
    "CheckpointJournal",
    "JournalState",
    "StagedDirectory",
    "fsync_directory",
    "is_temp_artifact",
    "open_regular",
    "publish_bytes",
    "publish_json",
    "read_bounded",
    "read_journal",
    "sweep_temp_artifacts",
]

logger = logging.getLogger("rollcage.durable")

_TEMP_NAME: Final = re.compile(r"\A\..+\.[0-9a-f]{16}\.tmp\Z", re.DOTALL)
# Leaves room for the dot, the random part and the suffix within NAME_MAX (255).
_TEMP_STEM_MAX: Final = 200

_CRC_PREFIX: Final = b',"crc32":"'
_CRC_SUFFIX_LEN: Final = len(b',"crc32":"00000000"}\n')
_RESERVED_KEYS: Final = frozenset({"seq", "crc32"})
_DEFAULT_TIMEOUT_S: Final = 30.0


# --------------------------------------------------------------------------- publish


def is_temp_artifact(name: str) -> bool:
    """Tell whether a file name is a temporary file left by :func:`publish_json`.

    A process killed between creating its temporary file and renaming it leaves
    the file behind; the supervisor sweeps such leftovers with this predicate.

    Args:
        name: A file name. A path is accepted too; only its last component counts.

    Returns:
        True for names of the form ``.<target name>.<16 hex digits>.tmp``.
    """
    return _TEMP_NAME.match(os.path.basename(name)) is not None


def sweep_temp_artifacts(directory: str | os.PathLike[str]) -> int:
    """Remove the temporary files a killed publisher left in ``directory``; return how many.

    Only names :func:`is_temp_artifact` recognises are touched, never a published
    artifact; a directory that cannot be listed has nothing to sweep. Blocking.
    """
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    swept = 0
    for name in names:
        if is_temp_artifact(name):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(os.path.join(directory, name))
                swept += 1
    return swept


def publish_json(
    path: str | os.PathLike[str], value: BaseModel | Any, *, mode: int = 0o600, sync_directory: bool = True
) -> None:
    """Atomically replace the file at ``path`` with ``value`` serialised as JSON.

    The value is serialised first (pydantic models with ``model_dump_json``,
    anything else with ``orjson``), then written to a temporary file in the same
    directory, synced (data and mode), renamed over ``path`` with ``os.replace``,
    and finally the directory is synced so the rename itself survives a crash.
    Readers of ``path`` only ever see the previous value or the complete new one.

    This is a blocking call (it waits for the disk); from ``async`` code run it
    in a thread (``await asyncio.to_thread(publish_json, ...)``).

    Args:
        path: The file to replace. Its directory must exist.
        value: A pydantic model, or anything ``orjson`` can serialise (pydantic
            models nested in lists or dicts are serialised too).
        mode: Exact permission bits of the published file, whatever the umask.
        sync_directory: ``False`` leaves the final directory sync to the caller, who publishes
            more files into the same directory and syncs it once after the last
            (:func:`fsync_directory`): until then the rename may not survive a crash, so nothing
            may treat the file as final before that sync.

    Raises:
        ValueError: ``mode`` is not a permission mode.
        DurableWriteError: Serialising, writing, syncing or renaming failed (its
            ``errno`` is the cause's where there is one). The temporary file has
            been removed and the previous file at ``path`` is untouched. Raised
            also when only the final directory sync fails: the new content is in
            place then, but not known to survive a power cut, which the message
            says.
    """
    target = os.fspath(path)
    _check_mode(mode)
    try:
        data = _serialise(value)
    except Exception as exc:  # orjson, pydantic and user serialisers raise TypeError, ValueError, ...
        raise _write_error(f"cannot publish {target}: the value is not serialisable as JSON", exc) from exc
    publish_bytes(target, data, mode=mode, sync_directory=sync_directory)


def publish_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    *,
    mode: int = 0o600,
    sync_directory: bool = True,
    sync: bool = True,
) -> None:
    """Atomically replace the file at ``path`` with ``data``: ``publish_json``'s sequence, for any bytes.

    Blocking; the same guarantees, errors and ``sync_directory`` as ``publish_json``.

    ``sync=False`` syncs neither the file nor its directory (``sync_directory`` is then
    moot): the replacement is still atomic against a killed process (readers see the old
    file or the whole new one), but not against a machine crash, after which the file may
    be missing, empty or torn. Only for derived files whose readers check them against a
    seal kept durably elsewhere (:class:`rollcage.protocol.FileSeal`).
    """
    target = os.fspath(path)
    _check_mode(mode)
    directory, name = os.path.split(os.path.abspath(target))
    temp = os.path.join(directory, f".{name[:_TEMP_STEM_MAX]}.{secrets.token_hex(8)}.tmp")
    step = "creating the temporary file"
    try:
        # 0o600 while incomplete; the exact mode is applied before the sync, so
        # the sync makes both the bytes and the permissions durable.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise _write_error(f"cannot publish {target}: {step} failed", exc) from exc
    try:
        try:
            step = "writing"
            # A raw fd has no user-space buffer: once every byte is written, the
            # data is "flushed" and only the kernel's cache stands before the disk.
            _write_all(fd, data)
            step = "setting the file mode"
            os.fchmod(fd, mode)
            if sync:
                step = "syncing the temporary file"
                os.fsync(fd)
        finally:
            os.close(fd)
        step = "renaming the temporary file into place"
        os.replace(temp, target)
    except BaseException as exc:
        # If even this fails the leftover is still recognisable (is_temp_artifact)
        # and swept later; the original failure is the one to report.
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise _write_error(
                f"cannot publish {target}: {step} failed; the previous file is untouched", exc
            ) from exc
        raise
    if not (sync and sync_directory):
        return
    try:
        fsync_directory(directory)
    except OSError as exc:
        raise _write_error(
            f"published {target}, but syncing its directory failed, so the new file may not survive a crash",
            exc,
        ) from exc


def _check_mode(mode: int) -> None:
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
        raise ValueError(f"mode must be a permission mode between 0 and 0o7777, not {mode!r}")


def _pydantic_default(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    raise TypeError(f"type is not JSON serialisable: {type(obj).__name__}")


def _serialise(value: BaseModel | Any) -> bytes:
    if isinstance(value, BaseModel):
        return value.model_dump_json().encode() + b"\n"
    return orjson.dumps(value, default=_pydantic_default, option=orjson.OPT_APPEND_NEWLINE)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # a regular file reports a real error rather than 0; never spin
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[written:]
        offset += written


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """``fsync`` a directory, so a rename or a new file in it survives a crash (blocking).

    A file system that cannot sync a directory at all (``EINVAL``, ``ENOTSUP``) is
    not an error: its renames are as durable as they will ever be.

    Raises:
        OSError: The directory cannot be opened, or the sync failed.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems cannot sync a directory at all; their renames are as
        # durable as they will ever be, so this is not a failure of ours.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


class StagedDirectory:
    """Publish a whole directory of files atomically: readers see the old directory or the new one, whole.

    Files are written into a temporary sibling (``.<name>.<16 hex>.tmp``, the
    name ``is_temp_artifact`` recognises), each synced; on a clean exit from the
    ``with`` block the sibling takes the target's place in one step (Linux's
    ``renameat2(RENAME_EXCHANGE)`` where the target exists, then the old one is
    removed; a plain rename where it does not). An exception in the block, or a
    failure to publish, removes the sibling and leaves the target as it was, so
    there is never a directory holding some of the new files, or new files mixed
    with an earlier publication's. Leftover siblings of a killed publisher are
    swept when the next one starts. Blocking throughout.

    The caller decides whether the target may be replaced (``rollcage.runfiles.check_output``);
    this class replaces a directory, and refuses anything else at the target.

    Example::

        with StagedDirectory(out) as staged:
            for name, data in documents:
                staged.add(name, data)
    """

    def __init__(self, target: str | os.PathLike[str], *, mode: int = 0o644, dir_mode: int = 0o755) -> None:
        """Stage files for ``target`` (a directory; its parent must exist); ``mode`` for each file."""
        _check_mode(mode)
        _check_mode(dir_mode)
        self.target = os.path.abspath(os.fspath(target))
        self._mode = mode
        self._dir_mode = dir_mode
        parent, name = os.path.split(self.target)
        self._parent = parent
        self._prefix = f".{name[:_TEMP_STEM_MAX]}."
        self._staging = os.path.join(parent, f"{self._prefix}{secrets.token_hex(8)}.tmp")
        self._names: set[str] = set()

    def __enter__(self) -> Self:
        """Sweep earlier leftovers and create the staging directory.

        Raises:
            DurableWriteError: the staging directory cannot be created.
        """
        self._sweep()
        try:
            os.mkdir(self._staging, 0o700)
        except OSError as exc:
            raise _write_error(
                f"cannot publish {self.target}: creating a staging directory failed", exc
            ) from exc
        return self

    def add(self, name: str, data: bytes) -> None:
        """Write one file of the new directory (synced). ``name`` is one plain file name, new in it.

        Raises:
            ValueError: ``name`` is not one plain file name.
            FileExistsError: ``name`` was added already.
            DurableWriteError: writing failed.
        """
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"not a plain file name: {name!r}")
        if name in self._names:
            raise FileExistsError(errno.EEXIST, "added twice", name)
        path = os.path.join(self._staging, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, data)
                os.fchmod(fd, self._mode)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise _write_error(f"cannot publish {self.target}: writing {name} failed", exc) from exc
        self._names.add(name)

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Publish the staged directory, or, after an exception, remove it and leave the target alone."""
        if exc is not None:
            shutil.rmtree(self._staging, ignore_errors=True)
            return
        try:
            self._publish()
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
            raise

    def _publish(self) -> None:
        step = "syncing the staging directory"
        try:
            os.chmod(self._staging, self._dir_mode)
            fsync_directory(self._staging)
            step = "putting it in place"
            try:
                mode: int | None = os.lstat(self.target).st_mode
            except FileNotFoundError:
                mode = None
            if mode is None:
                os.rename(self._staging, self.target)
            elif stat.S_ISDIR(mode):
                aside = os.path.join(self._parent, f"{self._prefix}{secrets.token_hex(8)}.tmp")
                _exchange(self._staging, self.target, aside)  # the old directory is now at the staging name
            else:
                raise OSError(errno.ENOTDIR, f"exists and is a {_file_kind(mode)}, not a directory")
        except OSError as exc:
            raise _write_error(f"cannot publish {self.target}: {step} failed; it is untouched", exc) from exc
        shutil.rmtree(self._staging, ignore_errors=True)  # the replaced directory, if there was one
        try:
            fsync_directory(self._parent)
        except OSError as exc:
            raise _write_error(
                f"published {self.target}, but syncing its directory failed, so it may not survive a crash",
                exc,
            ) from exc

    def _sweep(self) -> None:
        """Remove staging directories a killed publisher of the same target left behind."""
        try:
            names = os.listdir(self._parent)
        except OSError:
            return
        for name in names:
            if name.startswith(self._prefix) and is_temp_artifact(name):
                path = os.path.join(self._parent, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE: Final = 2
_AT_FDCWD: Final = -100


def _exchange(new: str, old: str, aside: str) -> None:
    """Swap two directories in one step; without ``renameat2`` (not Linux, old libc, a file system
    that refuses ``RENAME_EXCHANGE``), in two renames with a moment where ``old`` is absent.

    Afterwards ``new``'s content is at ``old`` and the replaced directory is at ``new``; ``aside`` is a
    free name the two-rename fallback passes the old directory through.
    """
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        renameat2.restype = ctypes.c_int
        if renameat2(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(code, os.strerror(code), old)
    os.rename(old, aside)
    try:
        os.rename(new, old)
    except OSError:
        os.rename(aside, old)
        raise
    os.rename(aside, new)


def _write_error(message: str, cause: BaseException) -> DurableWriteError:
    """A DurableWriteError carrying the cause's errno, chained to the cause.

    The chain is set here too because errors built on the writer thread reach
    their caller through a future, not through ``raise ... from``.
    """
    if isinstance(cause, OSError) and cause.errno is not None:
        error = DurableWriteError(cause.errno, f"{message}: {cause.strerror or cause}")
    else:
        error = DurableWriteError(f"{message}: {cause}")
    error.__cause__ = cause
    return error


# --------------------------------------------------------------------------- journal format


def _frame(seq: int, payload: bytes) -> bytes:
    """One journal line from a serialised record (``orjson.dumps(record)``).

    Splicing ``seq`` into the already serialised record gives exactly
    ``orjson.dumps({"seq": seq, **record})`` without serialising the record twice.
    """
    body = b'{"seq":%d}' % seq if payload == b"{}" else b'{"seq":%d,' % seq + payload[1:]
    return body[:-1] + b',"crc32":"%08x"}\n' % zlib.crc32(body)


def _parse_line(line: bytes, expected_seq: int) -> dict[str, Any] | str:
    """The record of a newline-terminated line, or why it is not intact."""
    if len(line) <= _CRC_SUFFIX_LEN or line[-_CRC_SUFFIX_LEN:-11] != _CRC_PREFIX or line[-3:] != b'"}\n':
        return "no integrity check"
    body = line[:-_CRC_SUFFIX_LEN] + b"}"
    if line[-11:-3] != b"%08x" % zlib.crc32(body):
        return "checksum mismatch"
    try:
        record = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "not JSON"
    if not isinstance(record, dict):
        return "not a JSON object"
    seq = record.get("seq")
    if type(seq) is not int or seq != expected_seq:
        return f"seq {seq!r} where {expected_seq} was expected"
    return record


@dataclass(frozen=True, slots=True)
class _Scan:
    records: list[dict[str, Any]]
    good_size: int
    """Bytes of intact lines: where the next line belongs."""
    damaged_tail: str | None
    """Why the last line was ignored, with its line number; None if it was not."""


def _scan(data: bytes, path: str) -> _Scan:
    records: list[dict[str, Any]] = []
    offset = 0
    while offset < len(data):
        line_no = len(records) + 1
        end = data.find(b"\n", offset)
        if end == -1:
            return _Scan(records, offset, f"line {line_no} is torn (no newline)")
        parsed = _parse_line(data[offset : end + 1], line_no)
        if isinstance(parsed, str):
            if end + 1 < len(data):
                raise JournalCorruptError(
                    f"{path}: line {line_no} is corrupt ({parsed}) and is not the last line; "
                    f"the {len(records)} records before it are intact"
                )
            return _Scan(records, offset, f"line {line_no} is damaged ({parsed})")
        records.append(parsed)
        offset = end + 1
    return _Scan(records, offset, None)


def read_journal(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the intact records of a checkpoint journal, in order.

    A torn or damaged **last** line is what a crash mid-append leaves: it is
    ignored and reported as a warning on the ``rollcage.durable`` logger.

    Args:
        path: The journal file.

    Returns:
        The records, each a dict with its ``seq`` (1, 2, 3, ...) and without the
        checksum. A missing file gives ``[]``.

    Raises:
        JournalCorruptError: A line other than the last is damaged or out of
            sequence; the message names its line number.
        OSError: The file exists but cannot be read.
    """
    name = os.fspath(path)
    try:
        with open_regular(name) as file:
            data = file.read()
    except FileNotFoundError:
        return []
    scan = _scan(data, name)
    if scan.damaged_tail is not None:
        logger.warning("%s: ignoring the last line: %s", name, scan.damaged_tail)
    return scan.records


# --------------------------------------------------------------------------- reading files someone else made


def open_regular(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a file for binary reading only if it is a regular file, without ever blocking on it.

    Artifacts are read from directories others can write (a sandbox, a user): a
    FIFO in place of a file would block ``open`` or ``read`` forever and a device
    such as ``/dev/zero`` never ends. The file is opened with ``O_NONBLOCK`` (an
    open of a FIFO returns at once) and ``O_NOCTTY``, and refused unless ``fstat``
    says it is a regular file; symbolic links are followed as ``open`` does.

    Raises:
        OSError: it cannot be opened, or it is not a regular file (``EINVAL``;
            the message says what it is instead).
    """
    name = os.fspath(path)
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, f"not a regular file (a {_file_kind(mode)})", name)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str | os.PathLike[str], *, limit: int) -> bytes:
    """The whole content of a regular file of at most ``limit`` bytes (see ``open_regular``).

    Raises:
        OSError: it cannot be read, is not a regular file, or holds more than
            ``limit`` bytes (``EFBIG``; also when it grows past that while read).
    """
    with open_regular(path) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"larger than the {limit:,}-byte bound", os.fspath(path))
    return data


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


# --------------------------------------------------------------------------- journal writer


class JournalState(enum.Enum):
    """Lifecycle of a :class:`CheckpointJournal`."""

    UNOPENED = "unopened"
    """Built, not yet entered: nothing is open and no thread runs."""
    OPEN = "open"
    """Entered: appends are accepted."""
    CLOSED = "closed"
    """Closed (or failed to open): appends are refused; it cannot be reopened."""


@dataclass(slots=True)
class _Append:
    payload: bytes
    future: asyncio.Future[int]


_Outcome = tuple[asyncio.Future[int], int | BaseException]


class _Stop:
    """Tells the writer thread to finish what is queued and exit."""


_STOP: Final = _Stop()


class CheckpointJournal(AsyncClosing):
    """Append-only checkpoint journal: one durable, self-checking JSON line per record.

    Use it as an async context manager::

        async with CheckpointJournal(rollout_dir / "checkpoint.jsonl") as journal:
            seq = await journal.append({"kind": "start", "at": time.time()})

    All file I/O happens on one writer thread, so the event loop never waits for
    the disk. Appends that arrive while the thread is syncing a batch are written
    and synced together with one ``fdatasync`` (group commit); each caller
    resumes once its own line is on disk. Appending costs O(size of the record),
    whatever the size of the journal.

    Opening an existing journal continues its ``seq`` after the last intact
    record and cuts off a torn last line, so the file never has a damaged line
    in its middle. A failed write is cut off the same way before the next one,
    so appends work again once the disk recovers.

    ``inline=True`` writes and syncs on the caller's thread instead, one record at
    a time: for a caller with nothing else to do while its record goes to disk (a
    worker waits for each boundary before it goes on). It spares each append two
    thread hand-overs (~0.35 ms of CPU on a 2-core VM, more than the write and the
    sync) and the process a thread; in exchange the event loop waits for the disk,
    and a disk that hangs is waited for, not given up on after ``timeout_s``. The
    file, its lines and every failure's handling are the same.

    Args:
        path: The journal file; created if missing. A symlink is refused.
        mode: Exact permission bits of the file, whatever the umask.
        timeout_s: The longest any single wait (opening, one append, closing)
            lasts before it gives up with :class:`DurableWriteError` (the writer
            thread's; an inline journal does not wait on anything but the disk).
        inline: Write on the caller's thread (see above), not on a writer thread.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        mode: int = 0o600,
        timeout_s: float = _DEFAULT_TIMEOUT_S,
        inline: bool = False,
    ) -> None:
        _check_mode(mode)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s!r}")
        self._path = os.fspath(path)
        self._mode = mode
        self._timeout_s = timeout_s
        self._state = JournalState.UNOPENED
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: queue.SimpleQueue[_Append | _Stop] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Future[None] | None = None
        self._seq = 0  # written by the writer thread only
        self._failures = 0  # written by the event loop only
        self._inline = inline
        self._file: AppendCursor | None = None  # an inline journal's, while it is open

    @property
    def path(self) -> str:
        """The journal file."""
        return self._path

    @property
    def state(self) -> JournalState:
        """Where the journal is in its lifecycle."""
        return self._state

    @property
    def seq(self) -> int:
        """The ``seq`` of the last record known to be on disk (0 if none)."""
        return self._seq

    @property
    def failures(self) -> int:
        """How many :meth:`append` calls raised :class:`DurableWriteError`."""
        return self._failures

    async def __aenter__(self) -> Self:
        """Open the journal: start the writer thread and scan the existing file.

        **Cancellation:** the journal is closed and its thread told to stop.

        Raises:
            RuntimeError: The journal was already entered or closed.
            JournalCorruptError: The existing file is damaged before its last line.
            DurableWriteError: The file cannot be opened, created or repaired, or
                opening took longer than ``timeout_s``.
        """
        if self._state is not JournalState.UNOPENED:
            raise RuntimeError(f"journal {self._path} is {self._state.value}; it can be opened only once")
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self._inline:
            self._state = JournalState.CLOSED  # until the file is open
            self._file = AppendCursor(*self._open_file())
            self._state = JournalState.OPEN
            return self
        opened: asyncio.Future[None] = loop.create_future()
        self._stopped = loop.create_future()
        self._state = JournalState.OPEN
        self._thread = threading.Thread(
            target=self._run,
            args=(loop, opened),
            name=f"rollcage-journal:{os.path.basename(self._path)}",
            # A disk that hangs in fdatasync must not also hang interpreter exit.
            daemon=True,
        )
        self._thread.start()
        try:
            async with asyncio.timeout(self._timeout_s):
                await opened
        except BaseException as exc:
            self._state = JournalState.CLOSED
            self._queue.put(_STOP)
            if isinstance(exc, TimeoutError):
                raise DurableWriteError(
                    errno.ETIMEDOUT, f"opening journal {self._path} took longer than {self._timeout_s} s"
                ) from exc
            raise
        return self

    async def append(self, record: dict[str, Any]) -> int:
        """Append one record and wait until its line is on disk.

        The record is serialised at once (so a bad record fails here, in the
        caller), then handed to the writer thread, which gives it the next
        ``seq``, writes it and syncs it, together with whatever else was queued.

        **Cancellation:** cancelling the caller does not withdraw the record: it
        is still written (and takes a ``seq``) unless its batch fails.

        Args:
            record: A JSON-serialisable dict. It must not have ``seq`` or
                ``crc32`` keys: the journal adds those.

        Returns:
            The record's ``seq``.

        Raises:
            RuntimeError: The journal is not open, or this is another event loop.
            TypeError: ``record`` is not a dict or is not JSON-serialisable.
            ValueError: ``record`` has a ``seq`` or ``crc32`` key.
            DurableWriteError: Writing or syncing the batch failed (``errno``
                says why, e.g. ``ENOSPC``, ``EIO``), or it was not confirmed
                within ``timeout_s`` (``ETIMEDOUT``; the line may still land).
                The journal stays usable.
        """
        loop = self._require_open()
        if not isinstance(record, dict):
            raise TypeError(f"a journal record must be a dict, not {type(record).__name__}")
        reserved = _RESERVED_KEYS.intersection(record)
        if reserved:
            raise ValueError(f"a journal record must not have {sorted(reserved)} keys: the journal adds them")
        try:
            payload = orjson.dumps(record)
        except orjson.JSONEncodeError as exc:
            raise TypeError(f"journal record is not JSON-serialisable: {exc}") from exc
        if self._file is not None:
            [outcome] = self._commit(self._file, [payload])
            if isinstance(outcome, BaseException):
                self._failures += 1
                raise outcome
            return outcome
        future: asyncio.Future[int] = loop.create_future()
        self._queue.put(_Append(payload, future))
        try:
            async with asyncio.timeout(self._timeout_s):
                return await future
        except DurableWriteError:
            self._failures += 1
            raise
        except TimeoutError as exc:
            self._failures += 1
            raise DurableWriteError(
                errno.ETIMEDOUT,
                f"journal {self._path}: the record was not confirmed on disk within {self._timeout_s} s "
                "(it may still be written)",
            ) from exc

    async def aclose(self) -> None:
        """Write and sync every queued record, then stop the writer thread.

        Closing twice, or closing a journal that was never opened, is a no-op.

        **Cancellation:** the journal is closed at once; the writer thread still
        finishes the queued records in the background and then exits.

        Raises:
            DurableWriteError: The writer did not finish within ``timeout_s``
                (a hung disk); its thread is left to exit on its own.
        """
        if self._state is JournalState.UNOPENED:
            self._state = JournalState.CLOSED
            return
        if self._state is JournalState.CLOSED:
            return
        self._state = JournalState.CLOSED
        if self._file is not None:
            file, self._file = self._file, None
            with contextlib.suppress(OSError):
                os.close(file.fd)
            return
        self._queue.put(_STOP)
        assert self._stopped is not None  # set whenever the state is OPEN
        try:
            async with asyncio.timeout(self._timeout_s):
                await wait_shared(self._stopped)
        except TimeoutError as exc:
            raise DurableWriteError(
                errno.ETIMEDOUT, f"journal {self._path}: closing took longer than {self._timeout_s} s"
            ) from exc

    def _require_open(self) -> asyncio.AbstractEventLoop:
        if self._state is not JournalState.OPEN:
            raise RuntimeError(f"journal {self._path} is {self._state.value}; use it inside 'async with'")
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise RuntimeError(f"journal {self._path} belongs to another event loop")
        return loop

    # ------------------------------------------------------------ the writer thread

    def _run(self, loop: asyncio.AbstractEventLoop, opened: asyncio.Future[None]) -> None:
        fd = -1
        try:
            try:
                fd, good_size = self._open_file()
            except BaseException as exc:
                _call_soon(loop, _settle_open, opened, exc)
                return
            _call_soon(loop, _settle_open, opened, None)
            self._serve(loop, fd, good_size)
        finally:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if self._stopped is not None:
                _call_soon(loop, _settle_stopped, self._stopped)

    def _open_file(self) -> tuple[int, int]:
        """Open or create the file, find its intact prefix and cut off a torn tail."""
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            try:
                fd = os.open(self._path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(self._path, flags)
                created = False
        except OSError as exc:
            raise _write_error(f"cannot open journal {self._path}", exc) from exc
        try:
            if os.fstat(fd).st_mode & 0o7777 != self._mode:
                os.fchmod(fd, self._mode)
            if created:
                # The file's name must be as durable as the lines it will hold.
                fsync_directory(os.path.dirname(os.path.abspath(self._path)))
                return fd, 0
            data = _read_all(fd)
            scan = _scan(data, self._path)
            if scan.damaged_tail is not None:
                logger.warning("%s: cutting off the last line: %s", self._path, scan.damaged_tail)
            if scan.good_size != len(data):
                os.ftruncate(fd, scan.good_size)
                _sync_data(fd)
            self._seq = len(scan.records)
            return fd, scan.good_size
        except BaseException as exc:
            os.close(fd)
            if isinstance(exc, OSError):
                raise _write_error(f"cannot open journal {self._path}", exc) from exc
            raise

    def _serve(self, loop: asyncio.AbstractEventLoop, fd: int, good_size: int) -> None:
        file = AppendCursor(fd, good_size)
        stopping = False
        while not stopping:
            batch, stopping = self._next_batch()
            if batch:
                outcomes = self._commit(file, [entry.payload for entry in batch])
                settled = [(entry.future, outcome) for entry, outcome in zip(batch, outcomes, strict=True)]
                _call_soon(loop, _settle_appends, settled)

    def _next_batch(self) -> tuple[list[_Append], bool]:
        """Wait for work, then take everything queued with it: this is the group commit."""
        batch: list[_Append] = []
        stopping = False
        item = self._queue.get()
        while True:
            if isinstance(item, _Stop):
                stopping = True
            else:
                batch.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return batch, stopping

    def _commit(self, file: AppendCursor, batch: list[bytes]) -> list[int | BaseException]:
        """Write and sync one batch of serialised records; each one's ``seq``, or the batch's error."""
        seq = self._seq
        try:
            data = b"".join(_frame(seq + i, payload) for i, payload in enumerate(batch, start=1))
            # A failed batch is cut off again: the next batch reuses these seqs.
            file.append(data)
        except Exception as exc:
            message = f"journal {self._path}: appending {len(batch)} record(s) failed"
            return [_write_error(message, exc) for _ in batch]
        self._seq = seq + len(batch)
        return list(range(seq + 1, seq + len(batch) + 1))


@dataclass(slots=True)
class AppendCursor:
    """The intact end of an append-only file: each append lands there whole and synced, or not at all.

    A write or sync that fails (disk full, EIO) is cut back off the file, now if
    possible, else before the next append, so a reader never meets a torn line
    that a later append was written after. Blocking: use it from a thread.

    Attributes:
        fd: The file, open for writing (without ``O_APPEND``: appends use ``pwrite``).
        good_size: Bytes of intact, synced data: where the next append is written.
        dirty: Bytes of a failed append may lie past ``good_size`` and must be cut off first.
    """

    fd: int
    good_size: int
    dirty: bool = False

    def append(self, data: bytes) -> None:
        """Write ``data`` at ``good_size`` and sync it; on failure cut it back off and raise.

        Raises:
            OSError: Writing, syncing or cutting back a previous failure failed.
        """
        if self.dirty:
            os.ftruncate(self.fd, self.good_size)
            self.dirty = False
        self.dirty = True
        try:
            _pwrite_all(self.fd, data, self.good_size)
            _sync_data(self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.good_size)
                self.dirty = False
            raise
        self.dirty = False
        self.good_size += len(data)


def _sync_data(fd: int) -> None:
    # fdatasync skips metadata that does not matter for reading the data back
    # (mtime); where it does not exist (macOS), fsync is the safe fallback.
    sync = getattr(os, "fdatasync", None) or os.fsync
    sync(fd)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    # The loop may be gone already (closed without aclose()); nobody is waiting then.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def _settle_open(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _settle_stopped(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle_appends(outcomes: list[_Outcome]) -> None:
    for future, outcome in outcomes:
        if future.done():  # the caller stopped waiting (cancelled or timed out)
            continue
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
