"""Sandbox launchers: the command line that starts the worker, contained (bwrap) or not (none).

Layout of one rollout under bubblewrap
======================================

On the host, the rollout directory ``R`` keeps DESIGN.md's names. The worker
sees a different, smaller tree; ``R/.sandbox/`` is the supervisor's staging area
and is removed when the rollout ends::

    host                               sandbox                     worker may
    R/input.json                       (not visible)               -          the controller's original
    R/.sandbox/input.json              /rollout/input.json         read       rewritten: endpoints -> proxy
    R/.sandbox/root/                   /rollout/                   write      where result.json is published
    R/checkpoint.jsonl                 /rollout/checkpoint.jsonl   append     live evidence, in place
    R/workspace/                       /rollout/workspace/         write      the agent's working directory
    <tmp>/proxy.sock                   /run/rollcage/proxy.sock    connect    the egress proxy
    R/worker.log                       (stdout and stderr)         write      through the inherited fd only
    R/result.json                      (not visible)               -          moved from R/.sandbox/root/
    R/model_capture.jsonl, R/receipt.json   (not visible)          -          supervisor only

``/rollout`` itself is a writable directory because ``result.json`` is published
atomically (temporary file, ``rename``), which needs a writable directory; but
that directory is a staging area, not ``R``: nothing written there reaches the
rollout directory except ``result.json``, which the supervisor moves into ``R``
after the worker is gone (only if it is a regular file, never through a link).
``input.json`` and ``checkpoint.jsonl`` are mount points inside it, so they
cannot be replaced or renamed. The worker's defaults (checkpoint, stop file and
workspace beside RESULT) line up with this tree.

Also visible, read-only at their host paths: the system directories
(``/usr``, ``/etc``, ...), the Python environment (``sys.prefix``,
``sys.base_prefix``) and the directory the ``rollcage`` package is imported
from (mounted over the private ``/tmp`` if they live there). ``/tmp`` is a
private, size-limited tmpfs; ``/proc`` shows only the sandbox's processes;
``/dev`` is minimal. The network namespace has only a loopback interface with
nothing listening.

Root and RLIMIT_NPROC
=====================

The kernel never enforces ``RLIMIT_NPROC`` for processes of (host) root, and a
user namespace created by root maps the sandbox's uid to host root. So when the
supervisor runs as root, the sandbox is started in two stages: an outer
``bwrap`` (root, mount namespace only) builds the file tree above, then drops to
an unprivileged uid (``setpriv``) and runs the inner ``bwrap``, which creates
the user, PID, network, IPC, UTS and cgroup namespaces over that tree. The
sandbox then runs as that unprivileged uid on the host, the process limit holds
(a fork bomb is contained), and the files it creates are owned by that uid.
The outer stage has a PID namespace of its own: when its init dies (the
supervisor died, or killed it), the kernel kills everything inside, the
unprivileged stages included. When the supervisor is not root, one ``bwrap``
does both.

Without bubblewrap
==================

``NoSandboxLauncher`` runs the worker directly on the host, in ``R`` itself
(result, checkpoint, stop file and workspace at their DESIGN.md places), with the
allow-listed environment and ``PR_SET_PDEATHSIG`` (via ``setpriv``) so it dies
with the supervisor. Agent code is not contained; every launch logs a warning.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollcage.errors import SandboxError
from rollcage.supervisor.config import BwrapSandbox, NoSandbox

__all__ = [
    "SANDBOX_PROXY_SOCKET",
    "SANDBOX_ROLLOUT_DIR",
    "BwrapLauncher",
    "BwrapTools",
    "LaunchPlan",
    "NoSandboxLauncher",
    "RolloutLayout",
    "bwrap_argv",
    "python_paths",
    "worker_environment",
]

logger = logging.getLogger("rollcage.supervisor")

SANDBOX_ROLLOUT_DIR = "/rollout"
"""The rollout directory as the worker sees it under bwrap."""

SANDBOX_PROXY_SOCKET = "/run/rollcage/proxy.sock"
"""The egress proxy's Unix socket as the worker sees it under bwrap."""

