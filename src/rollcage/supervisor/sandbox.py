"""Sandbox launchers: the command line that starts the worker, contained (bwrap) or not (none).

The cage itself (namespaces, the two-stage launch that keeps root out of the
sandbox, limits) is :mod:`rollcage.cage`'s; this module lays one rollout out in it.

Layout of one rollout under bubblewrap
======================================

On the host, the rollout directory ``R`` keeps its documented names
(docs/reference/artifacts.md). The worker
sees a different, smaller tree, staged in the supervisor's private directory
(``<private>``, on a memory file system where there is one: see
:func:`rollcage.budgets.private_parent`); ``R/.sandbox/`` holds what a
later run needs to clean up after a killed supervisor (the token, the budgets'
record). Both are removed when the rollout ends::

    host                               sandbox                     worker may
    R/input.json                       (not visible)               -          the controller's original
    <private>/input.json               /rollout/input.json         read       rewritten: endpoints -> proxy
    <private>/root/                    /rollout/                   write      where result.json is published
    R/checkpoint.jsonl                 /rollout/checkpoint.jsonl   append     live evidence, in place
    R/resume.jsonl (when resuming)     /rollout/resume.jsonl       read       an earlier attempt's journal
    R/workspace/ (a bounded tmpfs      /rollout/workspace/         write      the agent's working directory
      as root, see budgets.py)
    <private>/fs/tmp, fs/shm (root)    /tmp, /dev/shm              write      bounded tmpfs (a warm start
                                                                              mounts them in the cage)
    <private>/proxy.sock               /run/rollcage/proxy.sock    connect    the egress proxy
    R/worker.log                       (stdout and stderr)         write      through the inherited fd only
    R/result.json                      (not visible)               -          copied from <private>/root/
    R/model_capture.jsonl, R/receipt.json   (not visible)          -          supervisor only

``/rollout`` itself is a writable directory because ``result.json`` is published
atomically (temporary file, ``rename``), which needs a writable directory; but
that directory is a staging area, not ``R``: nothing written there reaches the
rollout directory except ``result.json``, which the supervisor copies into ``R``
after the worker is gone (only if it is a regular file, never through a link).
``input.json`` and ``checkpoint.jsonl`` are mount points inside it, so they
cannot be replaced or renamed. The worker's defaults (checkpoint, stop file and
workspace beside RESULT) line up with this tree.

Also visible, read-only at their host paths: the system directories
(``/usr``, ``/etc``, ...), the Python environment (``sys.prefix``,
``sys.base_prefix``) and the directory the ``rollcage`` package is imported
from (mounted over the private ``/tmp`` if they live there). ``/proc`` shows only
the sandbox's processes; ``/dev`` is minimal. Nothing else is writable: the root,
``/dev`` and the directories made for the tree are read-only (root-owned as root,
remounted read-only without root). The network namespace has only a loopback
interface with nothing listening.

The agent's code does not see all of this: the worker runs its executor in a
cage of its own (:mod:`rollcage.cage`, ``executor_cage``) where ``/rollout`` and
``/run/rollcage`` are covered and only the workspace, ``/tmp`` and ``/dev/shm``
stay. The worker's sandbox therefore keeps the right to make one more user
namespace; with ``executor_cage="shared"`` it gets ``--disable-userns`` instead.

Without bubblewrap
==================

``NoSandboxLauncher`` runs the worker directly on the host, in ``R`` itself
(result, checkpoint, stop file and workspace at their documented places), with the
allow-listed environment and ``PR_SET_PDEATHSIG`` (via ``setpriv``) so it dies
with the supervisor. Agent code is not contained; every launch logs a warning.

Its start is warm by default (``NoSandbox.worker_start``): a holder
(:data:`NONE_HOLDER_SCRIPT`) stands where the worker would, and the warm template
(:mod:`rollcage.warm`) forks the worker beside it, the supervisor's child, with the
cold start's command line, environment, working directory, limits and umask, and the
same parent-death signal. A warm start that fails has the holder run the cold worker
instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollcage.budgets import CageTmpfs, Place, Scratch
from rollcage.cage import (
    CAGE_ENV,
    HOLDER_SCRIPT,
    IMAGE_ROOT,
    Bind,
    BwrapTools,
    CageSpec,
    Limits,
    Mount,
    Tmpfs,
    cage_argv,
    find_tools,
    outermost,
    python_paths,
    system_mounts,
    which,
)
from rollcage.forkserver import WorkerStart
from rollcage.runfiles import RolloutLayout
from rollcage.supervisor.config import BwrapSandbox, NoSandbox

__all__ = [
    "NONE_HOLDER_SCRIPT",
    "SANDBOX_PROXY_SOCKET",
    "SANDBOX_ROLLOUT_DIR",
    "USERNS_HOLDER_SCRIPT",
    "BwrapLauncher",
    "BwrapTools",
    "LaunchPlan",
    "NoSandboxLauncher",
    "bwrap_argv",
    "python_paths",
    "worker_environment",
    "worker_limits",
]

logger = logging.getLogger("rollcage.supervisor")

SANDBOX_ROLLOUT_DIR = "/rollout"
"""The rollout directory as the worker sees it under bwrap."""

SANDBOX_PROXY_SOCKET = "/run/rollcage/proxy.sock"
"""The egress proxy's Unix socket as the worker sees it under bwrap."""

_SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"


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
        pass_fds: Descriptors the worker inherits besides its standard ones (the relay of a
            harness rollout's boundaries to the supervisor), at the same numbers: through
            bubblewrap for a cold start; for a warm one, with the start to the template
            (:attr:`~rollcage.forkserver.WorkerStart.pass_fds`), bubblewrap and its holder
            holding none as root; a holder that runs the cold worker should the warm start fail
            (a non-root supervisor's, ``--sandbox none``'s) holds them too, for that worker.
        worker_journal: The worker writes ``checkpoint.jsonl``; ``False`` for a harness rollout,
            whose journal the supervisor writes (the sandbox then does not see the file).
        warm: The worker the template forks into the cage, whose payload is then a holder
            (:mod:`rollcage.warm`); ``None``: the command runs the worker itself (a cold start).
    """

    sandbox: Literal["bwrap", "none"]
    argv: list[str]
    env: dict[str, str]
    cwd: str
    result_dir: Path
    proxy_socket: str | None
    owner: tuple[int, int] | None = None
    pass_fds: tuple[int, ...] = ()
    worker_journal: bool = True
    warm: WorkerStart | None = None


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
    scratch: Scratch | None = None,
    worker_journal: bool = True,
    limits: Limits | None = None,
    image_root: Path | None = None,
) -> list[str]:
    """The full command line that runs ``worker_argv`` in the sandbox (pure: nothing is checked on disk).

    Args:
        config: Limits and paths.
        tools: Paths of bwrap, prlimit and setpriv.
        layout: The rollout's host paths.
        worker_argv: The worker command as it runs inside (paths in the sandbox's view).
        worker_env: The worker's entire environment.
        ro_paths: Host paths to mount read-only at the same place (the Python environment, extras).
        as_root: The supervisor is root: use the two-stage launch (see :mod:`rollcage.cage`) when
            ``config.run_as_uid`` is set.
        status_fd: An inherited file descriptor for bwrap's JSON status (``--json-status-fd``) of
            the outermost bwrap: its ``child-pid`` is the host PID of the outermost PID namespace's
            init, whose death takes the whole sandbox with it.
        scratch: The writable places; ``None``: the workspace in place and bubblewrap tmpfs of the
            configured sizes.
        worker_journal: Mount ``checkpoint.jsonl`` for the worker to append to; ``False``: the
            supervisor writes it (a harness rollout) and the sandbox does not see it.
        limits: The per-process limits ``worker_argv`` starts under; ``None``: the worker's
            (:func:`worker_limits`). With none set, no ``prlimit`` runs.
        image_root: An image rollout's copy-on-write root (:mod:`rollcage.supervisor.imageroot`),
            bound writable at :data:`~rollcage.cage.IMAGE_ROOT` for the worker to cage agent code in.

    Returns:
        The argv to execute.
    """
    if scratch is None:
        scratch = Scratch(
            workspace=layout.workspace,
            tmp=Place("/tmp", size=config.tmp_size_bytes),
            shm=Place("/dev/shm", size=config.shm_bytes),
        )
    mounts: list[Mount] = [*system_mounts(config.system_paths)]
    mounts += [Bind(path, path) for path in outermost(ro_paths)]
    if layout.proxy_socket is not None:
        mounts.append(Bind(str(layout.proxy_socket), SANDBOX_PROXY_SOCKET, writable=True))
    mounts += [
        Bind(str(layout.worker_root), SANDBOX_ROLLOUT_DIR, writable=True),
        Bind(str(layout.worker_input), f"{SANDBOX_ROLLOUT_DIR}/input.json"),
        *(
            [Bind(str(layout.checkpoint), f"{SANDBOX_ROLLOUT_DIR}/checkpoint.jsonl", writable=True)]
            if worker_journal
            else []
        ),
        Bind(str(scratch.workspace), f"{SANDBOX_ROLLOUT_DIR}/workspace", writable=True),
    ]
    if layout.resume_journal.is_file():
        # The controller's validated copy of an earlier attempt's journal (rollcage.resume): read-only.
        mounts.append(Bind(str(layout.resume_journal), f"{SANDBOX_ROLLOUT_DIR}/resume.jsonl"))
    if image_root is not None:
        mounts.append(Bind(str(image_root), IMAGE_ROOT, writable=True))
    run_as = (
        (config.run_as_uid, config.run_as_gid)
        if config.run_as_uid is not None and config.run_as_gid is not None
        else None
    )
    spec = CageSpec(
        argv=worker_argv,
        env=worker_env,
        cwd=f"{SANDBOX_ROLLOUT_DIR}/workspace",
        mounts=mounts,
        tmp=_mount(scratch.tmp),
        shm=_mount(scratch.shm),
        limits=worker_limits(config) if limits is None else limits,
        uid=config.sandbox_uid,
        gid=config.sandbox_gid,
        run_as=run_as,
        # The worker cages the agent's code in a sandbox of its own: one more user namespace, made by
        # the worker (trusted); the executor's cage has --disable-userns.
        allow_userns=config.executor_cage == "bwrap",
        status_fd=status_fd,
    )
    return cage_argv(spec, tools=tools, as_root=as_root)


def _mount(place: Place) -> Tmpfs | Bind:
    """The cage's mount of one writable place the budgets chose."""
    if place.host is not None:
        return Bind(str(place.host), place.dest, writable=True)
    return Tmpfs(place.dest, place.size)


def worker_limits(config: BwrapSandbox) -> Limits:
    """The per-process limits of a worker's cage."""
    return Limits(
        address_space_bytes=config.address_space_bytes,
        max_processes=config.max_processes,
        file_size_bytes=config.file_size_bytes,
        cpu_seconds=config.cpu_seconds,
        open_files=config.open_files,
        core_bytes=None,
    )


def _cage_mount(volume: CageTmpfs, owner: tuple[int, int] | None) -> dict[str, Any]:
    """A :attr:`WorkerStart.mounts` entry: owned by the cage user's host ids, as a host-mounted tmpfs is."""
    uid, gid = owner or (os.getuid(), os.getgid())
    size, inodes = volume.max_bytes, volume.mount_inodes
    return {"path": volume.inside, "size": size, "inodes": inodes, "uid": uid, "gid": gid}


def _within(path: str, place: str) -> bool:
    path = os.path.abspath(path)
    return path == place or path.startswith(place.rstrip("/") + "/")


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, for every thread)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


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

        A budget that cannot be a hard bound here is named in one warning per process, or, with
        ``require_budgets``, refused (:func:`~rollcage.budgets.check_budgets`).

        Raises:
            SandboxError: bubblewrap, prlimit or setpriv is missing, or bubblewrap cannot create
                the namespaces here (nor, with ``executor_cage`` bwrap, a cage inside the cage), or
                its self-check did not finish in time (a busy machine, not a refusal: it is tried
                again next time), or ``require_budgets`` is set and a budget would be weak; the
                message says which, and how to proceed.
        """
        if self._tools is not None:
            return self._tools
        run_as: tuple[int, int] | None = None
        if os.geteuid() == 0 and self.config.run_as_uid is not None and self.config.run_as_gid is not None:
            run_as = (self.config.run_as_uid, self.config.run_as_gid)
        tools = find_tools(
            bwrap_path=self.config.bwrap_path,
            run_as=run_as,
            nested=self.config.executor_cage == "bwrap",
        )
        # Imported here: the budgets room imports this module (its layout), not the other way.
        from rollcage.budgets import check_budgets

        check_budgets(self.config)
        self._tools = tools
        return tools

    @property
    def enters_warm(self) -> bool:
        """Whether a warm start can enter this launcher's cages (:mod:`rollcage.warm`; call :meth:`check`
        first): as root, with the two-stage launch (:attr:`owner`); not as root, through the user
        namespaces bubblewrap makes unprivileged, which the supervisor's uid owns. A bubblewrap
        installed setuid makes them as root, where this uid may not join them: its starts stay cold.
        """
        if os.geteuid() == 0:
            return self.owner is not None
        return not _setuid(self.check().bwrap)

    @property
    def owner(self) -> tuple[int, int] | None:
        """``(uid, gid)`` the sandbox runs as on the host when it differs from the supervisor's (root)."""
        uid, gid = self.config.run_as_uid, self.config.run_as_gid
        return (uid, gid) if os.geteuid() == 0 and uid is not None and gid is not None else None

    def plan(
        self,
        layout: RolloutLayout,
        *,
        worker_command: Sequence[str],
        worker_env: Mapping[str, str],
        token_env: Mapping[str, str],
        status_fd: int | None = None,
        scratch: Scratch | None = None,
        enter: Sequence[str] = (),
        extra_ro: Sequence[str] = (),
        worker_journal: bool = True,
        pass_fds: Sequence[int] = (),
        warm_cgroups: Sequence[str] | None = None,
        image_root: Path | None = None,
    ) -> LaunchPlan:
        """The launch plan for one rollout (call :meth:`check` first).

        Args:
            layout: Host paths.
            worker_command: The worker program; INPUT RESULT --checkpoint are appended.
            worker_env: The worker's environment (inside the sandbox).
            token_env: Variables that also go to the bwrap processes on the host (the supervision token).
            status_fd: Where bwrap writes its JSON status (see :func:`bwrap_argv`); it must be
                inherited by the launched process.
            scratch: The writable places the budgets chose (see :class:`Scratch`).
            enter: A prefix run first on the host (moving the sandbox into its cgroups).
            extra_ro: More host paths mounted read-only at the same place (a harness's environment,
                the compiled bytecode cache).
            worker_journal: See :attr:`LaunchPlan.worker_journal`.
            pass_fds: See :attr:`LaunchPlan.pass_fds`.
            warm_cgroups: Start the worker warm (:mod:`rollcage.warm`: ``worker_command`` is then
                only what the template runs), moving it into these ``cgroup.procs`` files;
                ``None``: a cold start, ``worker_command`` in the cage.
            image_root: An image rollout's mounted root (see :func:`bwrap_argv`).
        """
        tools = self.check()
        root = SANDBOX_ROLLOUT_DIR
        args = [f"{root}/input.json", f"{root}/result.json", "--checkpoint", f"{root}/checkpoint.jsonl"]
        ro = [*python_paths(), *self.config.extra_ro_paths, *extra_ro]
        userns = warm_cgroups is not None and os.geteuid() != 0
        if userns:
            # Not root: the holder's arguments are the cold start (its limits, then the worker), which it
            # runs only if the kernel refuses the warm one's entry; its cage is a cold start's too.
            cold = [*worker_command, *args]
            limits = worker_limits(_within_hard_nofile(self.config)).prlimit_args()
            cold = [tools.prlimit, *limits, "--", *cold] if limits else cold
            argv = ["sh", "-c", USERNS_HOLDER_SCRIPT, "rollcage-holder", *cold]
            if os.path.isabs(worker_command[0]):
                ro.append(os.path.dirname(worker_command[0]))
        elif warm_cgroups is not None:
            # The holder stands where the worker would; the worker is forked in beside it.
            argv = ["sh", "-c", HOLDER_SCRIPT, "rollcage-holder"]
        else:
            argv = [*worker_command, *args]
            if os.path.isabs(worker_command[0]):
                ro.append(os.path.dirname(worker_command[0]))
        in_cage = scratch.in_cage if scratch is not None else ()
        if in_cage and warm_cgroups is None:
            raise ValueError("scratch mounted in the cage needs a warm start, which mounts it")
        env = dict(worker_env)
        if self.config.executor_cage == "bwrap":
            # The worker cages its executor with the same bubblewrap, wherever it is installed.
            env[CAGE_ENV] = f"bwrap:{tools.bwrap}"
            ro.append(tools.bwrap)
        ro = [path for path in ro if os.path.exists(path)]
        config = _within_hard_nofile(self.config)
        warm: WorkerStart | None = None
        if warm_cgroups is not None:
            warm = WorkerStart(
                argv=args,
                # As bwrap gives its payload (--chdir sets PWD).
                env={**env, **token_env, "PWD": f"{root}/workspace"},
                cwd=f"{root}/workspace",
                uid=config.sandbox_uid,
                gid=config.sandbox_gid,
                limits=dataclasses.asdict(worker_limits(config)),
                umask=_umask(),
                cgroups=list(warm_cgroups),
                clear_groups=os.geteuid() == 0,
                mounts=[_cage_mount(volume, self.owner) for volume in in_cage],
                # What the cage shows under them (a Python environment in /tmp) stays shown.
                keep=[path for path in outermost(ro) if any(_within(path, v.inside) for v in in_cage)],
                pass_fds=list(pass_fds),
                userns=userns,
            )
        full = bwrap_argv(
            config,
            tools=tools,
            layout=layout,
            worker_argv=argv,
            worker_env={**env, **token_env},
            ro_paths=ro,
            as_root=os.geteuid() == 0,
            status_fd=status_fd,
            scratch=scratch,
            worker_journal=worker_journal,
            # A warm worker takes the cage's limits itself (rollcage.warm) and is not the holder's
            # child: the holder, a shell that only relays an exit status, needs none (one exec less).
            limits=None if warm is None else Limits(core_bytes=None),
            image_root=image_root,
        )
        return LaunchPlan(
            sandbox="bwrap",
            argv=[*enter, *full],
            env={"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", **token_env},
            cwd="/",
            result_dir=layout.worker_root,
            proxy_socket=SANDBOX_PROXY_SOCKET if layout.proxy_socket is not None else None,
            owner=self.owner,
            pass_fds=tuple(pass_fds),
            worker_journal=worker_journal,
            warm=warm,
        )


