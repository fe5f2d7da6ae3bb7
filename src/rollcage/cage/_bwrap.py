"""bubblewrap command lines: one builder for every cage rollcage makes.

A cage is described by a :class:`CageSpec` (pure data: the file tree, the
scratch file systems, the per-process limits, the uid) and turned into a
command line by :func:`cage_argv`. Nothing here touches the disk except
:func:`find_tools`, which looks for the programs and tries a trivial sandbox
once per process.

Root and the two-stage launch
=============================

The kernel never enforces ``RLIMIT_NPROC`` for host root, and a user namespace
created by root maps the cage's uid to host root (whose capabilities reach the
host: ``mount -o remount,rw /`` from inside such a cage writes the host). So when
the caller is root, a cage is started in two stages: an outer ``bwrap`` (root,
a mount and PID namespace only, every capability dropped but ``setuid``/``setgid``)
builds the file tree, then drops to an unprivileged host uid (``setpriv``) and
runs the inner ``bwrap``, which creates the user, PID, network, IPC, UTS and
cgroup namespaces over that tree. Code in the cage is never host root, the
process limit holds, and the outer stage's PID namespace takes everything along
when its init dies. A caller that is not root needs one stage; its cage's root and
``/dev`` (tmpfs owned by the caller's uid, which the cage's uid maps to) are then
remounted read-only, as the outer stage's root-owned ones are to the cage's uid.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from rollcage.errors import SandboxError
from rollcage.procs import signal_group

logger = logging.getLogger("rollcage.cage")

__all__ = [
    "SYSTEM_PATHS",
    "Bind",
    "BwrapTools",
    "CageSpec",
    "FileFromFd",
    "Limits",
    "Mount",
    "Symlink",
    "Tmpfs",
    "cage_argv",
    "find_tools",
    "interpreter_paths",
    "outermost",
    "python_paths",
    "system_mounts",
    "which",
]

SYSTEM_PATHS: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")
"""Host system paths a worker's cage sees read-only (missing ones are skipped; symlinks kept as links)."""


@dataclass(frozen=True)
class Bind:
    """Host path ``source`` visible at ``dest`` (read-only unless ``writable``)."""

    source: str
    dest: str
    writable: bool = False


@dataclass(frozen=True)
class Tmpfs:
    """A fresh memory-backed file system at ``dest``, of at most ``size`` bytes (``None``: the kernel's)."""

    dest: str
    size: int | None = None
    perms: str = "01777"


@dataclass(frozen=True)
class FileFromFd:
    """A file at ``dest`` whose content bubblewrap copies from the inherited descriptor ``fd``."""

    fd: int
    dest: str
    perms: str = "0644"


@dataclass(frozen=True)
class Symlink:
    """A symbolic link ``dest`` -> ``target``."""

    target: str
    dest: str


Mount = Bind | Tmpfs | FileFromFd | Symlink
"""One step of building a cage's file tree."""


@dataclass(frozen=True)
class Limits:
    """Per-process resource limits set inside the cage before the command runs (``None``: unchanged).

    One value sets both the soft and the hard limit, so code in the cage cannot raise it again.
    """

    address_space_bytes: int | None = None
    max_processes: int | None = None
    file_size_bytes: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    core_bytes: int | None = 0

    def _set(self) -> Iterator[tuple[str, int, int]]:
        """``(prlimit flag, RLIMIT_*, value)`` of each limit that is set."""
        for name, (flag, which) in _RLIMITS.items():
            value = getattr(self, name)
            if value is not None:
                yield flag, which, value

    def prlimit_args(self) -> list[str]:
        """``prlimit`` options for these limits."""
        return [f"{flag}={value}" for flag, _, value in self._set()]

    def rlimits(self) -> list[tuple[int, int]]:
        """``(RLIMIT_*, value)`` of each limit that is set (soft and hard alike)."""
        return [(which, value) for _, which, value in self._set()]

    def apply(self) -> None:
        """Set these limits on this process, as ``prlimit`` would before the command (soft = hard).

        Raises:
            OSError: A limit could not be set (above a hard limit this process cannot raise).
        """
        for which, value in self.rlimits():
            resource.setrlimit(which, (value, value))


