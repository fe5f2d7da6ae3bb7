"""A long-lived sandbox on rollcage's cage: an image's copy-on-write root, commands run in it one by one.

This module knows nothing of NeMo Gym (:mod:`rollcage.gym_sandbox.provider` adapts it). One
:class:`CagedSandbox` is what a container is to ``docker exec``:

* **create**: the image is pulled and unpacked once per node (:class:`rollcage.images.ImageStore`),
  leased so ``rollcage images prune`` keeps it, and mounted copy-on-write for this sandbox
  (:func:`rollcage.supervisor.imageroot.mount_image_root`: an id-mapped lower, the writes on a
  bounded tmpfs, so the disk budget holds); a memory and process budget is one cgroup set that
  every command of the sandbox runs in. A first command (making the working directory) proves the
  cage can be built before the handle is returned.
* **exec**: the sandbox is one cage, made by bubblewrap at create around a holder process: root
  drops to an unprivileged host uid before the user namespace is made, the image's user inside (its
  files are that uid's), no capabilities, no network, its own PID, IPC and UTS namespaces. Each
  command joins that cage (all its namespaces at once, then every capability and the uid given up, as
  a warm worker does) with the image's ``Env``: forked there by a joiner (a small fork server
  outside every cage, one per provider: :mod:`rollcage.gym_sandbox._joinserver`), or, where none can
  be reached, by a fresh helper interpreter (:mod:`rollcage.gym_sandbox._join`). So what one
  command starts in the background (a server a later command talks to) lives on until close, as in
  a container. A bound on wall-clock time kills the command's process group; output is kept up to
  a bound. A handshake printed from inside the cage before the command starts tells a cage that
  could not be entered from a command that failed.
* **sessions**: :meth:`CagedSandbox.open_session` starts a live command or shell on a terminal or
  pipes (:mod:`rollcage.gym_sandbox._session`), forked by the joiner as a command is.
* **its init**: the holder is the cage's PID 1 (``bwrap --as-pid-1``), so a command's
  ``kill -KILL -1`` cannot end the sandbox; it reaps what is orphaned to it after each command.
* **files**: uploads and downloads run as commands in the cage (``cat``), so every path is resolved
  inside the sandbox's root as its user sees it: nothing outside it can be named.
* **close**: everything in the cgroups is killed, the cgroups removed, the root unmounted (its
  writes kept as ``changes/``, the evidence), the image's lease released.

Evidence: the sandbox's directory holds ``sandbox.json`` (what it was made from, when it closed)
and ``execs.jsonl``, one line per command, each written and flushed to disk before the command's
result is returned: the command, its working directory, when it started, how long it ran, how it
ended, and the size and SHA-256 of what it printed.

Only root can mount the root (bubblewrap 0.8 has no overlay); any other user is refused at create
with one line saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import secrets
import signal
import stat
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from rollcage.budgets import CgroupSet, kill_cgroup, remove_cgroup
from rollcage.cage import BwrapTools, find_tools
from rollcage.durable import fsync_directory, publish_json
from rollcage.errors import SandboxError
from rollcage.gym_sandbox._joiner import Joiner, JoinerUnavailable, Started
from rollcage.gym_sandbox._session import CageSession, SessionEnded, open_terminal, set_size
from rollcage.images import ImageStore, image_sandbox
from rollcage.procs import PidHandle, ProcInfo, read_proc, read_ready, shielded, signal_group, within
from rollcage.protocol import ImageSandbox
from rollcage.supervisor.imageroot import ImageRoot, mount_image_root, release_image_root

__all__ = [
    "DEFAULT_OWNER",
    "CagedSandbox",
    "CommandResult",
    "SandboxBudgets",
    "attach_sandbox",
    "open_sandbox",
    "release_abandoned",
]

DEFAULT_OWNER: Final = (65534, 65534)
"""The unprivileged host uid and gid a sandbox's commands run as (the supervisor's default too)."""

CAGE_FAILED: Final = 125
"""The exit status reported when the cage itself could not be made (no command ran)."""

_HANDSHAKE: Final = 'printf "%s\\n" "$1" && shift && exec "$@"'
_UPLOAD: Final = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
_DOWNLOAD: Final = 'test -f "$1" || { echo "no such regular file: $1" >&2; exit 2; }; exec cat -- "$1"'
_REAP_S: Final = 10.0
_ATTACH: Final = "attach.json"
_TAIL: Final = 1 << 20  # read back to find the last line's number (a line is far smaller)
_JOIN: Final = str(Path(__file__).with_name("_join.py"))
# The cage's PID 1 (bwrap --as-pid-1): a command's ``kill -KILL -1`` reaches every process of the
# cage but its init, so the sandbox outlives it. It makes the working directory (as docker makes
# WorkingDir), says it is ready (one byte: the cage was built and runs the image's shell), then
# reads its stdin until its end (the provider closing the sandbox, or dying), ignoring polite
# signals. Each line the provider sends (after every command: :meth:`CagedSandbox._reap_orphans`)
# makes it run ``jobs``, whose wait for any child reaps what was orphaned to it (a background
# service's children, once they end), as bubblewrap's own init did. Its death takes the cage's
# PID namespace along.
_HOLDER: Final = (
    "trap '' HUP INT QUIT TERM USR1 USR2; mkdir -p -- \"$1\" || exit 125; printf r; exec >/dev/null; "
    'while :; do IFS= read -r _; s=$?; jobs >/dev/null; [ "$s" = 1 ] && exit 0; done'
)
_READY_S: Final = 120.0


@dataclass(frozen=True)
class SandboxBudgets:
    """What one sandbox may use; ``None``: no bound of that kind beyond the defaults.

    Attributes:
        memory_bytes: Total memory of all its processes (a cgroup).
        disk_bytes: What it may write into its root (the copy-on-write upper's tmpfs size).
        max_processes: Processes and threads at once (a cgroup).
        output_bytes: Bytes kept of each command's stdout and of its stderr.
        file_bytes: Largest file a download may bring back.
    """

    memory_bytes: int | None = None
    disk_bytes: int | None = 10 << 30
    max_processes: int | None = 1024
    output_bytes: int = 8 << 20
    file_bytes: int = 256 << 20


@dataclass(frozen=True)
class CommandResult:
    """How one command in the sandbox ended.

    Attributes:
        exit_code: Its exit status (``128 + N`` when signal N ended it; :data:`CAGE_FAILED` when the
            cage could not be made).
        stdout: The first ``output_bytes`` of its standard output.
        stderr: The first ``output_bytes`` of its standard error.
        truncated: Some output was dropped.
        timed_out: The time bound fired and its whole tree was killed.
        cage_failed: The cage could not be made; nothing of the command ran (``stderr`` says why).
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    cage_failed: bool


@dataclass
class CagedSandbox:
    """One sandbox: an image's root mounted for it, budgets, a journal (see the module docstring)."""

    sandbox_id: str
    directory: Path
    image: ImageSandbox
    root: ImageRoot
    owner: tuple[int, int]
    env: dict[str, str]
    workdir: str
    budgets: SandboxBudgets
    cgroups: CgroupSet | None
    enter: list[str]
    """The argv prefix that moves a command into the sandbox's cgroups."""
    holder: asyncio.subprocess.Process | None
    """The holder this process started; ``None`` for a sandbox attached from another process."""
    holder_fd: PidHandle
    """A pidfd on the cage's init, checked against its start time: what every command joins."""
    _lease: contextlib.ExitStack
    created_at: float = field(default_factory=time.time)
    _running: set[int] = field(default_factory=set)
    closed: bool = False
    procs_files: list[str] = field(default_factory=list)
    """The sandbox's ``cgroup.procs`` files (what :attr:`enter` writes each command into)."""
    joiner: Joiner | None = None
    """The fork server that starts its commands; ``None``: a fresh helper interpreter per command."""
    owns_joiner: bool = False
    """Whether :meth:`close` stops :attr:`joiner` (it is the sandbox's own, not its provider's)."""
    sessions: set[CageSession] = field(default_factory=set)
    """Its open sessions (:meth:`open_session`): its close ends them."""

    @property
    def journal_path(self) -> Path:
        """The exec journal (one JSON object a line)."""
        return self.directory / "execs.jsonl"

    def is_running(self) -> bool:
        """Open, its cage's holder alive, and its root still mounted."""
        alive = self.holder is None or self.holder.returncode is None
        return not self.closed and alive and os.path.ismount(self.root.merged)

    def _join_argv(
        self, argv: Sequence[str], cwd: str, env: Mapping[str, str], uid: tuple[int, int]
    ) -> list[str]:
        spec = {"holder": self.holder_fd.fd, "uid": uid[0], "gid": uid[1], "cwd": cwd, "env": dict(env)}
        return [
            *self.enter,
            sys.executable,
            "-I",
            "-S",
            _JOIN,
            json.dumps({**spec, "argv": list(argv)}),
        ]

    def resolve_uid(self, user: str | int | None) -> tuple[int, int]:
        """The ``(uid, gid)`` a command runs as: the image's user, or ``user`` if it is that same user.

        The id-mapped root makes the image user's files the sandbox's own; another uid would see
        them as its own too, which no container gives, so only the image's user is accepted.

        Raises:
            ValueError: ``user`` is another user (or a name other than the image's ``User``).
        """
        own = (self.image.uid, self.image.gid)
        if user is None:
            return own
        # The names the image's user goes by: its uid, its configured User, and root for uid 0.
        names = {str(own[0]), *([self.image.user.partition(":")[0]] if self.image.user else [])}
        if own[0] == 0:
            names.add("root")
        if str(user) not in names:
            raise ValueError(
                f"the rollcage sandbox runs commands as the image's user (uid {own[0]}), not as {user!r}"
            )
        return own

    async def run(
        self,
        command: str,
        *,
        args: Sequence[str] = (),
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None,
        user: str | int | None = None,
        stdin: bytes = b"",
        output_bytes: int | None = None,
        journal: bool = True,
    ) -> CommandResult:
        """Run ``/bin/sh -c command sh *args`` in the sandbox; journal it (see the module docstring).

        Raises:
            SandboxError: The sandbox is closed.
            ValueError: ``user`` cannot be honoured (:meth:`resolve_uid`).

        **Cancellation:** the command's group is killed and reaped; it is not journaled. (Cancelled
        while the joiner is still forking it, a command may start all the same: it runs until the
        sandbox closes, which kills everything in its cgroups.)
        """
        if self.closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed; create a new one")
        uid = self.resolve_uid(user)
        workdir = cwd or self.workdir
        merged_env = {**self.env, **(env or {})}
        marker = f"rollcage-cage-started-{secrets.token_hex(8)}"
        argv = self._join_argv(
            ["/bin/sh", "-c", _HANDSHAKE, "rollcage-cage", marker, "/bin/sh", "-c", command, "sh", *args],
            workdir,
            merged_env,
            uid,
        )
        limit = output_bytes if output_bytes is not None else self.budgets.output_bytes
        started_at = time.time()
        clock = time.monotonic()
        result: CommandResult | None = None
        if self.joiner is not None:
            with contextlib.suppress(JoinerUnavailable):  # the slow path below, as without a joiner
                result = await self._run_joined(
                    self.joiner,
                    ["/bin/sh", "-c", command, "sh", *args],
                    (workdir, merged_env, uid),
                    stdin,
                    timeout_s,
                    limit,
                )
        if result is None:
            result = await self._communicate(argv, marker.encode() + b"\n", stdin, timeout_s, limit)
        self._reap_orphans()
        if journal:
            await asyncio.to_thread(
                self._append,
                {
                    "command": command,
                    "args": list(args),
                    "cwd": workdir,
                    "uid": uid[0],
                    "started_at": started_at,
                    "duration_s": round(time.monotonic() - clock, 6),
                    "exit_code": result.exit_code,
                    "timed_out": result.timed_out,
                    "cage_failed": result.cage_failed,
                    "truncated": result.truncated,
                    "stdin_bytes": len(stdin),
                    "stdout_bytes": len(result.stdout),
                    "stdout_sha256": hashlib.sha256(result.stdout).hexdigest(),
                    "stderr_bytes": len(result.stderr),
                    "stderr_sha256": hashlib.sha256(result.stderr).hexdigest(),
                },
            )
        return result

    async def _run_joined(
        self,
        joiner: Joiner,
        argv: list[str],
        where: tuple[str, Mapping[str, str], tuple[int, int]],
        stdin: bytes,
        timeout_s: float | None,
        limit: int,
    ) -> CommandResult:
        """Run ``argv`` in the cage through the joiner: a fork, not an interpreter, per command.

        The same promises as :meth:`_communicate`: its own session (the time bound kills that
        group), output kept up to ``limit``, and a cage that could not be entered told apart (the
        joiner's fork says why on the start's reply socket; the command's execution closes it).

        Raises:
            JoinerUnavailable: The joiner could not take the command (nothing started: take the slow path).
        """
        cwd, env, uid = where
        pipes = _Pipes()
        try:
            try:
                started = await joiner.start(
                    self.holder_fd.fd,
                    argv,
                    env=env,
                    cwd=cwd,
                    uid=uid,
                    cgroups=self.procs_files,
                    stdio=pipes.theirs,
                )
            except JoinerUnavailable:
                raise
            except SandboxError as exc:
                return _cage_failed(str(exc))
            finally:
                pipes.close_theirs()
            return await self._await_joined(started, pipes, stdin, timeout_s, limit)
        finally:
            pipes.close()

    async def _await_joined(
        self, started: Started, pipes: _Pipes, stdin: bytes, timeout_s: float | None, limit: int
    ) -> CommandResult:
        child = started.child
        self._running.add(child.pid)
        out, err = _Sink(limit), _Sink(limit)
        timed_out, failed = False, None
        try:
            async with asyncio.timeout(timeout_s):
                failed = await started.entered()
                if failed is None:
                    await asyncio.gather(
                        _feed_fd(pipes.take(0), stdin),
                        out.drain_fd(pipes.ours[1]),
                        err.drain_fd(pipes.ours[2]),
                        child.wait(),
                    )
        except TimeoutError:
            timed_out = True
        finally:
            if child.exited() is None:
                # It leads its own session (the command's group); unreaped, its PID is still it.
                signal_group(child.pid, signal.SIGKILL)
                child.kill()
            await shielded(within(child.wait(), _REAP_S))
            code = child.reap()
            self._running.discard(child.pid)
            started.status.close()
        if failed is not None and not timed_out:
            return _cage_failed(f"cannot enter the sandbox's cage: {failed}")
        return CommandResult(
            exit_code=CAGE_FAILED if timed_out or code is None else code,
            stdout=bytes(out.kept),
            stderr=bytes(err.kept),
            truncated=out.dropped or err.dropped,
            timed_out=timed_out,
            cage_failed=False,
        )

    async def _communicate(
        self, argv: list[str], marker: bytes, stdin: bytes, timeout_s: float | None, limit: int
    ) -> CommandResult:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
            cwd="/",
            # Its own session and group, which the command it starts in the cage is in too: the
            # time bound kills the group (a service that left it with setsid lives on until close).
            start_new_session=True,
            pass_fds=[self.holder_fd.fd],
        )
        self._running.add(process.pid)
        out, err = _Sink(limit + len(marker)), _Sink(limit)
        assert process.stdin is not None and process.stdout is not None and process.stderr is not None
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(
                    _feed(process.stdin, stdin),
                    out.drain(process.stdout),
                    err.drain(process.stderr),
                    process.wait(),
                )
        except TimeoutError:
            timed_out = True
        finally:
            if process.returncode is None:
                # The helper leads the group the command (in the cage) and its children are in.
                signal_group(process.pid, signal.SIGKILL)
            await shielded(within(process.wait(), _REAP_S))
            self._running.discard(process.pid)
        started = out.kept.startswith(marker)
        code = process.returncode if process.returncode is not None else -signal.SIGKILL
        if code < 0:
            code = 128 - code
        if not started and not timed_out:
            return _cage_failed(err.kept.decode("utf-8", "replace").strip()[-500:] or f"exit status {code}")
        stdout = bytes(out.kept[len(marker) :]) if started else b""
        return CommandResult(
            exit_code=CAGE_FAILED if timed_out else code,
            stdout=stdout,
            stderr=bytes(err.kept),
            truncated=out.dropped or err.dropped,
            timed_out=timed_out,
            cage_failed=False,
        )

    def _append(self, record: dict[str, Any]) -> None:
        """Append one line, numbered after the journal's last, and flush it to disk.

        Under an exclusive lock: an attached process (:func:`attach_sandbox`) appends to the same
        journal, and the numbers must stay one sequence.
        """
        fd = os.open(self.journal_path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _TAIL), size - min(size, _TAIL))
            last = 0
            for previous in reversed(tail.splitlines()):
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    last = int(json.loads(previous)["seq"])
                    break
            line = json.dumps({"seq": last + 1, **record}, sort_keys=True).encode() + b"\n"
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)

    async def open_session(
        self,
        command: str | None,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        user: str | int | None = None,
        rows: int = 24,
        cols: int = 80,
        pty: bool = True,
        error: type[Exception] = SessionEnded,
    ) -> CageSession:
        """Start ``/bin/sh -c command`` (``None``: the image's shell, ``/bin/sh -i``) as a live session.

        On a terminal sized ``rows`` x ``cols`` (its controlling terminal), or with ``pty=False`` on
        three pipes; see :mod:`rollcage.gym_sandbox._session`. A closed session raises ``error``.

        Raises:
            SandboxError: The sandbox is closed, its joiner cannot be reached, or the cage could not
                be entered (the message says why).
            ValueError: ``user``, ``rows`` or ``cols`` cannot be honoured.

        **Cancellation:** a command already started is killed and reaped.
        """
        if self.closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed; create a new one")
        if self.joiner is None:
            raise SandboxError(f"sandbox {self.sandbox_id} has no joiner to start a session with")
        uid = self.resolve_uid(user)
        workdir = cwd or self.workdir
        merged_env = {**self.env, **(env or {})}
        if pty:
            merged_env.setdefault("TERM", "xterm")
        argv = ["/bin/sh", "-i"] if command is None else ["/bin/sh", "-c", command]
        ours: list[int] = []
        theirs: list[int] = []
        try:
            if pty:
                master, slave = open_terminal(self.holder_fd.info.pid)
                ours, theirs = [master], [slave]
                set_size(master, rows, cols)
                stdio = (slave, slave, slave)
            else:
                pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(3)]
                ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
                theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
                stdio = (theirs[0], theirs[1], theirs[2])
            started_at = time.time()
            try:
                started = await self.joiner.start(
                    self.holder_fd.fd,
                    argv,
                    env=merged_env,
                    cwd=workdir,
                    uid=uid,
                    cgroups=self.procs_files,
                    stdio=stdio,
                    tty=pty,
                )
            finally:
                for fd in theirs:
                    os.close(fd)
                theirs = []
            failed: str | None = "cancelled"
            try:
                async with asyncio.timeout(_READY_S):
                    failed = await started.entered()
            except TimeoutError:
                failed = f"no word from the command within {_READY_S:g}s"
            finally:
                if failed is not None:
                    signal_group(started.child.pid, signal.SIGKILL)
                    started.child.kill()
                    await shielded(within(started.child.wait(), _REAP_S))
                    started.child.reap()
                    started.status.close()
            if failed is not None:
                raise SandboxError(f"cannot start a session in the sandbox's cage: {failed}")
            if pty:
                stdin, stdout, stderr = os.dup(ours[0]), ours[0], None
            else:
                stdin, stdout, stderr = ours[0], ours[1], ours[2]
            ours = []
        finally:
            for fd in [*ours, *theirs]:
                os.close(fd)
        session = CageSession(
            started=started,
            mode="pty" if pty else "pipe",
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            limit=self.budgets.output_bytes,
            error=error,
            on_close=self._session_closed,
            record={
                "command": "/bin/sh -i" if command is None else command,
                "args": [],
                "cwd": workdir,
                "uid": uid[0],
                "started_at": started_at,
            },
        )
        self.sessions.add(session)
        self._running.add(session.pid)
        return session

    async def _session_closed(self, session: CageSession, record: dict[str, Any]) -> None:
        self.sessions.discard(session)
        self._running.discard(session.pid)
        self._reap_orphans()
        await asyncio.to_thread(self._append, record)

    def _reap_orphans(self) -> None:
        """Have the cage's init reap what a command left orphaned (one line on its stdin; see ``_HOLDER``).

        An attached sandbox's creator does it for its own commands.
        """
        holder = self.holder
        if holder is not None and holder.stdin is not None and not holder.stdin.is_closing():
            with contextlib.suppress(ConnectionError, RuntimeError):
                holder.stdin.write(b"\n")

    async def upload(self, data: bytes, target: str) -> None:
        """Write ``data`` to ``target`` in the sandbox (relative: to its working directory), as its user.

        Raises:
            SandboxError: The file could not be written there (the message has the sandbox's words).

        **Cancellation:** as :meth:`run`; the file may be partly written.
        """
        result = await self.run(_UPLOAD, args=[target], stdin=data, timeout_s=300, output_bytes=4096)
        if result.exit_code != 0:
            why = result.stderr.decode("utf-8", "replace").strip() or f"exit status {result.exit_code}"
            raise SandboxError(f"uploading to {target!r} in sandbox {self.sandbox_id}: {why}")

    async def download(self, source: str) -> bytes:
        """The content of the sandbox's regular file ``source``, read as its user.

        Raises:
            FileNotFoundError: It is not there (or not a regular file).
            SandboxError: It is larger than the download bound, or could not be read.

        **Cancellation:** as :meth:`run`.
        """
        limit = self.budgets.file_bytes
        result = await self.run(_DOWNLOAD, args=[source], timeout_s=300, output_bytes=limit)
        if result.exit_code == 2:
            raise FileNotFoundError(f"{source!r} in sandbox {self.sandbox_id}: no such regular file")
        if result.exit_code != 0:
            why = result.stderr.decode("utf-8", "replace").strip() or f"exit status {result.exit_code}"
            raise SandboxError(f"downloading {source!r} from sandbox {self.sandbox_id}: {why}")
        if result.truncated:
            raise SandboxError(
                f"downloading {source!r} from sandbox {self.sandbox_id}: "
                f"larger than the bound of {limit} bytes"
            )
        return result.stdout

    async def close(self) -> None:
        """Kill everything in it, remove its cgroups, unmount its root (writes kept), release the image.

        **Cancellation:** the release runs on in its thread; a second call returns at once.
        """
        if self.closed:
            return
        self.closed = True
        try:
            for session in list(self.sessions):
                await session.close()  # killed, reaped and journaled; its reads now raise
            if self.holder is None:  # attached: detach, the sandbox is its creator's to close
                self.holder_fd.close()
                return
            for pid in list(self._running):
                signal_group(pid, signal.SIGKILL)  # still running: its leader is our unreaped child
            await asyncio.to_thread(self._release)
            await _end_holder(self.holder)
            self.holder_fd.close()
        finally:
            if self.joiner is not None and self.owns_joiner:
                await self.joiner.close()

    def _release(self) -> None:
        try:
            if self.cgroups is not None:
                self.cgroups.kill()
                self.cgroups.remove(wait_s=_REAP_S)
            self.root.finish()
        finally:
            self._lease.close()
            _write_record(self, closed_at=time.time())