_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class RolloutLayout:
    """Where one rollout's files live on the host (see the module docstring for the sandbox's view).

    Attributes:
        root: The rollout directory ``R``.
        proxy_socket: The egress proxy's socket on the host; ``None`` without a proxy.
    """

    root: Path
    proxy_socket: Path | None = None

    @property
    def input(self) -> Path:
        """The controller's ``input.json`` (never visible in the sandbox)."""
        return self.root / "input.json"

    @property
    def staging(self) -> Path:
        """The supervisor's staging area, removed at the end."""
        return self.root / ".sandbox"

    @property
    def token(self) -> Path:
        """This rollout's supervision token, for finding its processes after a supervisor died."""
        return self.staging / "token"

    @property
    def worker_input(self) -> Path:
        """The input as rewritten for the worker's view."""
        return self.staging / "input.json"

    @property
    def worker_root(self) -> Path:
        """The writable directory mounted as ``/rollout`` (bwrap only)."""
        return self.staging / "root"

    @property
    def workspace(self) -> Path:
        """The agent's working directory."""
        return self.root / "workspace"

    @property
    def checkpoint(self) -> Path:
        """The checkpoint journal."""
        return self.root / "checkpoint.jsonl"

    @property
    def result(self) -> Path:
        """Where ``result.json`` ends up."""
        return self.root / "result.json"

    @property
    def receipt(self) -> Path:
        """``receipt.json``, written last."""
        return self.root / "receipt.json"

    @property
    def capture(self) -> Path:
        """The egress proxy's ``model_capture.jsonl``."""
        return self.root / "model_capture.jsonl"

    @property
    def log(self) -> Path:
        """The worker's stdout and stderr."""
        return self.root / "worker.log"

    @property
    def stop(self) -> Path:
        """The external stop file."""
        return self.root / "stop"


@dataclass(frozen=True)
class LaunchPlan:
    """How to start one worker.

    Attributes:
        sandbox: Which launcher made it.
        argv: The command line the supervisor executes.
        env: The environment of that command (bwrap clears it again for the worker).
        cwd: Its working directory.
        result_dir: Host directory where the worker publishes ``result.json``.
        proxy_socket: The proxy socket as the worker sees it (``None`` without a proxy).
        owner: ``(uid, gid)`` the worker runs as on the host, when it differs from
            the supervisor's: the worker-writable paths are handed to it first.
    """

    sandbox: Literal["bwrap", "none"]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    result_dir: Path
    proxy_socket: str | None
    owner: tuple[int, int] | None = None


@dataclass(frozen=True)
class BwrapTools:
    """Host programs the bwrap launcher needs."""

    bwrap: str
    prlimit: str
    setpriv: str | None
    disable_userns: bool = field(default=False)
    """bwrap is new enough (0.8) for ``--disable-userns``."""


def python_paths() -> list[str]:
    """Host paths the worker's Python needs, read-only: the environment and the rollcage package.

    Covers a virtual environment (``sys.prefix``), the interpreter it was made
    from (``sys.base_prefix``) and, for an editable install, the source tree the
    ``rollcage`` package is imported from. Paths inside another entry are dropped.
    """
    import rollcage

    candidates = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    candidates.append(str(Path(rollcage.__file__).resolve().parent.parent))
    candidates.append(str(Path(sys.executable).resolve().parent))
    return _outermost(os.path.abspath(path) for path in candidates)


def _outermost(paths: Iterable[str]) -> list[str]:
    unique = sorted(set(paths), key=lambda p: (p.count("/"), p))
    kept: list[str] = []
    for path in unique:
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def _limits(config: BwrapSandbox) -> list[str]:
    limits = {
        "--as": config.address_space_bytes,
        "--nproc": config.max_processes,
        "--fsize": config.file_size_bytes,
        "--cpu": config.cpu_seconds,
        "--nofile": config.open_files,
    }
    # One value sets both the soft and the hard limit, so the worker cannot raise it again.
    return [f"{flag}={value}" for flag, value in limits.items() if value is not None]


