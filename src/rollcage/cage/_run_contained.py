"""``run_contained``: run one command on untrusted files in a fresh, minimal cage, and bound everything.

This is the function an environment author calls to run or import anything an
agent wrote (a grader's hidden tests, a compiler, a linter). What the command
sees is built from nothing:

* the bare interpreter (``sys.base_prefix``: the standard library, no
  site-packages, no virtual environment, no checkout) and the system's
  ``/usr``, ``/bin``, ``/lib*``: read-only; no ``/etc``, no home directory, no
  dataset, nothing else of the host;
* ``/work``: a small tmpfs holding only the ``files`` given (the candidate's
  files, the tests), writable, the working directory; ``/tmp`` and ``/dev/shm``:
  small tmpfs too;
* an unprivileged uid (as root: dropped before the user namespace is made), no
  capabilities, no user namespaces of its own, no network, its own PID, IPC and
  UTS namespaces, a cleared environment;
* bounds: wall-clock ``timeout_s`` (the whole cage is killed), CPU seconds,
  memory (per process, and in total where a cgroup can be made), processes,
  file size, open files, and ``output_limit`` bytes kept of stdout and stderr.

With ``root`` (a mounted tree: an image's fresh root, ``rollcage.controller._fresh_root``) the
command sees that tree alone as ``/``, writable, with a ``/proc`` and ``/dev`` of its own, the
same bounds, the same handshake (from the root's own ``/bin/sh``): graders in images and plain
graders run through this one function. Each cage's process budget is its own (``_nproc``).

A cage that cannot be made is never mistaken for the command's failure: a
handshake from inside the cage, sent before the untrusted command starts, tells
them apart, and :class:`SandboxError` is raised. Where bubblewrap is missing the
call refuses (:class:`SandboxError`) unless ``allow_uncontained=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import secrets
import shutil
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from rollcage.budgets import CgroupSet, unique_name
from rollcage.cage._bwrap import (
    Bind,
    CageSpec,
    FileFromFd,
    Limits,
    Mount,
    Tmpfs,
    cage_argv,
    find_tools,
    interpreter_paths,
    outermost,
    system_mounts,
    which,
)
from rollcage.cage._launch import launcher
from rollcage.errors import SandboxError
from rollcage.procs import ChildProcess, GroupTree, StopStrategy, shielded, stop_tree, wait_shared

__all__ = ["GRADER_SYSTEM_PATHS", "PYTHON", "ContainedRun", "RunLimits", "run_contained"]

GRADER_SYSTEM_PATHS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")
"""What of the host system a grader's cage sees (read-only): programs and libraries, not ``/etc``."""

PYTHON = os.path.realpath(
    getattr(__import__("sys"), "_base_executable", None) or __import__("sys").executable
)
"""The bare interpreter, at the path where it is visible inside the cage (run it with ``-I -S``)."""

WORKDIR = "/work"
_KILL_AT_ONCE = StopStrategy(grace_s=0.0, kill_wait_s=5.0)
# The cage's first step, before anything untrusted: print a marker, then become the command.
# Output that starts with the marker proves the cage was built; nothing the command does can
# take it back, nor print it before the cage exists.
_HANDSHAKE = 'printf "%s\\n" "$1" && shift && exec "$@"'


@dataclass(frozen=True)
class RunLimits:
    """Bounds of one :func:`run_contained` call.

    Attributes:
        cpu_seconds: CPU time of each process.
        memory_bytes: Address space of each process, and the cage's total where a cgroup can be made.
        max_processes: Processes and threads together.
        file_size_bytes: Largest file any process may write.
        scratch_bytes: Size of ``/work`` and of ``/tmp`` (each), memory-backed.
        open_files: Open files per process.
        output_limit: Bytes kept of stdout and of stderr each (the rest is read and dropped).
    """

    cpu_seconds: int = 30
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    file_size_bytes: int = 16 << 20
    scratch_bytes: int = 64 << 20
    open_files: int = 256
    output_limit: int = 1 << 20