USERNS_HOLDER_SCRIPT = (
    # The bwrap holder's words (rollcage.cage.HOLDER_SCRIPT) for a non-root supervisor's cage: it
    # announces itself, then waits for the warm worker's exit code (it exits with it), or for "cold":
    # the kernel refused the warm start's entry into the cage and no worker runs, so it becomes the
    # cold worker (its arguments: prlimit and the cold command line) with the signals, stdin and
    # stdout a cold start has. The end of its socket without a word ends it with 125.
    "trap '' HUP INT QUIT TERM USR1 USR2; printf r; exec >/dev/null; "
    "IFS= read -r code || code=125; "
    'if [ "$code" = cold ]; then trap - HUP INT QUIT TERM USR1 USR2; exec "$@" </dev/null >&2; fi; '
    "while IFS= read -r _; do :; done; "
    'case $code in ""|*[!0-9]*) code=125;; esac; '
    'exit "$code"'
)
"""The holder a non-root supervisor's warm bwrap start runs in the worker's place (by ``/bin/sh -c``)."""


def _setuid(path: str) -> bool:
    """Whether the program at ``path`` is installed setuid (a setuid bubblewrap: see
    :attr:`BwrapLauncher.enters_warm`); logged once per path at debug level."""
    try:
        setuid = bool(os.stat(path).st_mode & stat.S_ISUID)
    except OSError:
        return False
    if setuid and path not in _setuid_logged:
        _setuid_logged.add(path)
        logger.debug(
            "%s is setuid: its cages' namespaces are root's, which a warm start without root cannot "
            "join; workers start cold",
            path,
        )
    return setuid