_RLIMITS: dict[str, tuple[str, int]] = {
    "address_space_bytes": ("--as", resource.RLIMIT_AS),
    "max_processes": ("--nproc", resource.RLIMIT_NPROC),
    "file_size_bytes": ("--fsize", resource.RLIMIT_FSIZE),
    "cpu_seconds": ("--cpu", resource.RLIMIT_CPU),
    "open_files": ("--nofile", resource.RLIMIT_NOFILE),
    "core_bytes": ("--core", resource.RLIMIT_CORE),
}
"""Each :class:`Limits` field: its ``prlimit`` flag and its ``setrlimit`` resource."""


@dataclass(frozen=True)
class BwrapTools:
    """Host programs a cage needs."""

    bwrap: str
    prlimit: str
    setpriv: str | None
    disable_userns: bool = field(default=False)
    """bwrap is new enough (0.8) for ``--disable-userns``."""


@dataclass(frozen=True)
class CageSpec:
    """Everything about one cage; :func:`cage_argv` turns it into a command line.

    Attributes:
        argv: The command, as the cage sees it.
        env: Its entire environment (the caller's is cleared).
        cwd: Its working directory, in the cage.
        mounts: The file tree, in order, over an empty root (parents are made world-traversable).
        tmp: What ``/tmp`` is: a size-bounded tmpfs, or a host directory (a bounded file system the
            caller mounted) bound writable.
        shm: What ``/dev/shm`` is, over the minimal ``/dev``; ``None``: the directory in ``/dev``'s tmpfs.
        limits: Per-process limits (``prlimit``).
        uid: The uid the command has in the cage.
        gid: The gid the command has in the cage.
        run_as: ``(uid, gid)`` on the host when the caller is root: the two-stage launch (see the
            module docstring). ``None`` as root keeps root (never for untrusted code).
        allow_userns: Let the cage create user namespaces of its own (only a trusted command that
            cages its children needs this); otherwise ``--disable-userns`` where bwrap has it.
        share_net: Keep the caller's network namespace (a cage inside a cage that has none).
        new_session: ``setsid`` for the command (no terminal to push keystrokes into).
        status_fd: An inherited descriptor for bwrap's JSON status: its ``child-pid`` is the host
            PID of the outermost PID namespace's init, whose death takes the whole cage along.
        unset_env: Variables bwrap must remove (when ``env`` is ``None``: the caller's is kept).
        hostname: The UTS name.
        root: A host directory (a mounted tree: an image's fresh root) to be the command's whole ``/``,
            writable, in the two-stage launch only: ``mounts``, ``tmp`` and ``shm`` are then the outer
            stage's tree (the host's programs it runs: bwrap, setpriv, prlimit), and the command sees
            the root with a fresh ``/proc`` and ``/dev`` and nothing else.
    """

    argv: Sequence[str]
    env: Mapping[str, str] | None
    cwd: str
    mounts: Sequence[Mount]
    tmp: Tmpfs | Bind = Tmpfs("/tmp", 64 << 20)
    shm: Tmpfs | Bind | None = Tmpfs("/dev/shm", 16 << 20)
    limits: Limits = Limits()
    uid: int = 1000
    gid: int = 1000
    run_as: tuple[int, int] | None = None
    allow_userns: bool = False
    share_net: bool = False
    new_session: bool = True
    status_fd: int | None = None
    unset_env: Sequence[str] = ()
    hostname: str = "rollcage"
    root: str | None = None


_NEWROOT = "/newroot"
"""Where the outer stage holds a ``CageSpec.root`` for the inner stage to make it ``/``."""


def outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` without those inside another one (sorted shallow first)."""
    unique = sorted(set(paths), key=lambda p: (p.count("/"), p))
    kept: list[str] = []
    for path in unique:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def python_paths() -> list[str]:
    """Host paths this process's Python needs, read-only: the environment and the rollcage package.

    Covers a virtual environment (``sys.prefix``), the interpreter it was made
    from (``sys.base_prefix``) and, for an editable install, the source tree the
    ``rollcage`` package is imported from (its ``src`` directory, never the
    checkout around it). Paths inside another entry are dropped. Worked out once per
    process (they are the process's own; every rollout's launch asks).
    """
    return list(_python_paths())


@functools.cache
def _python_paths() -> tuple[str, ...]:
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))  # .../src/rollcage
    candidates = [sys.prefix, sys.exec_prefix, *interpreter_paths()]
    candidates.append(os.path.dirname(package))
    candidates.append(os.path.dirname(sys.executable))
    return tuple(outermost(os.path.abspath(path) for path in candidates))


def interpreter_paths() -> list[str]:
    """The host paths of the bare interpreter (``sys.base_prefix`` and its executable), nothing else.

    Enough for ``python -I -S`` (standard library only): no virtual environment,
    no site-packages, no source checkout.
    """
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable) or sys.executable)
    return outermost([sys.base_prefix, sys.base_exec_prefix, os.path.dirname(executable)])


def system_mounts(paths: Iterable[str]) -> list[Mount]:
    """Read-only binds of the host system paths that exist (a symlink is recreated as a link)."""
    mounts: list[Mount] = []
    for path in paths:
        if os.path.islink(path):
            mounts.append(Symlink(os.readlink(path), path))
        elif os.path.exists(path):
            mounts.append(Bind(path, path))
    return mounts


class _Tree:
    """bwrap options that build a file tree, creating parent directories world-traversable."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self._made: set[str] = {"/"}
        self._mounted: list[str] = []
        self.scratch: str | None = None
        self._host_view: list[str] = []  # binds at their host path: what is under them is the host's

    def _parents(self, dest: str) -> None:
        parts = dest.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            parent = "/" + "/".join(parts[: i + 1])
            if parent not in self._made and not self._under_bind(parent):
                # bwrap would create it 0700 (root-owned when the outer stage runs as root),
                # which the unprivileged cage could not traverse.
                self.args += ["--perms", "0755", "--dir", parent]
                self._made.add(parent)

    def _under_bind(self, path: str) -> bool:
        # Not the scratch /tmp: bwrap would make a mount point there 0700 (root's, as root).
        return any(path.startswith(m.rstrip("/") + "/") for m in self._mounted if m != self.scratch)

    def covered(self, path: str) -> bool:
        """Whether the host's ``path`` is already visible, at its place, through a bind made before.

        A path under a tmpfs (the scratch ``/tmp``) is not: the host's file is hidden there until bound.
        """
        return any(path == m or path.startswith(m.rstrip("/") + "/") for m in self._host_view)

    def add(self, mount: Mount) -> None:
        self._parents(mount.dest)
        if isinstance(mount, Bind):
            self.args += ["--bind" if mount.writable else "--ro-bind", mount.source, mount.dest]
            if mount.source == mount.dest:
                self._host_view.append(mount.dest)
        elif isinstance(mount, Tmpfs):
            size = ["--size", str(mount.size)] if mount.size is not None else []
            self.args += ["--perms", mount.perms, *size, "--tmpfs", mount.dest]
        elif isinstance(mount, FileFromFd):
            self.args += ["--perms", mount.perms, "--file", str(mount.fd), mount.dest]
        else:
            self.args += ["--symlink", mount.target, mount.dest]
        self._made.add(mount.dest)
        if not isinstance(mount, FileFromFd):
            self._mounted.append(mount.dest)


def _shm_args(shm: Tmpfs | Bind | None) -> list[str]:
    if isinstance(shm, Tmpfs):
        size = ["--size", str(shm.size)] if shm.size is not None else []
        return ["--perms", shm.perms, *size, "--tmpfs", "/dev/shm"]
    if isinstance(shm, Bind):
        return ["--bind", shm.source, "/dev/shm"]
    return []


def cage_argv(spec: CageSpec, *, tools: BwrapTools, as_root: bool) -> list[str]:
    """The full command line that runs ``spec.argv`` in the cage (pure: nothing is checked on disk).

    Args:
        spec: The cage.
        tools: Paths of bwrap, prlimit and setpriv.
        as_root: The caller is root: the two-stage launch when ``spec.run_as`` is set.

    Returns:
        The argv to execute.

    Raises:
        SandboxError: Root must drop privileges but ``setpriv`` was not found.
    """
    tree = _Tree()
    # /tmp comes first, so paths under /tmp that must be visible (a Python environment, a
    # worker's code) are mounted over it rather than hidden by it.
    tree.add(spec.tmp if isinstance(spec.tmp, Tmpfs) else Bind(spec.tmp.source, "/tmp", writable=True))
    tree.scratch = "/tmp"
    if spec.root is not None:
        if not (as_root and spec.run_as is not None):
            raise SandboxError("a cage over a root of its own is made by root only (the two-stage launch)")
        tree.add(Bind(spec.root, _NEWROOT, writable=True))
    for mount in spec.mounts:
        if isinstance(mount, Bind) and not mount.writable and mount.source == mount.dest:
            if tree.covered(mount.dest):
                continue
        tree.add(mount)

    status = ["--json-status-fd", str(spec.status_fd)] if spec.status_fd is not None else []
    namespaces = [
        "--unshare-user",
        *(["--disable-userns"] if tools.disable_userns and not spec.allow_userns else []),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        *([] if spec.share_net else ["--unshare-net"]),
        "--hostname",
        spec.hostname,
        "--die-with-parent",
        # setsid() for the cage: it cannot reach a terminal (TIOCSTI), and the command gets a
        # process group of its own that the caller can signal without hitting bwrap.
        *(["--new-session"] if spec.new_session else []),
        "--uid",
        str(spec.uid),
        "--gid",
        str(spec.gid),
    ]
    environment: list[str] = []
    if spec.env is not None:
        environment.append("--clearenv")
        for name, value in sorted(spec.env.items()):
            environment += ["--setenv", name, value]
    for name in spec.unset_env:
        environment += ["--unsetenv", name]
    runtime = ["--chdir", spec.cwd, *environment]
    limits = spec.limits.prlimit_args()
    command = [tools.prlimit, *limits, "--", *spec.argv] if limits else list(spec.argv)

    two_stage = as_root and spec.run_as is not None
    if not two_stage:
        # One stage, unprivileged: the root, the directories made for the tree (/run, parents of
        # binds) and /dev are tmpfs this uid owns, unbounded. Read-only once built, as the
        # two-stage launch's (root's) are to the cage's uid: only the binds and tmpfs asked for
        # stay writable (the remounts are not recursive).
        proc_dev = ["--proc", "/proc", "--dev", "/dev", *_shm_args(spec.shm)]
        sealed = ["--remount-ro", "/dev", "--remount-ro", "/"]
        return [tools.bwrap, *status, *namespaces, *tree.args, *proc_dev, *sealed, *runtime, "--", *command]
    assert spec.run_as is not None
    if tools.setpriv is None:
        raise SandboxError("setpriv (util-linux) is needed to drop root for the sandbox, and was not found")
    outer = [
        tools.bwrap,
        *status,
        # A PID namespace of its own, so that the death of its init takes everything in it along,
        # the unprivileged inner bwrap included: a parent-death signal cannot, because bwrap's
        # monitor (root without capabilities) may not signal a process of another uid.
        "--unshare-pid",
        "--die-with-parent",
        # Only what setpriv needs to drop to the unprivileged uid.
        "--cap-drop",
        "ALL",
        "--cap-add",
        "CAP_SETUID",
        "--cap-add",
        "CAP_SETGID",
        *tree.args,
        # The inner bwrap may mount a new /proc only where a full one is already visible.
        "--bind",
        "/proc",
        "/proc",
        "--dev",
        "/dev",
        *_shm_args(spec.shm),
        "--",
        tools.setpriv,
        "--reuid",
        str(spec.run_as[0]),
        "--regid",
        str(spec.run_as[1]),
        "--clear-groups",
        "--no-new-privs",
        "--",
    ]
    # The inner stage sees the outer's tree, /dev included as the outer made it (its device nodes, its
    # own devpts, the bounded /dev/shm): --dev-bind only leaves those nodes usable, every other mount of
    # the tree has nodev from the outer stage already. A fresh --dev here cost every rollout another
    # tmpfs, devpts and six binds, each of which has bubblewrap read the whole mount table again.
    inner = [tools.bwrap, *namespaces, "--dev-bind", "/", "/", "--proc", "/proc"]
    if spec.root is not None:
        # Nothing of the outer stage's tree: the root alone, with a /dev and /proc of the cage's own.
        # prlimit is the host's, so it runs here, before the inner stage (whose processes inherit).
        inner = [tools.bwrap, *namespaces, "--bind", _NEWROOT, "/", "--proc", "/proc", "--dev", "/dev"]
        limited = [tools.prlimit, *limits, "--"] if limits else []
        return [*outer, *limited, *inner, *runtime, "--", *spec.argv]
    return [*outer, *inner, *runtime, "--", *command]


@functools.cache
def _bwrap_version(bwrap: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"cannot run {bwrap} --version: {exc}") from exc
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout)
    if out.returncode != 0 or match is None:
        raise SandboxError(f"{bwrap} --version failed: {out.stderr.strip() or out.stdout.strip()}")
    return tuple(int(part) for part in match.groups() if part is not None)


_SELF_CHECK_TIMEOUTS_S = (30.0, 90.0)
"""The self-check's time bound, per try: a slow answer is retried once with more time."""

_self_check_lock = threading.Lock()
_self_checks: dict[tuple[str, str | None, tuple[int, int] | None, bool], str | None] = {}


def _try_sandbox(bwrap: str, setpriv: str | None, run_as: tuple[int, int] | None, nested: bool) -> str | None:
    """Run ``true`` in a minimal sandbox the way a cage will; ``None`` if it works, else why not.

    A definite answer is kept for the process (one check, however many rollouts
    start at once); a check that cannot finish is no answer and is not kept.

    Raises:
        SandboxError: The check did not finish in time even when retried, or could not be started:
            the sandbox may work, but this process cannot tell now.
    """
    key = (bwrap, setpriv, run_as, nested)
    with _self_check_lock:
        if key not in _self_checks:
            _self_checks[key] = _self_check(bwrap, setpriv, run_as, nested)
        return _self_checks[key]


def _self_check(bwrap: str, setpriv: str | None, run_as: tuple[int, int] | None, nested: bool) -> str | None:
    inner = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/"]
    if nested:
        # A cage that makes cages (the worker caging its executor) needs one more user namespace.
        argv = [*inner, "--proc", "/proc", "--dev", "/dev", "--", *inner, "--disable-userns", "--", "true"]
    else:
        argv = [*inner, "--", "true"]
    if run_as is not None and setpriv is not None:
        argv = [setpriv, "--reuid", str(run_as[0]), "--regid", str(run_as[1]), "--clear-groups", "--", *argv]
    for timeout in _SELF_CHECK_TIMEOUTS_S:
        try:
            # A session of its own, so that a hung check is killed with everything it started.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd="/",
                start_new_session=True,
            )
        except OSError as exc:
            raise SandboxError(f"cannot run the bubblewrap self-check ({argv[0]}): {exc}") from exc
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)  # not reaped yet: the group id is still its own
            proc.communicate()
            logger.warning("the bubblewrap self-check took over %gs", timeout)
            continue
        if proc.returncode == 0:
            return None
        return stderr.decode("utf-8", "replace").strip() or f"exit code {proc.returncode}"
    raise SandboxError(
        f"the bubblewrap self-check ({argv[0]} ... true) did not finish within "
        f"{' s, then '.join(f'{t:g}' for t in _SELF_CHECK_TIMEOUTS_S)} s: the machine is overloaded or "
        "bwrap hangs here. bubblewrap did not refuse; retry when the machine is less busy"
    )


def which(name: str) -> str | None:
    """A program's path; util-linux tools live in /usr/bin or /usr/sbin, which PATH may lack."""
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/bin:/sbin")


def find_tools(
    *,
    bwrap_path: str | None = None,
    run_as: tuple[int, int] | None = None,
    nested: bool = False,
    hint: str = "or ask for --sandbox none explicitly to run uncontained",
) -> BwrapTools:
    """Find bwrap, prlimit and setpriv, and try a trivial sandbox (once per process and setting; blocking).

    Args:
        bwrap_path: The bwrap executable; ``None``: found on PATH.
        run_as: ``(uid, gid)`` root drops to before the user namespace is made (root only).
        nested: Also check that a cage can make a cage of its own (one level).
        hint: What the user can do instead, appended to every refusal.

    Raises:
        SandboxError: A program is missing or bubblewrap cannot create the namespaces here; the
            message says what to do.
    """
    bwrap = bwrap_path or which("bwrap")
    if bwrap is None or not os.access(bwrap, os.X_OK):
        raise SandboxError(
            "bubblewrap (bwrap) is not installed, so agent code cannot be contained; install it "
            f"(apt-get install bubblewrap) {hint}"
        )
    prlimit = which("prlimit")
    if prlimit is None:
        raise SandboxError(f"prlimit (util-linux) is needed to set the sandbox's resource limits; {hint}")
    version = _bwrap_version(bwrap)
    setpriv = which("setpriv")
    if run_as is not None and setpriv is None:
        raise SandboxError(
            f"setpriv (util-linux) is needed to drop root for the sandbox, and was not found; {hint}"
        )
    disable_userns = version >= (0, 8)
    problem = _try_sandbox(bwrap, setpriv, run_as, nested and disable_userns)
    if problem is not None:
        who = "" if run_as is None else f" as uid {run_as[0]}"
        raise SandboxError(
            f"bubblewrap cannot create a sandbox here{who}: {problem}. Allow unprivileged user "
            "namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1 or "
            f"kernel.apparmor_restrict_unprivileged_userns=0), {hint}"
        )
    return BwrapTools(bwrap=bwrap, prlimit=prlimit, setpriv=setpriv, disable_userns=disable_userns)