@dataclass(frozen=True)
class ContainedRun:
    """How one contained command ended.

    Attributes:
        exit_code: Its exit code; ``None`` when a signal ended it or it was killed at the timeout.
        signal: The signal that ended it (``'SIGKILL'``), if any.
        stdout: The first ``output_limit`` bytes of its standard output.
        stderr: The first ``output_limit`` bytes of its standard error.
        truncated: Some output was dropped.
        timed_out: The wall-clock bound fired and the cage was killed.
        memory_exceeded: The kernel killed a process for the cage's total memory budget.
        contained: ``False`` only when bubblewrap was missing and ``allow_uncontained`` was given.
    """

    exit_code: int | None
    signal: str | None
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool
    memory_exceeded: bool
    contained: bool


async def run_contained(
    argv: Sequence[str],
    *,
    files: Mapping[str, str | bytes] | None = None,
    stdin: bytes = b"",
    timeout_s: float,
    limits: RunLimits | None = None,
    env: Mapping[str, str] | None = None,
    ro_paths: Sequence[str] = (),
    allow_uncontained: bool = False,
    root: Path | None = None,
    cwd: str | None = None,
    host_uid: int | None = None,
) -> ContainedRun:
    """Run ``argv`` in a fresh minimal cage, ``files`` in its working directory (see the module docstring).

    Args:
        argv: The command as the cage sees it; :data:`PYTHON` is the interpreter (use ``-I -S``).
        files: Relative path -> content, placed under ``/work`` (the working directory).
        stdin: Bytes fed to its standard input.
        timeout_s: Wall-clock bound on the whole run, start-up included.
        limits: The other bounds (defaults: :class:`RunLimits`).
        env: More environment variables (the rest is cleared); with ``root``, the entire environment.
        ro_paths: More host paths the command needs, read-only at the same place (a library of
            the tests'); never the directory of a dataset or a checkout.
        allow_uncontained: Where bubblewrap is missing, run the command directly in a private
            temporary directory with the same per-process limits instead of refusing. The
            command can then read and write whatever this process can: trusted code only.
        root: A mounted tree to be the command's whole ``/``, writable, instead of the minimal
            tree (an image's fresh root, ``rollcage.controller._fresh_root``): the command sees it
            alone, with a ``/proc`` and ``/dev`` of its own (root only; ``argv[0]`` is the root's).
            ``files``, ``ro_paths`` and ``allow_uncontained`` do not apply and are refused.
        cwd: The working directory in the cage: default ``/work`` (``/`` with ``root``).
        host_uid: The host uid (and gid) the command runs as, when this process is root; default
            65534 ("nobody"). With ``root`` and no pids cgroup, the process budget is this uid's
            ``RLIMIT_NPROC``: give each concurrent cage a uid of its own.

    Returns:
        How it ended; a command that fails is an ordinary result.

    Raises:
        SandboxError: The cage could not be made (bubblewrap missing or refused here; with
            ``root``: not root, or no ``argv[0]`` in the root); the message says why. Nothing of
            the command ran.
        ValueError: A file name is absolute or leaves the working directory; ``files``, ``ro_paths``
            or ``allow_uncontained`` given with ``root``.

    **Cancellation:** the whole cage is killed and reaped, and its cgroup removed, before
    the cancellation propagates.
    """
    limits = limits or RunLimits()
    files = dict(files or {})
    for name in files:
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"file name {name!r} must be relative and stay inside the working directory")
    if root is not None and (files or ro_paths or allow_uncontained):
        raise ValueError(
            "files, ro_paths and allow_uncontained do not apply to a command in a root of its own"
        )
    as_root = os.geteuid() == 0
    if root is not None and not as_root:
        raise SandboxError("running a command in an image root needs root (the root is an overlay mount)")
    uid = 65534 if host_uid is None else host_uid
    run_as = (uid, uid) if as_root else None
    hint = "grading in an image needs it" if root is not None else "or allow uncontained grading explicitly"
    try:
        tools = await asyncio.to_thread(find_tools, run_as=run_as, hint=hint)
    except SandboxError:
        if not allow_uncontained:
            raise
        return await _run_uncontained(argv, files, stdin, timeout_s, limits, env)
    marker = f"rollcage-cage-started-{secrets.token_hex(8)}"
    fds: list[int] = []
    cgroups: CgroupSet | None = None
    try:
        cgroups = await asyncio.to_thread(
            CgroupSet.create,
            unique_name("rollcage-run"),
            memory_bytes=limits.memory_bytes,
            # bubblewrap's own processes count too.
            max_processes=limits.max_processes + 8,
        )
        per_process = Limits(
            address_space_bytes=limits.memory_bytes,
            max_processes=_nproc(limits, root is not None, cgroups),
            file_size_bytes=limits.file_size_bytes,
            cpu_seconds=limits.cpu_seconds,
            open_files=limits.open_files,
        )
        if root is not None:
            spec = await asyncio.to_thread(
                _root_spec, root, argv, marker, env or {}, cwd or "/", per_process, uid
            )
        else:
            spec = await _minimal_spec(
                argv, files, fds, marker, env, cwd or WORKDIR, ro_paths, limits, per_process
            )
        command = cage_argv(dataclasses.replace(spec, run_as=run_as), tools=tools, as_root=as_root)
        return await _supervise(
            [*cgroups.enter_prefix(), *command],
            fds,
            marker.encode() + b"\n",
            stdin,
            timeout_s,
            limits,
            cgroups,
        )
    finally:
        for fd in fds:
            os.close(fd)
        if cgroups is not None:
            await shielded(asyncio.to_thread(cgroups.remove))