class _Sink:
    """What a stream delivered, kept up to a limit (the rest is read and dropped: no full pipe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped = self.dropped or len(chunk) > room

    async def drain_fd(self, fd: int) -> None:
        """As :meth:`drain`, from a pipe's read end (made non-blocking here)."""
        os.set_blocking(fd, False)
        while chunk := await read_ready(fd):
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped = self.dropped or len(chunk) > room


class _Pipes:
    """A command's three pipes: its ends (``theirs``: stdin's read end, stdout's and stderr's write
    ends) and ours; every one closed once, whatever happens."""

    def __init__(self) -> None:
        stdin, stdout, stderr = (os.pipe2(os.O_CLOEXEC) for _ in range(3))
        self.theirs: tuple[int, int, int] = (stdin[0], stdout[1], stderr[1])
        self.ours: list[int] = [stdin[1], stdout[0], stderr[0]]
        self._theirs_open = True

    def take(self, which: int) -> int:
        """Our end ``which``, now the taker's to close."""
        fd, self.ours[which] = self.ours[which], -1
        return fd

    def close_theirs(self) -> None:
        if self._theirs_open:
            self._theirs_open = False
            for fd in self.theirs:
                os.close(fd)

    def close(self) -> None:
        self.close_theirs()
        for which in range(3):
            fd = self.take(which)
            if fd >= 0:
                os.close(fd)