_setuid_logged: set[str] = set()


NONE_HOLDER_SCRIPT = (
    # The bwrap holder's words (rollcage.cage.HOLDER_SCRIPT), outside any cage: it announces itself,
    # then waits for the warm worker's exit code (it exits with it) or signal ("sN": it dies of it,
    # so the supervisor sees what a cold worker's death shows), or for "cold": the warm start failed
    # and no worker runs, so it becomes the cold worker (its arguments, the cold command line), with
    # the signals, stdin and stdout a cold start has. The end of its socket without a word (the
    # supervisor gone) ends it with 125.
    "trap '' HUP INT QUIT TERM USR1 USR2; printf r; exec >/dev/null; "
    "IFS= read -r code || code=125; "
    "untrap() { trap - HUP INT QUIT TERM USR1 USR2; }; "
    'if [ "$code" = cold ]; then untrap; exec "$@" </dev/null >&2; fi; '
    "while IFS= read -r _; do :; done; "
    'case $code in s[0-9]*) untrap; kill -"${code#s}" $$; code=$((128 + ${code#s}));; esac; '
    'case $code in ""|*[!0-9]*) code=125;; esac; '
    'exit "$code"'
)
"""The holder a warm ``--sandbox none`` start spawns in the worker's place (run by ``/bin/sh -c``)."""


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
        pass_fds: Sequence[int] = (),
        warm: bool = False,
    ) -> LaunchPlan:
        """The launch plan for one rollout: the worker in ``R`` itself, dying with the supervisor.

        ``status_fd`` is accepted for symmetry with bwrap and ignored; ``pass_fds`` are inherited
        (see :attr:`LaunchPlan.pass_fds`). ``warm``: a holder (:data:`NONE_HOLDER_SCRIPT`) is
        started, and the template forks the worker beside it (:attr:`LaunchPlan.warm`, uncaged);
        should that fail, the holder runs the cold worker in its place.
        """
        args = [str(layout.worker_input), str(layout.result), "--checkpoint", str(layout.checkpoint)]
        argv = [*worker_command, *args]
        setpriv = which("setpriv")
        if setpriv is not None:
            # PR_SET_PDEATHSIG without a preexec_fn (unsafe with threads): the worker is killed
            # if the supervisor dies, as bwrap's --die-with-parent does for the sandbox.
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        env = {**worker_env, **token_env}
        start: WorkerStart | None = None
        if warm:
            # The holder's arguments are the cold start, which it runs only if the warm one fails.
            argv = ["/bin/sh", "-c", NONE_HOLDER_SCRIPT, "rollcage-holder", *argv]
            start = WorkerStart(
                argv=args,
                env=env,
                cwd=str(layout.workspace),
                uid=os.getuid(),
                gid=os.getgid(),
                umask=_umask(),
                clear_groups=False,
                caged=False,
                pass_fds=list(pass_fds),
            )
        return LaunchPlan(
            sandbox="none",
            argv=argv,
            env=env,
            cwd=str(layout.workspace),
            result_dir=layout.root,
            proxy_socket=str(layout.proxy_socket) if layout.proxy_socket is not None else None,
            pass_fds=tuple(pass_fds),
            warm=start,
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