class _Tree:
    """bwrap options that build a file tree, creating parent directories world-traversable."""

    def __init__(self) -> None:
        self.args: list[str] = []
        self._made: set[str] = {"/"}
        self._mounted: set[str] = set()

    def _parents(self, dest: str) -> None:
        parts = dest.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            parent = "/" + "/".join(parts[: i + 1])
            if parent not in self._made:
                # bwrap would create it 0700 (root-owned when the outer stage runs as root),
                # which the unprivileged sandbox could not traverse.
                self.args += ["--perms", "0755", "--dir", parent]
                self._made.add(parent)

    def add(self, option: str, source: str, dest: str) -> None:
        self._parents(dest)
        self.args += [option, source, dest]
        self._made.add(dest)
        self._mounted.add(dest)

    def symlink(self, target: str, dest: str) -> None:
        self._parents(dest)
        self.args += ["--symlink", target, dest]
        self._made.add(dest)
        self._mounted.add(dest)

    def mark(self, dest: str) -> None:
        """Record a directory made by other options, so no parent or mount is made for it again."""
        self._made.add(dest)

    def covered(self, path: str) -> bool:
        """Whether ``path`` is already visible through a mount or symlink made before."""
        return any(path == m or path.startswith(m + "/") for m in self._mounted)


def bwrap_argv(
    config: BwrapSandbox,
    *,
    tools: BwrapTools,
    layout: RolloutLayout,
    worker_argv: Sequence[str],
    worker_env: Mapping[str, str],
    ro_paths: Sequence[str],
    as_root: bool,
    status_fd: int | None = None,
) -> list[str]:
    """The full command line that runs ``worker_argv`` in the sandbox (pure: nothing is checked on disk).

    Args:
        config: Limits and paths.
        tools: Paths of bwrap, prlimit and setpriv.
        layout: The rollout's host paths.
        worker_argv: The worker command as it runs inside (paths in the sandbox's view).
        worker_env: The worker's entire environment.
        ro_paths: Host paths to mount read-only at the same place (the Python environment, extras).
        as_root: The supervisor is root: use the two-stage launch (see the module docstring) when
            ``config.run_as_uid`` is set.
        status_fd: An inherited file descriptor for bwrap's JSON status (``--json-status-fd``) of
            the outermost bwrap: its ``child-pid`` is the host PID of the outermost PID namespace's
            init, whose death takes the whole sandbox with it.

    Returns:
        The argv to execute.
    """
    tree = _Tree()
    # The private /tmp comes first, so that paths under /tmp that must be visible (a Python
    # environment, a worker's code) are mounted over it rather than hidden by it.
    size = ["--size", str(config.tmp_size_bytes)] if config.tmp_size_bytes is not None else []
    tree.args += ["--perms", "01777", *size, "--tmpfs", "/tmp"]
    tree.mark("/tmp")
    for path in config.system_paths:
        if os.path.islink(path):
            tree.symlink(os.readlink(path), path)
        elif os.path.exists(path):
            tree.add("--ro-bind", path, path)
    for path in _outermost(ro_paths):
        if not tree.covered(path):
            tree.add("--ro-bind", path, path)
    if layout.proxy_socket is not None:
        tree.add("--bind", str(layout.proxy_socket), SANDBOX_PROXY_SOCKET)
    tree.add("--bind", str(layout.worker_root), SANDBOX_ROLLOUT_DIR)
    tree.add("--ro-bind", str(layout.worker_input), f"{SANDBOX_ROLLOUT_DIR}/input.json")
    tree.add("--bind", str(layout.checkpoint), f"{SANDBOX_ROLLOUT_DIR}/checkpoint.jsonl")
    tree.add("--bind", str(layout.workspace), f"{SANDBOX_ROLLOUT_DIR}/workspace")

    status = ["--json-status-fd", str(status_fd)] if status_fd is not None else []
    namespaces = [
        "--unshare-user",
        *(["--disable-userns"] if tools.disable_userns else []),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--unshare-net",
        "--hostname",
        "rollcage",
        "--die-with-parent",
        # setsid() for the sandbox: it cannot reach a terminal (TIOCSTI), and the worker
        # gets a process group of its own that the supervisor can signal without hitting bwrap.
        "--new-session",
        "--uid",
        str(config.sandbox_uid),
        "--gid",
        str(config.sandbox_gid),
    ]
    runtime = [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--chdir",
        f"{SANDBOX_ROLLOUT_DIR}/workspace",
        "--clearenv",
    ]
    for name, value in sorted(worker_env.items()):
        runtime += ["--setenv", name, value]
    command = [tools.prlimit, *_limits(config), "--", *worker_argv]

    two_stage = as_root and config.run_as_uid is not None
    if not two_stage:
        return [tools.bwrap, *status, *namespaces, *tree.args, *runtime, "--", *command]
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
        "--",
        tools.setpriv,
        "--reuid",
        str(config.run_as_uid),
        "--regid",
        str(config.run_as_gid),
        "--clear-groups",
        "--no-new-privs",
        "--",
    ]
    inner = [tools.bwrap, *namespaces, "--bind", "/", "/", *runtime, "--", *command]
    return [*outer, *inner]


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
_self_checks: dict[tuple[str, str | None, tuple[int, int] | None], str | None] = {}