def _cage_failed(why: str) -> CommandResult:
    return CommandResult(
        CAGE_FAILED, b"", f"rollcage sandbox: the cage could not be made: {why}".encode(), False, False, True
    )


async def _feed_fd(fd: int, data: bytes) -> None:
    """Write ``data`` to the pipe ``fd`` as its reader takes it, then close it (a reader gone: stop)."""
    try:
        os.set_blocking(fd, False)
        view = memoryview(data)
        loop = asyncio.get_running_loop()
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionError):
                return
            await _writable(loop, fd)
    finally:
        os.close(fd)


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


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(ConnectionError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()


def _write_record(sandbox: CagedSandbox, **extra: Any) -> None:
    record = {
        "kind": "rollcage-gym-sandbox",
        "sandbox_id": sandbox.sandbox_id,
        "image": {
            "ref": sandbox.image.ref,
            "digest": sandbox.image.manifest_digest or sandbox.image.digest,
            "user": sandbox.image.user,
        },
        "workdir": sandbox.workdir,
        "env": sorted(sandbox.env),
        "budgets": {
            "memory_bytes": sandbox.budgets.memory_bytes,
            "disk_bytes": sandbox.budgets.disk_bytes,
            "max_processes": sandbox.budgets.max_processes,
            "output_bytes": sandbox.budgets.output_bytes,
        },
        "network": "none",
        "created_at": sandbox.created_at,
        **extra,
    }
    publish_json(sandbox.directory / "sandbox.json", record, mode=0o644)


async def open_sandbox(
    image_ref: str,
    *,
    state_dir: Path,
    store: ImageStore,
    env: Mapping[str, str] | None = None,
    workdir: str | None = None,
    budgets: SandboxBudgets = SandboxBudgets(),
    owner: tuple[int, int] = DEFAULT_OWNER,
    bwrap_path: str | None = None,
    joiner: Joiner | None = None,
) -> CagedSandbox:
    """Make a sandbox of ``image_ref`` with its state under ``state_dir`` (see the module docstring).

    Its commands are forked into its cage by ``joiner`` (its provider's, shared by its sandboxes);
    without one, by a joiner of its own, stopped when it closes.

    Raises:
        SandboxError: Not root, or the cage cannot be made here (the message says why).
        ImageReferenceError, ImageRefusedError, ImagePullError: The image (from the store).

    **Cancellation:** whatever was made (holder, cgroups, mount, lease) is undone before it propagates.
    """
    if os.geteuid() != 0:
        raise SandboxError(
            "the rollcage sandbox provider must run as root: it mounts each sandbox's copy-on-write image "
            "root (bubblewrap 0.8 cannot) and drops every command to an unprivileged uid; run NeMo Gym as "
            "root, or pick another provider"
        )
    tools = await asyncio.to_thread(
        find_tools, bwrap_path=bwrap_path, run_as=owner, hint="or pick another provider"
    )
    if tools.setpriv is None:  # find_tools refuses first; kept for the type checker
        raise SandboxError("setpriv (util-linux) is needed to drop root for the sandbox, and was not found")
    await asyncio.to_thread(_check_traversable, state_dir, owner)
    prepared = await asyncio.to_thread(store.prepare, image_ref)
    image = image_sandbox(prepared)
    sandbox_id = f"rollcage-{uuid.uuid4().hex[:12]}"
    directory = state_dir / sandbox_id
    await asyncio.to_thread(directory.mkdir, parents=True, mode=0o711)
    await asyncio.to_thread(fsync_directory, state_dir)
    lease = contextlib.ExitStack()
    cgroups: CgroupSet | None = None
    root: ImageRoot | None = None
    holder: asyncio.subprocess.Process | None = None
    try:
        lease.enter_context(store.lease(prepared))
        root = await asyncio.to_thread(
            mount_image_root, image, directory, owner, max_bytes=budgets.disk_bytes
        )
        cgroups = await asyncio.to_thread(
            CgroupSet.create,
            sandbox_id,
            memory_bytes=budgets.memory_bytes,
            # bubblewrap's own processes count too.
            max_processes=None if budgets.max_processes is None else budgets.max_processes + 8,
        )
        status_read, status_write = os.pipe2(os.O_CLOEXEC)
        argv = _holder_argv(
            tools,
            owner,
            root.merged,
            (image.uid, image.gid),
            sandbox_id,
            status_write,
            workdir or image.working_dir,
        )
        holder, holder_pid = await _start_holder(
            [*(cgroups.enter_prefix()), *argv], status_read, status_write
        )
        info = read_proc(holder_pid)
        found = None if info is None else PidHandle.open(info)
        if found is None:
            raise SandboxError("the sandbox's cage ended as soon as it was made")
        holder_fd = found
        base_env = _image_env(image)
        sandbox = CagedSandbox(
            sandbox_id=sandbox_id,
            directory=directory,
            image=image,
            root=root,
            owner=owner,
            env={**base_env, **dict(env or {})},
            workdir=workdir or image.working_dir,
            budgets=budgets,
            cgroups=cgroups,
            enter=cgroups.enter_prefix(),
            holder=holder,
            holder_fd=holder_fd,
            _lease=lease,
            procs_files=[str(path) for path in cgroups.procs_files()],
            joiner=joiner or Joiner(),
            owns_joiner=joiner is None,
        )
        await asyncio.to_thread(_write_record, sandbox)
        await asyncio.to_thread(_write_attach, sandbox, holder_fd.info)
    except BaseException:
        if holder is not None:
            await _end_holder(holder)
        if cgroups is not None:
            cgroups.kill()
            cgroups.remove()
        if root is not None:
            root.finish()
        lease.close()
        raise
    return sandbox


def _write_attach(sandbox: CagedSandbox, holder: ProcInfo) -> None:
    """What another process needs to attach (:func:`attach_sandbox`); root's alone (env may hold secrets)."""
    record = {
        "holder": {"pid": holder.pid, "starttime": holder.starttime},
        "enter": sandbox.enter,
        "cgroups": [] if sandbox.cgroups is None else [str(p.parent) for p in sandbox.cgroups.procs_files()],
        "image": sandbox.image.model_dump(mode="json"),
        "owner": list(sandbox.owner),
        "env": sandbox.env,
        "workdir": sandbox.workdir,
        "budgets": dataclasses.asdict(sandbox.budgets),
    }
    publish_json(sandbox.directory / _ATTACH, record, mode=0o600)


async def attach_sandbox(directory: Path, *, joiner: Joiner | None = None) -> CagedSandbox:
    """The open sandbox in ``directory``, made by another process on this host, to run commands in.

    Its commands join the same cage and cgroups and are journaled in the same journal; closing the
    attached sandbox only detaches (its creator closes it). They are forked by ``joiner`` (this
    process's provider's), or by one of the attached sandbox's own, stopped when it detaches.

    Raises:
        SandboxError: It is closed, its cage is gone, or the directory holds no sandbox.

    **Cancellation:** nothing to undo.
    """
    try:
        record = json.loads(await asyncio.to_thread((directory / _ATTACH).read_bytes))
        state = json.loads(await asyncio.to_thread((directory / "sandbox.json").read_bytes))
    except (OSError, ValueError) as exc:
        raise SandboxError(f"{directory} holds no rollcage sandbox to attach to: {exc}") from exc
    if state.get("closed_at"):
        raise SandboxError(f"sandbox {state.get('sandbox_id')} in {directory} is closed")
    holder = record["holder"]
    info = read_proc(int(holder["pid"]))
    handle = None if info is None or info.starttime != holder["starttime"] else PidHandle.open(info)
    if handle is None:
        raise SandboxError(f"sandbox {state.get('sandbox_id')} in {directory}: its cage is gone")
    image = ImageSandbox.model_validate(record["image"])
    return CagedSandbox(
        sandbox_id=str(state["sandbox_id"]),
        directory=directory,
        image=image,
        root=ImageRoot(image, directory),
        owner=(int(record["owner"][0]), int(record["owner"][1])),
        env={str(k): str(v) for k, v in record["env"].items()},
        workdir=str(record["workdir"]),
        budgets=SandboxBudgets(**record["budgets"]),
        cgroups=None,
        enter=[str(part) for part in record["enter"]],
        holder=None,
        holder_fd=handle,
        _lease=contextlib.ExitStack(),
        procs_files=[str(Path(group) / "cgroup.procs") for group in record.get("cgroups", [])],
        joiner=joiner or Joiner(),
        owns_joiner=joiner is None,
    )


def release_abandoned(state_dir: Path) -> list[str]:
    """Release the sandboxes under ``state_dir`` whose creator died without closing them (blocking).

    A sandbox is abandoned when its record says it is open but its cage's holder is gone (the holder
    dies with the process that made it). Its cgroups are killed and removed, its root unmounted (the
    writes kept in ``changes/``), and its record marked closed. A sandbox whose holder lives (another
    provider's, on this host) is left alone. Returns the ids released.
    """
    released: list[str] = []
    if not state_dir.is_dir():
        return released
    for directory in sorted(state_dir.iterdir()):
        try:
            record = json.loads((directory / "sandbox.json").read_bytes())
            attach = json.loads((directory / _ATTACH).read_bytes())
        except (OSError, ValueError):
            continue
        if record.get("closed_at") or not isinstance(attach.get("holder"), dict):
            continue
        info = read_proc(int(attach["holder"]["pid"]))
        if info is not None and info.starttime == attach["holder"]["starttime"] and info.alive:
            continue
        for cgroup in attach.get("cgroups", []):
            kill_cgroup(Path(cgroup))
            remove_cgroup(Path(cgroup))
        release_image_root(directory)
        record.update(closed_at=time.time(), abandoned=True)
        publish_json(directory / "sandbox.json", record, mode=0o644)
        released.append(str(record.get("sandbox_id", directory.name)))
    return released


def _holder_argv(
    tools: BwrapTools,
    owner: tuple[int, int],
    root: Path,
    uid: tuple[int, int],
    hostname: str,
    status_fd: int,
    workdir: str,
) -> list[str]:
    """The command line of a sandbox's holder: the cage every command of the sandbox joins."""
    assert tools.setpriv is not None
    return [
        # Root drops to the unprivileged owner before any namespace is made: the cage is never
        # host root, and the kernel counts its processes against that uid.
        tools.setpriv,
        "--reuid",
        str(owner[0]),
        "--regid",
        str(owner[1]),
        "--clear-groups",
        "--no-new-privs",
        "--",
        tools.bwrap,
        "--json-status-fd",
        str(status_fd),
        "--unshare-user",
        *(["--disable-userns"] if tools.disable_userns else []),
        "--unshare-pid",
        "--as-pid-1",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--unshare-net",
        "--hostname",
        hostname[:63],
        "--die-with-parent",
        "--new-session",
        "--uid",
        str(uid[0]),
        "--gid",
        str(uid[1]),
        "--cap-drop",
        "ALL",
        "--bind",
        str(root),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--chdir",
        "/",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--",
        "/bin/sh",
        "-c",
        _HOLDER,
        "rollcage-holder",
        workdir,
    ]


async def _start_holder(
    argv: list[str], status_read: int, status_write: int
) -> tuple[asyncio.subprocess.Process, int]:
    """Start the holder; its cage's init's host PID once bubblewrap reports it and the holder is ready.

    Raises:
        SandboxError: bubblewrap ended before it made the cage, or the holder could not make the
            working directory (their words in the message).
    """
    try:
        holder = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
            cwd="/",
            pass_fds=[status_write],
            start_new_session=True,
        )
    finally:
        os.close(status_write)
    status = await asyncio.to_thread(_read_status, status_read)
    ready = b""
    if status is not None:
        assert holder.stdout is not None
        ready = await within(holder.stdout.read(1), _READY_S) or b""
    if status is None or ready != b"r":
        await _end_holder(holder)
        assert holder.stderr is not None
        why = (await holder.stderr.read()).decode("utf-8", "replace").strip()[-500:]
        raise SandboxError(
            f"the sandbox's cage could not be made: {why or f'exit status {holder.returncode}'}"
        )
    return holder, status