def _nproc(limits: RunLimits, own_root: bool, cgroups: CgroupSet) -> int | None:
    """The ``RLIMIT_NPROC`` of a cage, ``None`` for none: each cage's process budget must be its own.

    ``RLIMIT_NPROC`` counts every process of a uid. The minimal tree's cage sets it from inside its
    own user namespace (the host's ``prlimit`` runs there), where only that cage's processes count.
    A cage over a root of its own sets it before (the root has no ``prlimit``), where every process
    of its host uid counts: its pids cgroup bounds it instead where one is made; else the limit stays,
    on a uid the caller gives it alone (``host_uid``, ``rollcage.controller._fresh_root.lease_uid``).
    """
    if own_root and cgroups.pids is not None:
        return None
    return limits.max_processes


async def _minimal_spec(
    argv: Sequence[str],
    files: Mapping[str, str | bytes],
    fds: list[int],
    marker: str,
    env: Mapping[str, str] | None,
    cwd: str,
    ro_paths: Sequence[str],
    limits: RunLimits,
    per_process: Limits,
) -> CageSpec:
    """The minimal tree of the module docstring; file descriptors go into ``fds`` (the caller closes them)."""
    mounts: list[Mount] = [*system_mounts(GRADER_SYSTEM_PATHS)]
    extra = await asyncio.to_thread(_existing, outermost([*interpreter_paths(), *ro_paths]))
    mounts += [Bind(path, path) for path in extra]
    mounts.append(Tmpfs(WORKDIR, limits.scratch_bytes, perms="01777"))
    for name, content in sorted(files.items()):
        fd = os.memfd_create("rollcage-file", os.MFD_CLOEXEC)
        fds.append(fd)
        await asyncio.to_thread(_fill, fd, content.encode() if isinstance(content, str) else content)
        mounts.append(FileFromFd(fd, f"{WORKDIR}/{name}", perms="0644"))
    return CageSpec(
        argv=["/bin/sh", "-c", _HANDSHAKE, "rollcage-cage", marker, *argv],
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR, **(env or {})},
        cwd=cwd,
        mounts=mounts,
        tmp=Tmpfs("/tmp", limits.scratch_bytes),
        shm=Tmpfs("/dev/shm", 1 << 20),
        limits=per_process,
    )