def _try_sandbox(bwrap: str, setpriv: str | None, run_as: tuple[int, int] | None) -> str | None:
    """Run ``true`` in a minimal sandbox the way the launcher will; ``None`` if it works, else why not.

    A definite answer is kept for the process (one check, however many rollouts
    start at once); a check that cannot finish is no answer and is not kept.

    Raises:
        SandboxError: The check did not finish in time even when retried, or could not be started:
            the sandbox may work, but this process cannot tell now.
    """
    key = (bwrap, setpriv, run_as)
    with _self_check_lock:
        if key not in _self_checks:
            _self_checks[key] = _self_check(bwrap, setpriv, run_as)
        return _self_checks[key]


def _self_check(bwrap: str, setpriv: str | None, run_as: tuple[int, int] | None) -> str | None:
    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "--", "true"]
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
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
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


def _which(name: str) -> str | None:
    # util-linux tools live in /usr/bin or /usr/sbin; PATH may lack the latter.
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/usr/sbin:/bin:/sbin")


def _within_hard_nofile(config: BwrapSandbox) -> BwrapSandbox:
    """``config`` with ``open_files`` at most this process's hard limit, which the sandbox inherits.

    The sandbox cannot raise a hard limit (no privilege), so asking for more than the
    supervisor has would make every launch fail in ``prlimit``.
    """
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if config.open_files is None or hard == resource.RLIM_INFINITY or config.open_files <= hard:
        return config
    return config.model_copy(update={"open_files": hard})


class BwrapLauncher:
    """Builds launch plans that run the worker under bubblewrap."""

    kind: Literal["bwrap"] = "bwrap"

    def __init__(self, config: BwrapSandbox) -> None:
        self.config = config
        self._tools: BwrapTools | None = None

    def check(self) -> BwrapTools:
        """Find bwrap, prlimit and setpriv, and try a trivial sandbox once per process (blocking).

        Raises:
            SandboxError: bubblewrap, prlimit or setpriv is missing, or bubblewrap cannot create
                the namespaces here, or its self-check did not finish in time (a busy machine, not a
                refusal: it is tried again next time); the message says which, and how to proceed.
        """
        if self._tools is not None:
            return self._tools
        bwrap = self.config.bwrap_path or _which("bwrap")
        if bwrap is None or not os.access(bwrap, os.X_OK):
            raise SandboxError(
                "bubblewrap (bwrap) is not installed, so agent code cannot be contained; install it "
                "(apt-get install bubblewrap) or ask for --sandbox none explicitly to run uncontained"
            )
        prlimit = _which("prlimit")
        if prlimit is None:
            raise SandboxError("prlimit (util-linux) is needed to set the sandbox's resource limits")
        version = _bwrap_version(bwrap)
        setpriv = _which("setpriv")
        run_as: tuple[int, int] | None = None
        if os.geteuid() == 0 and self.config.run_as_uid is not None and self.config.run_as_gid is not None:
            if setpriv is None:
                raise SandboxError(
                    "setpriv (util-linux) is needed to drop root for the sandbox, and was not found"
                )
            run_as = (self.config.run_as_uid, self.config.run_as_gid)
        problem = _try_sandbox(bwrap, setpriv, run_as)
        if problem is not None:
            who = "" if run_as is None else f" as uid {run_as[0]}"
            raise SandboxError(
                f"bubblewrap cannot create a sandbox here{who}: {problem}. Allow unprivileged user "
                "namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1 or "
                "kernel.apparmor_restrict_unprivileged_userns=0), or ask for --sandbox none explicitly"
            )
        self._tools = BwrapTools(
            bwrap=bwrap, prlimit=prlimit, setpriv=setpriv, disable_userns=version >= (0, 8)
        )
        return self._tools

    def plan(
        self,
        layout: RolloutLayout,
        *,
        worker_command: Sequence[str],
        worker_env: Mapping[str, str],
        token_env: Mapping[str, str],
        status_fd: int | None = None,
    ) -> LaunchPlan:
        """The launch plan for one rollout (call :meth:`check` first).

        Args:
            layout: Host paths.
            worker_command: The worker program; INPUT RESULT --checkpoint are appended.
            worker_env: The worker's environment (inside the sandbox).
            token_env: Variables that also go to the bwrap processes on the host (the supervision token).
            status_fd: Where bwrap writes its JSON status (see :func:`bwrap_argv`); it must be
                inherited by the launched process.
        """
        tools = self.check()
        root = SANDBOX_ROLLOUT_DIR
        argv = [
            *worker_command,
            f"{root}/input.json",
            f"{root}/result.json",
            "--checkpoint",
            f"{root}/checkpoint.jsonl",
        ]
        as_root = os.geteuid() == 0
        uid, gid = self.config.run_as_uid, self.config.run_as_gid
        owner = (uid, gid) if as_root and uid is not None and gid is not None else None
        ro = [*python_paths(), *self.config.extra_ro_paths]
        if os.path.isabs(worker_command[0]):
            ro.append(os.path.dirname(worker_command[0]))
        full = bwrap_argv(
            _within_hard_nofile(self.config),
            tools=tools,
            layout=layout,
            worker_argv=argv,
            worker_env={**worker_env, **token_env},
            ro_paths=[p for p in ro if os.path.exists(p)],
            as_root=as_root,
            status_fd=status_fd,
        )
        return LaunchPlan(
            sandbox="bwrap",
            argv=full,
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", **token_env},
            cwd="/",
            result_dir=layout.worker_root,
            proxy_socket=SANDBOX_PROXY_SOCKET if layout.proxy_socket is not None else None,
            owner=owner,
        )