def _read_status(fd: int) -> int | None:
    """bubblewrap's ``child-pid`` from its JSON status (``None``: it ended before saying it)."""
    data = b""
    try:
        while chunk := os.read(fd, 4096):
            data += chunk
            for line in data.splitlines():
                with contextlib.suppress(ValueError):
                    document = json.loads(line)
                    if isinstance(document, dict) and isinstance(document.get("child-pid"), int):
                        return int(document["child-pid"])
    finally:
        os.close(fd)
    return None


async def _end_holder(holder: asyncio.subprocess.Process) -> None:
    if holder.stdin is not None:
        holder.stdin.close()
    if holder.returncode is None:
        signal_group(holder.pid, signal.SIGKILL)  # unreaped: the group is still the holder's
    await shielded(within(holder.wait(), _REAP_S))


def _check_traversable(state_dir: Path, owner: tuple[int, int]) -> None:
    """Refuse a state directory the sandbox's uid cannot reach: its commands' root is mounted in it.

    Raises:
        SandboxError: A directory on the way lets only its owner in; the message names it.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o711)
    path = state_dir.resolve()
    for directory in (path, *path.parents):
        st = directory.stat()
        if st.st_uid == owner[0]:
            continue
        if not st.st_mode & (0o010 if st.st_gid == owner[1] else 0o001):
            raise SandboxError(
                f"the sandboxes' state directory {state_dir} is under {directory} (mode "
                f"{stat.filemode(st.st_mode)}), which the sandbox's uid {owner[0]} cannot pass through; "
                "choose a state_dir whose every parent has the x bit for others (e.g. under /var/lib)"
            )


def _image_env(image: ImageSandbox) -> dict[str, str]:
    from rollcage.cage import image_environment

    return image_environment(image)