def _root_spec(
    root: Path,
    argv: Sequence[str],
    marker: str,
    env: Mapping[str, str],
    cwd: str,
    per_process: Limits,
    uid: int,
) -> CageSpec:
    """A cage whose ``/`` is ``root``; the outer stage sees the host's programs only (blocking)."""
    for needed in ("proc", "dev", "tmp"):
        # Mount points the inner bwrap needs; made (in the root's writable layer) where it has none.
        path = root / needed
        if not path.is_dir() and not path.is_symlink():
            path.mkdir()
            path.chmod(0o1777 if needed == "tmp" else 0o755)
    return CageSpec(
        # The root's own shell prints the marker: a root without one is a cage that could not be made.
        argv=["/bin/sh", "-c", _HANDSHAKE, "rollcage-cage", marker, *argv],
        env=dict(env),
        cwd=cwd,
        mounts=system_mounts(GRADER_SYSTEM_PATHS),
        # The outer stage's /tmp: bwrap builds the inner root in a tmpfs it mounts there.
        tmp=Tmpfs("/tmp", 1 << 20),
        shm=None,
        limits=per_process,
        # The host uid inside too: what the root's id-mapped image gives that uid is the command's.
        uid=uid,
        gid=uid,
        root=str(root),
    )


def _existing(paths: list[str]) -> list[str]:
    return [path for path in paths if os.path.exists(path)]


def _fill(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)


