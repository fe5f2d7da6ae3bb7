"""Interactive sessions in a sandbox: a command (or the image's shell) on a terminal, or on pipes.

:meth:`rollcage.gym_sandbox._cage.CagedSandbox.open_session` starts one; this module is the live
session (NeMo Gym's ``SandboxPtySession``, without importing NeMo Gym: the provider names the error
class a dead session raises).

* **PTY mode**: the terminal pair is made in the cage's own ``devpts`` (``/dev/pts/ptmx`` under its
  init's root), so the command's ``tty`` names it as the cage sees it; the slave is the command's
  stdin, stdout and stderr and its controlling terminal (the joiner's fork leads its session and
  takes it, ``TIOCSCTTY``), sized before it executes. **Pipe mode**: three pipes, stderr apart.
* Output is read as the consumer takes it, at most ``limit`` bytes held per stream: past that the
  stream is not read until the consumer catches up (the command blocks on a full terminal or pipe),
  so memory stays bounded and nothing is dropped. Every byte read is counted and hashed.
* :meth:`CageSession.close` (idempotent; the sandbox's close calls it for every open session) kills
  the session's process group and the command, reaps it, and journals the session in ``execs.jsonl``
  as one line like an exec's: command, mode, start, duration, exit status, bytes and SHA-256 of each
  stream, whether the close ended it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import hashlib
import os
import signal
import struct
import termios
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

from rollcage.errors import SandboxError
from rollcage.gym_sandbox._joiner import Started
from rollcage.procs import shielded, signal_group, within

__all__ = ["CageSession", "SessionEnded", "open_terminal", "set_size"]

_REAP_S: Final = 10.0
_TIOCSPTLCK: Final = 0x40045431
"""``ioctl(master, TIOCSPTLCK, &0)``: unlock the slave (``unlockpt``; not in Python's ``termios``)."""
_TIOCGPTPEER: Final = 0x5441
"""``ioctl(master, TIOCGPTPEER, flags)``: the slave of a terminal pair as a descriptor (Linux 4.13)."""


class SessionEnded(SandboxError):
    """A session that cannot be used: closed, or its sandbox closed under it (not an exit)."""


def open_terminal(init_pid: int) -> tuple[int, int]:
    """A terminal pair (master, slave), made in the ``devpts`` of the cage whose init is ``init_pid``.

    Where the cage's instance cannot be reached, the host's (``os.openpty``): a working terminal,
    which the command's ``tty`` cannot name.
    """
    flags = os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC
    try:
        master = os.open(f"/proc/{init_pid}/root/dev/pts/ptmx", flags)
    except OSError:
        master, slave = os.openpty()
        os.set_inheritable(master, False)
        os.set_inheritable(slave, False)
        return master, slave
    try:
        fcntl.ioctl(master, _TIOCSPTLCK, struct.pack("i", 0))
        slave = int(fcntl.ioctl(master, _TIOCGPTPEER, flags))
    except OSError:
        os.close(master)
        master, slave = os.openpty()
        os.set_inheritable(master, False)
        os.set_inheritable(slave, False)
    return master, slave


def set_size(fd: int, rows: int, cols: int) -> None:
    """Size the terminal of ``fd`` (its foreground group gets ``SIGWINCH``).

    Raises:
        ValueError: ``rows`` or ``cols`` is not 1..65535.
    """
    for name, value in (("rows", rows), ("cols", cols)):
        if not isinstance(value, int) or not 0 < value < 1 << 16:
            raise ValueError(f"a terminal's {name} must be 1..65535, not {value!r}")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def on_ready() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_writer(fd, on_ready)
    try:
        await ready
    finally:
        loop.remove_writer(fd)


class _Stream:
    """One output stream of a session, read as its consumer takes it (see the module docstring)."""

    def __init__(self, fd: int, limit: int) -> None:
        self.fd = fd
        self.limit = max(limit, 1)
        self.chunks: collections.deque[bytes] = collections.deque()
        self.held = 0
        self.eof = False
        self.total = 0
        self.digest = hashlib.sha256()
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._reading = False
        os.set_blocking(fd, False)
        self._resume()

    def _resume(self) -> None:
        if not self._reading and not self.eof and self.fd >= 0:
            self._loop.add_reader(self.fd, self._on_readable)
            self._reading = True

    def _pause(self) -> None:
        if self._reading:
            self._loop.remove_reader(self.fd)
            self._reading = False

    def _take(self) -> bytes | None:
        """What the descriptor has now: bytes, ``b""`` at its end, ``None`` if nothing yet."""
        try:
            return os.read(self.fd, 65536)
        except BlockingIOError:
            return None
        except OSError as exc:
            # A terminal's master reads EIO once every slave is closed: its end of file.
            if exc.errno == errno.EIO:
                return b""
            raise

    def _on_readable(self) -> None:
        data = self._take()
        if data is None:
            return
        if not data:
            self.eof = True
            self._pause()
        else:
            self.total += len(data)
            self.digest.update(data)
            self.chunks.append(data)
            self.held += len(data)
            if self.held >= self.limit:
                self._pause()  # the consumer is behind: the command waits on a full buffer
        self._changed.set()

    async def read(self, timeout_s: float | None) -> bytes:
        async with asyncio.timeout(timeout_s):
            while not self.chunks and not self.eof:
                self._changed.clear()
                await self._changed.wait()
        if not self.chunks:
            return b""
        chunk = self.chunks.popleft()
        self.held -= len(chunk)
        if self.held < self.limit:
            self._resume()
        return chunk

    def finish(self) -> None:
        """Count what is left in the descriptor (not kept), then close it; idempotent."""
        if self.fd < 0:
            return
        self._pause()
        with contextlib.suppress(OSError):
            while data := self._take():
                self.total += len(data)
                self.digest.update(data)
        os.close(self.fd)
        self.fd = -1
        self.eof = True
        self._changed.set()


class CageSession:
    """One live session in a sandbox (NeMo Gym's ``SandboxPtySession``; see the module docstring).

    Attributes:
        session_id: Unique on this host.
        mode: ``"pty"`` or ``"pipe"``.
    """

    def __init__(
        self,
        *,
        started: Started,
        mode: str,
        stdin: int,
        stdout: int,
        stderr: int | None,
        limit: int,
        error: type[Exception],
        on_close: Callable[[CageSession, dict[str, Any]], Awaitable[None]],
        record: dict[str, Any],
    ) -> None:
        self.session_id = f"rollcage-session-{uuid.uuid4().hex[:12]}"
        self.mode: str | None = mode
        self._started = started
        self._child = started.child
        self._stdin = stdin
        self._out = _Stream(stdout, limit)
        self._err = None if stderr is None else _Stream(stderr, limit)
        self._limit = limit
        self._error = error
        self._on_close = on_close
        self._record = record
        self._clock = time.monotonic()
        self._code: int | None = None
        self._closed = False
        self._ended_by_close = False
        self._written = 0
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int:
        """The command's host PID (the leader of its session and process group)."""
        return self._child.pid

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise self._error(f"rollcage session {self.session_id} is closed")

    def _exit_code(self) -> int | None:
        if self._code is None and not self._child.reaped:
            self._code = self._child.reap()
        return self._code

    async def read(self, *, timeout_s: float | None = None) -> bytes:
        """The next output chunk (the terminal's in PTY mode, stdout in pipe mode); ``b""`` at its end.

        Raises:
            TimeoutError: Nothing came within ``timeout_s``.
            SandboxPtyError (the provider's error class): The session is closed.

        **Cancellation:** nothing is lost: a chunk not yet taken stays for the next read.
        """
        self._check_open()
        return await self._out.read(timeout_s)

    async def read_stderr(self, *, timeout_s: float | None = None) -> bytes:
        """The next stderr chunk in pipe mode; in PTY mode ``b""`` once the command exited.

        Raises:
            TimeoutError, SandboxPtyError: As :meth:`read`.

        **Cancellation:** as :meth:`read`.
        """
        self._check_open()
        if self._err is not None:
            return await self._err.read(timeout_s)
        await self.wait_exit(timeout_s=timeout_s)
        return b""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        """Output chunks until the end of the stream.

        **Cancellation:** as :meth:`read`.
        """
        while chunk := await self.read():
            yield chunk

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the command's stdin (the terminal's input in PTY mode).

        Raises:
            SandboxPtyError: The session is closed, or nothing reads its input any more.

        **Cancellation:** part of ``data`` may have been written; the session stays usable.
        """
        self._check_open()
        view = memoryview(bytes(data))
        loop = asyncio.get_running_loop()
        async with self._lock:
            while view:
                try:
                    done = os.write(self._stdin, view)
                except BlockingIOError:
                    await _writable(loop, self._stdin)
                    continue
                except OSError as exc:
                    raise self._error(
                        f"rollcage session {self.session_id}: its command takes no more input ({exc})"
                    ) from exc
                self._written += done
                view = view[done:]

    async def resize(self, rows: int, cols: int) -> None:
        """Size the terminal (PTY mode; nothing in pipe mode).

        Raises:
            ValueError: ``rows`` or ``cols`` out of range.
            SandboxPtyError: The session is closed.

        **Cancellation:** nothing to undo.
        """
        self._check_open()
        if self.mode == "pty":
            set_size(self._stdin, rows, cols)

    async def send_signal(self, signal_name: str) -> None:
        """Send the named signal (``"SIGTERM"``, ``"INT"``) to the session's process group.

        Raises:
            ValueError: No such signal.
            SandboxPtyError: The session is closed.

        **Cancellation:** nothing to undo.
        """
        self._check_open()
        name = str(signal_name).upper()
        try:
            number = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except KeyError:
            raise ValueError(f"no signal named {signal_name!r}") from None
        if not self._child.reaped:  # unreaped, its PID is still the group's
            signal_group(self._child.pid, number)

    async def wait_exit(self, *, timeout_s: float | None = None) -> int:
        """Wait for the command to exit; its exit status (``128 + N`` when signal N ended it).

        Raises:
            TimeoutError: It still runs after ``timeout_s``.
            SandboxPtyError: The session was closed before it exited.

        **Cancellation:** the command runs on; wait again or close.
        """
        if self._code is not None:
            return self._code
        self._check_open()
        async with asyncio.timeout(timeout_s):
            await self._child.wait()
        code = self._exit_code()
        if code is None:
            raise self._error(f"rollcage session {self.session_id}: its command ended without an exit status")
        return code

    async def run_detached(self, command: str, *, poll_interval_s: float = 15.0) -> tuple[bytes, int | None]:
        """Run ``command`` in this session's shell; ``(its output, its exit status or None)``.

        The session is this process's own, so nothing is detached: the output is held here, up to
        the sandbox's ``output_bytes``; more raises rather than returning it cut (``poll_interval_s``
        is accepted for NeMo Gym's signature).

        Raises:
            SandboxPtyError: The session ended before the command finished, or its output passed the bound.

        **Cancellation:** the command runs on in the shell; close the session rather than reuse it.
        """
        del poll_interval_s
        token = f"RCPTY{uuid.uuid4().hex[:12]}"
        needle = f"{token}:".encode()
        # The markers are split across two printf arguments so the terminal's echo never matches.
        await self.write(
            f"{{ printf '%s%s\\n' '{token[:5]}' '{token[5:]}S'\n{command}\n"
            f"printf '%s%s:%s\\n' '{token[:5]}' '{token[5:]}' \"$?\"\n}} </dev/null\n".encode()
        )
        buffer = bytearray()
        while needle not in buffer or b"\n" not in buffer.partition(needle)[2]:
            chunk = await self.read()
            if not chunk:
                raise self._error(f"rollcage session {self.session_id} ended before {command!r} finished")
            buffer += chunk
            if len(buffer) > self._limit + 4096:
                raise self._error(
                    f"rollcage session {self.session_id}: {command!r} printed more than the "
                    f"{self._limit} bytes a detached run keeps; run it through exec instead"
                )
        output, _, trailing = bytes(buffer).partition(needle)
        _, seen, after = output.partition(f"{token}S".encode())
        if seen:
            output = after.partition(b"\n")[2]
        status = trailing.split(b"\n", 1)[0].strip()
        return output, int(status) if status.isdigit() else None

    async def close(self) -> None:
        """End the session: kill its process group, reap the command, journal it; idempotent.

        **Cancellation:** the reaping and the journal line still happen (shielded).
        """
        if self._closed:
            return
        self._closed = True
        await shielded(self._end())

    async def _end(self) -> None:
        child = self._child
        if child.exited() is None and not child.reaped:
            self._ended_by_close = True
            signal_group(child.pid, signal.SIGKILL)
            child.kill()
        await within(child.wait(), _REAP_S)
        # Its group may hold what it started, past its own death: the group's PID is ours until reaped.
        if not child.reaped:
            signal_group(child.pid, signal.SIGKILL)
        code = self._exit_code()
        if code is None and not child.reaped:
            child.abandon()
        self._started.status.close()
        with contextlib.suppress(OSError):
            os.close(self._stdin)
        streams = [self._out, *([self._err] if self._err is not None else [])]
        for stream in streams:
            stream.finish()
        out, err = self._out, self._err
        record = {
            **self._record,
            "session": self.session_id,
            "mode": self.mode,
            "duration_s": round(time.monotonic() - self._clock, 6),
            "exit_code": code,
            "ended_by_close": self._ended_by_close,
            "timed_out": False,
            "cage_failed": False,
            "truncated": False,
            "stdin_bytes": self._written,
            "stdout_bytes": out.total,
            "stdout_sha256": out.digest.hexdigest(),
            "stderr_bytes": 0 if err is None else err.total,
            "stderr_sha256": (hashlib.sha256() if err is None else err.digest).hexdigest(),
        }
        await self._on_close(self, record)

    async def __aenter__(self) -> CageSession:
        """The session itself.

        **Cancellation:** nothing to undo.
        """
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Close the session (:meth:`close`).

        **Cancellation:** as :meth:`close`.
        """
        await self.close()