class NoSandboxLauncher:
    """Builds launch plans that run the worker as a plain child process (**not contained**)."""

    kind: Literal["none"] = "none"

    def __init__(self, config: NoSandbox) -> None:
        self.config = config

    def check(self) -> None:
        """Nothing to check; logs the warning that agent code is not contained."""
        logger.warning(
            "SANDBOX DISABLED (--sandbox none): agent code runs uncontained, with this user's "
            "file system, network and processes in reach; use bubblewrap for untrusted code"
        )

    def plan(
        self,
        layout: RolloutLayout,
        *,
        worker_command: Sequence[str],
        worker_env: Mapping[str, str],
        token_env: Mapping[str, str],
        status_fd: int | None = None,
    ) -> LaunchPlan:
        """The launch plan for one rollout: the worker in ``R`` itself, dying with the supervisor.

        ``status_fd`` is accepted for symmetry with bwrap and ignored.
        """
        argv = [
            *worker_command,
            str(layout.worker_input),
            str(layout.result),
            "--checkpoint",
            str(layout.checkpoint),
        ]
        setpriv = _which("setpriv")
        if setpriv is not None:
            # PR_SET_PDEATHSIG without a preexec_fn (unsafe with threads): the worker is killed
            # if the supervisor dies, as bwrap's --die-with-parent does for the sandbox.
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        return LaunchPlan(
            sandbox="none",
            argv=argv,
            env={**worker_env, **token_env},
            cwd=str(layout.workspace),
            result_dir=layout.root,
            proxy_socket=str(layout.proxy_socket) if layout.proxy_socket is not None else None,
        )


def worker_environment(
    *, allow: Sequence[str], extra: Mapping[str, str], sandbox: Literal["bwrap", "none"]
) -> dict[str, str]:
    """The worker's environment: fixed basics, the allow-listed variables that are set, then ``extra``."""
    env = {
        "PATH": f"{os.path.dirname(sys.executable)}:{_SANDBOX_PATH}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if sandbox == "bwrap":
        env["HOME"] = "/tmp"
        env["TMPDIR"] = "/tmp"
    else:
        env["HOME"] = os.environ.get("HOME", "/tmp")
    for name in allow:
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(extra)
    return env