class _Sink:
    """What a stream delivered, kept up to a limit; survives the cancellation of the reader."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = False

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            # Keep reading past the limit so the command never blocks on a full pipe.
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped = self.dropped or len(chunk) > room


async def _feed(writer: asyncio.StreamWriter | None, data: bytes) -> None:
    if writer is None:
        return
    with contextlib.suppress(ConnectionError):
        writer.write(data)
        await writer.drain()
    writer.close()


@dataclass
class _Finished:
    returncode: int | None
    out: _Sink
    err: _Sink
    timed_out: bool


async def _communicate(
    command: Sequence[str],
    *,
    stdin: bytes,
    timeout_s: float,
    out: _Sink,
    err: _Sink,
    env: Mapping[str, str],
    cwd: str,
    pass_fds: Sequence[int] = (),
    cgroups: CgroupSet | None = None,
    caged: bool = False,
) -> _Finished:
    """Run ``command`` in a new session: feed ``stdin``, keep bounded output, kill everything at the end.

    ``caged``: the command is a cage's bubblewrap, started by :func:`~rollcage.cage.launcher` from a
    mount namespace without the rollouts' mounts (its launch then costs the same at any load).
    """
    # Our ends of the child's standard streams, and the child's (closed here once it has them).
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    stderr_read, stderr_write = os.pipe()
    ours = [os.fdopen(fd, mode, buffering=0) for fd, mode in ((stdin_write, "wb"), (stdout_read, "rb"))]
    ours.append(os.fdopen(stderr_read, "rb", buffering=0))
    try:
        spawn = functools.partial(
            ChildProcess.spawn,
            command,
            env=env,
            cwd=cwd,
            stdin=stdin_read,
            stdout=stdout_write,
            stderr=stderr_write,
            pass_fds=pass_fds,
        )
        child = launcher().run(
            spawn, [] if caged else None, timeout_s=_LAUNCH_TIMEOUT_S, late=ChildProcess.abandon
        )
    except BaseException:
        for pipe in ours:
            pipe.close()
        raise
    finally:
        for fd in (stdin_read, stdout_write, stderr_write):
            os.close(fd)
    timed_out = False
    exited = asyncio.ensure_future(child.wait())
    transports: list[asyncio.BaseTransport] = []
    try:
        stdin_writer, stdout, stderr = await _streams(ours, transports)
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(
                _feed(stdin_writer, stdin), out.drain(stdout), err.drain(stderr), wait_shared(exited)
            )
    except TimeoutError:
        timed_out = True
    finally:
        # The group holds bwrap's monitor and the (outer) PID namespace's init: killing the init takes
        # the whole namespace along; the cgroup catches anything that got out of the group.
        also_kill = None if cgroups is None else functools.partial(asyncio.to_thread, cgroups.kill)
        # Shielded: whatever happened, the whole cage dies and is reaped.
        await stop_tree(GroupTree(child.pid, exited, also_kill=also_kill), _KILL_AT_ONCE)
        exited.cancel()
        status = child.release()
        for transport in transports:
            transport.close()
        for pipe in ours:
            pipe.close()  # one no transport took (a transport's is closed already)
    return _Finished(None if status is None else status.returncode, out, err, timed_out)


_LAUNCH_TIMEOUT_S = 60.0
"""How long a start may wait for the launcher thread (milliseconds when all is well)."""


async def _streams(
    ours: list[IO[bytes]], transports: list[asyncio.BaseTransport]
) -> tuple[asyncio.StreamWriter, asyncio.StreamReader, asyncio.StreamReader]:
    """Our ends of the child's stdin, stdout and stderr as asyncio's streams.

    Their transports (which then own the pipes) are added to ``transports``.
    """
    loop = asyncio.get_running_loop()
    readers = []
    for pipe in ours[1:]:
        reader = asyncio.StreamReader()
        protocol = functools.partial(asyncio.StreamReaderProtocol, reader)
        reading, _ = await loop.connect_read_pipe(protocol, pipe)
        transports.append(reading)
        readers.append(reader)
    writing, flow = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, ours[0])
    transports.append(writing)
    return asyncio.StreamWriter(writing, flow, None, loop), readers[0], readers[1]


async def _supervise(
    command: list[str],
    fds: list[int],
    marker: bytes,
    stdin: bytes,
    timeout_s: float,
    limits: RunLimits,
    cgroups: CgroupSet,
) -> ContainedRun:
    done = await _communicate(
        command,
        stdin=stdin,
        timeout_s=timeout_s,
        out=_Sink(limits.output_limit + len(marker)),
        err=_Sink(limits.output_limit),
        env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"},
        cwd="/",
        pass_fds=fds,
        cgroups=cgroups,
        caged=True,
    )
    out, err = done.out, done.err
    started = out.kept.startswith(marker)
    if not started:
        why = err.kept.decode("utf-8", "replace").strip()[-500:] or (
            f"it did not start within {timeout_s:g} s" if done.timed_out else f"exit status {done.returncode}"
        )
        raise SandboxError(f"the sandbox for the contained command could not be made: {why}")
    return _result(done, out.kept[len(marker) :], memory_exceeded=cgroups.oom_kills() > 0, contained=True)


def _result(
    done: _Finished, stdout: bytes | bytearray, *, memory_exceeded: bool, contained: bool
) -> ContainedRun:
    code, sig = _decode(done.returncode)
    return ContainedRun(
        exit_code=None if done.timed_out else code,
        signal=sig,
        stdout=bytes(stdout),
        stderr=bytes(done.err.kept),
        truncated=done.out.dropped or done.err.dropped,
        timed_out=done.timed_out,
        memory_exceeded=memory_exceeded,
        contained=contained,
    )


def _decode(returncode: int | None) -> tuple[int | None, str | None]:
    if returncode is None:
        return None, None
    if returncode < 0:
        return None, signal.Signals(-returncode).name
    if returncode > 128:
        # bubblewrap reports a command killed by signal N as exit code 128 + N.
        with contextlib.suppress(ValueError):
            return None, signal.Signals(returncode - 128).name
    return returncode, None


async def _run_uncontained(
    argv: Sequence[str],
    files: Mapping[str, str | bytes],
    stdin: bytes,
    timeout_s: float,
    limits: RunLimits,
    env: Mapping[str, str] | None,
) -> ContainedRun:
    workdir = await asyncio.to_thread(tempfile.mkdtemp, prefix="rollcage-uncontained-")
    try:
        for name, content in files.items():
            path = Path(workdir, name)
            await asyncio.to_thread(path.parent.mkdir, parents=True, exist_ok=True)
            data = content.encode() if isinstance(content, str) else content
            await asyncio.to_thread(path.write_bytes, data)
        prlimit = which("prlimit")
        per_process = Limits(
            address_space_bytes=limits.memory_bytes,
            max_processes=None,
            file_size_bytes=limits.file_size_bytes,
            cpu_seconds=limits.cpu_seconds,
            open_files=limits.open_files,
        )
        command = [prlimit, *per_process.prlimit_args(), "--", *argv] if prlimit else list(argv)
        done = await _communicate(
            command,
            stdin=stdin,
            timeout_s=timeout_s,
            out=_Sink(limits.output_limit),
            err=_Sink(limits.output_limit),
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, **(env or {})},
            cwd=workdir,
        )
        return _result(done, done.out.kept, memory_exceeded=False, contained=False)
    finally:
        await asyncio.to_thread(shutil.rmtree, workdir, True)
