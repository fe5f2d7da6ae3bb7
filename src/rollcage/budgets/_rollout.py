"""The budgets of one rollout: made before the launch, read while it runs, reported in the receipt.

:class:`RolloutBudgets` owns everything per rollout that bounds the sandbox as a
whole (the mechanisms are in :mod:`rollcage.cage`):

* ``memory_bytes`` and ``processes``: the rollout's cgroups (v2 or v1, whichever
  the machine allows), else the per-process rlimits alone;
* ``workspace_*``, ``tmp_*``, ``shm_*``: as root, a tmpfs per place with size and
  inode bounds: the workspace mounted by the supervisor on ``R/workspace`` (copied
  in before the start and back at the end), ``/tmp`` and ``/dev/shm`` in a private
  directory, or, for a warm start, inside the cage (:class:`~rollcage.cage.CageTmpfs`:
  the host's mount table, which every launch copies and reads, then grows by one
  mount per rollout, not three); otherwise bubblewrap's size-bounded tmpfs and a poll.

:meth:`RolloutBudgets.check` names the first budget breached (the supervisor
then ends the rollout as the policy's fault); :meth:`RolloutBudgets.report` is the
receipt's ``budgets``. Everything made is recorded in the staging area, so a
later run can remove what a killed supervisor left (:func:`release_leftovers`).
Every method blocks: run them in a thread.

Whatever a supervisor makes carries its owner (``PID.STARTTIME.PIDNS`` of the supervising
process; a mount its mount namespace too) in its name, so that any later supervisor on the
machine can tell what was left by one that is provably gone (SIGKILLed, its Ray node lost)
and release it (:func:`sweep_orphans`, once per process): a workspace by one owner at a
time, never overwriting the evidence (:mod:`rollcage.budgets._leftovers`).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rollcage.budgets._leftovers import (
    mount_source,
    name_owner_gone,
    owner_tag,
    proved_leftover,
    rollout_lock,
    settle_locked,
    settle_workspace,
    source_owner_gone,
)
from rollcage.budgets._mechanisms import (
    CageTmpfs,
    CgroupSet,
    PolledTree,
    ProcRootTmpfs,
    TmpfsVolume,
    Volume,
    copy_tree,
    detect_cgroups,
    kill_cgroup,
    remove_cgroup,
    unmount,
)
from rollcage.budgets._plan import weak_budgets
from rollcage.budgets._settings import BudgetSettings
from rollcage.errors import SandboxError
from rollcage.protocol import BudgetName, BudgetUse, RolloutUsage
from rollcage.runfiles import RolloutLayout

__all__ = [
    "BUDGETS_RECORD",
    "MEMORY_DIR",
    "Place",
    "RolloutBudgets",
    "Scratch",
    "owner_tag",
    "private_parent",
    "release_leftovers",
    "remove_staged_view",
    "sweep_orphans",
]

logger = logging.getLogger("rollcage.supervisor")


@dataclass(frozen=True)
class Place:
    """One writable place of the sandbox (``/tmp``, ``/dev/shm``) as the budgets chose it.

    Attributes:
        dest: Where the sandbox sees it.
        host: A bounded tmpfs on the host, bound writable at ``dest``; ``None``: a fresh tmpfs that
            bubblewrap makes there, of at most ``size`` bytes.
        size: The bubblewrap tmpfs's size (``None``: the kernel's); unused with ``host``.
    """

    dest: str
    host: Path | None = None
    size: int | None = None


@dataclass(frozen=True)
class Scratch:
    """Where the sandbox's writable places come from (what :meth:`RolloutBudgets.prepare` chose).

    Attributes:
        workspace: Host directory mounted as ``/rollout/workspace``: the rollout's own
            ``workspace/``, or a bounded tmpfs copied back into it at the end.
        tmp: ``/tmp``: a bubblewrap tmpfs of a size, or a bounded host tmpfs.
        shm: ``/dev/shm``, likewise.
        in_cage: Bounded tmpfs that a warm start mounts inside the cage (:mod:`rollcage.warm`)
            over ``tmp`` and ``shm``, which then only hold their places.
    """

    workspace: Path
    tmp: Place
    shm: Place
    in_cage: tuple[CageTmpfs, ...] = ()


_RECORD = "budgets.json"
BUDGETS_RECORD = _RECORD
"""The record, in the staging area, of what a supervisor made (what a later sweep releases by it)."""
_PRIVATE_RECORD = "rollout.json"
MEMORY_DIR = "/dev/shm"
"""Where private directories go when it is a memory file system with room (:func:`private_parent`)."""

_MEMORY_ROOM_BYTES = 1 << 30
_TEMP_VARIABLES = ("TMPDIR", "TEMP", "TMP")
_tmpfs_seen: dict[str, bool] = {}


def private_parent() -> str:
    """The directory supervisors make their private directories in (blocking: a ``statvfs``).

    A private directory stages the worker's view (its input, ``/rollout`` and the mount points
    bubblewrap makes there), the proxy socket and the bounded file systems' mount points: a dozen
    entries made and removed per rollout. On the disk that is the rollout directory's file system's
    work too, and on ext4 without a journal each freed inode makes every later creation in its
    group scan past it for a minute or more. So: :data:`MEMORY_DIR` when it is a tmpfs with at
    least 1 GiB free (a container's 64 MiB ``/dev/shm`` is not) and no temporary directory is asked
    for in the environment (``TMPDIR``, ``TEMP``, ``TMP``: the user's choice wins); otherwise the
    temporary directory. What is staged there is small (JSON, a socket, empty mount points) but for
    a worker's ``result.json``, which the sandbox's memory budget counts as it is written.
    """
    if any(os.environ.get(name) for name in _TEMP_VARIABLES):
        return tempfile.gettempdir()
    memory = MEMORY_DIR
    if memory not in _tmpfs_seen:
        _tmpfs_seen[memory] = _is_tmpfs(memory)
    if _tmpfs_seen[memory]:
        with contextlib.suppress(OSError):
            room = os.statvfs(memory)
            roomy = room.f_bavail * room.f_frsize >= _MEMORY_ROOM_BYTES
            if roomy and os.access(memory, os.W_OK | os.X_OK):
                return memory
    return tempfile.gettempdir()


def _is_tmpfs(path: str) -> bool:
    """``path`` is the mount point of a tmpfs in this process's mount table."""
    try:
        with open("/proc/self/mountinfo", "rb") as file:
            lines = file.read().splitlines()
    except OSError:
        return False
    wanted, found = path.encode(), False
    for line in lines:
        left, _, right = line.partition(b" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 4 and fields[4] == wanted:
            found = tail[:1] == [b"tmpfs"]  # the last mount on a path is the one seen there
    return found


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if value >= 1 << shift and value % (1 << (shift - 3)) == 0:
            return f"{value / (1 << shift):g} {unit}"
    return f"{value} bytes"


class RolloutBudgets:
    """Budgets of one rollout under bubblewrap (see the module docstring).

    Args:
        config: The sandbox's configuration (its budget fields).
        layout: The rollout's host paths.
        private_dir: A directory of the supervisor's own (never visible in the sandbox) for mounts.
        owner: ``(uid, gid)`` the sandbox runs as on the host (root); ``None``: the supervisor's.
        name: A unique name for this rollout's cgroups.
    """

    def __init__(
        self,
        config: BudgetSettings,
        layout: RolloutLayout,
        private_dir: Path,
        *,
        owner: tuple[int, int] | None,
        name: str,
    ) -> None:
        self.config = config
        self.layout = layout
        self.private_dir = private_dir
        self.owner = owner
        self.name = name
        # The mounts' name in the mount table: whose they are, for a sweep after this process is gone.
        self.source = mount_source()
        self.cgroups = CgroupSet()
        self.volumes: list[Volume] = []
        self.workspace_mount: TmpfsVolume | None = None
        self.breach: tuple[BudgetName, str] | None = None
        self.copy_problem: str | None = None
        self.evidence_problem: str | None = None
        """Why the agent's workspace could not be kept on the disk (the infrastructure's failure: a disk
        full); it then stays mounted and recorded, for a later sweep (:func:`sweep_orphans`)."""
        self._sandbox_root: str | None = None
        self._prepared: int | None = None
        self._memory_peak: int | None = None
        self._processes_peak: int | None = None
        self._cpu_ns: int | None = None
        self._last_walk = 0.0
        self._walk_cost = 0.0
        # A poll still running in its thread when the rollout ends must not race the last reading.
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- before the launch

    def prepare(self, *, in_cage: bool = False) -> Scratch:
        """Make the cgroups and the bounded file systems; the sandbox's writable places (blocking).

        Args:
            in_cage: A warm start will mount ``/tmp`` and ``/dev/shm`` inside the cage
                (:attr:`Scratch.in_cage`); only the workspace is mounted on the host.
        """
        # Under the rollout's lock: a killed earlier supervisor's workspace still mounted here is its
        # evidence, put onto the disk first (and no sweeper is settling it while this one mounts).
        with rollout_lock(self.layout.root, wait=True) as root_fd:
            if root_fd is not None and self._can_mount():
                settle_locked(root_fd)
            return self._prepare(in_cage=in_cage)

    def _prepare(self, *, in_cage: bool) -> Scratch:
        config = self.config
        self.layout.staging.mkdir(mode=0o700, exist_ok=True)
        self.layout.workspace.mkdir(exist_ok=True)
        if config.cgroups == "auto" and (config.memory_bytes is not None or config.max_processes is not None):
            self.cgroups = CgroupSet.create(
                self.name,
                memory_bytes=config.memory_bytes,
                max_processes=config.max_processes,
                count_cpu=True,
            )
        scratch = self._mounts(in_cage=in_cage) if self._can_mount() else None
        if scratch is None:
            workspace = PolledTree(
                "workspace",
                self.layout.workspace,
                max_bytes=config.workspace_bytes,
                max_inodes=config.workspace_inodes,
            )
            tmp = ProcRootTmpfs(
                "tmp", "/tmp", self._root, max_bytes=config.tmp_size_bytes, max_inodes=config.tmp_inodes
            )
            shm = ProcRootTmpfs(
                "shm", "/dev/shm", self._root, max_bytes=config.shm_bytes, max_inodes=config.shm_inodes
            )
            self.volumes = [workspace, tmp, shm]
            scratch = Scratch(
                workspace=self.layout.workspace,
                tmp=Place("/tmp", size=config.tmp_size_bytes),
                shm=Place("/dev/shm", size=config.shm_bytes),
            )
        self._record()
        if config.require_budgets:
            # What was planned at the start (_plan) may still fail here: a mount or a cgroup refused.
            made = {use.budget: use.mechanism for use in self.report() if use.limit is not None}
            weak = weak_budgets(made, config)
            if weak:
                raise SandboxError(
                    f"--require-budgets: this rollout's budgets could not all be made hard bounds: "
                    f"{'; '.join(weak)}"
                )
        return scratch

    def _can_mount(self) -> bool:
        return self.config.disk_budgets == "auto" and os.geteuid() == 0

    def _mounts(self, *, in_cage: bool) -> Scratch | None:
        # The workspace as the controller prepared it stays readable under the bounded file system
        # mounted over it, through this descriptor: copied in from there, never set aside first.
        prepared = os.open(self.layout.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            scratch = self._mount_over(prepared, in_cage=in_cage)
        except BaseException:
            os.close(prepared)
            raise
        if scratch is None:
            os.close(prepared)
        else:
            self._prepared = prepared  # the agent's files go back into it at the end (_copy_out)
        return scratch

    def _mount_over(self, prepared: int, *, in_cage: bool) -> Scratch | None:
        config = self.config
        owner = self.owner or (os.getuid(), os.getgid())
        base = self.private_dir / "fs"
        # The workspace is mounted at R/workspace itself, so the host sees the agent's files where they
        # always are; /tmp and /dev/shm under the supervisor's own directory.
        bounded = [("workspace", self.layout.workspace, config.workspace_bytes, config.workspace_inodes)]
        if not in_cage:
            bounded += [
                ("tmp", base / "tmp", config.tmp_size_bytes, config.tmp_inodes),
                ("shm", base / "shm", config.shm_bytes, config.shm_inodes),
            ]
        mounted: list[TmpfsVolume] = []
        try:
            for name, where, max_bytes, max_inodes in bounded:
                volume = TmpfsVolume(
                    name,
                    where,
                    max_bytes=max_bytes,
                    max_inodes=max_inodes,
                    owner=owner,
                    source=self.source,
                )
                mounted.append(volume)
                self.volumes.append(volume)
        except OSError as exc:
            logger.warning("cannot mount bounded file systems for the sandbox (%s); polling instead", exc)
            self._unmount()
            self.volumes = []
            self.workspace_mount = None
            return None
        workspace = self.workspace_mount = mounted[0]
        for volume in mounted[1:]:
            os.chmod(volume.path, 0o1777)
        report = copy_tree(
            prepared,
            workspace.path,
            max_bytes=config.workspace_bytes,
            max_inodes=config.workspace_inodes,
            owner=self.owner,
        )
        if report.skipped:
            logger.warning("workspace files over the budget were not copied in: %s", report.skipped)
        if in_cage:
            in_the_cage = (
                CageTmpfs("tmp", "/tmp", max_bytes=config.tmp_size_bytes, max_inodes=config.tmp_inodes),
                CageTmpfs("shm", "/dev/shm", max_bytes=config.shm_bytes, max_inodes=config.shm_inodes),
            )
            self.volumes += in_the_cage
            # bubblewrap's own tmpfs hold the places until the warm start mounts the bounded ones.
            return Scratch(
                workspace=workspace.path,
                tmp=Place("/tmp", size=config.tmp_size_bytes),
                shm=Place("/dev/shm", size=config.shm_bytes),
                in_cage=in_the_cage,
            )
        tmp, shm = mounted[1:]
        return Scratch(
            workspace=workspace.path,
            tmp=Place("/tmp", host=tmp.path),
            shm=Place("/dev/shm", host=shm.path),
        )

    def hold_cage_scratch(self, roots: list[int]) -> None:
        """Take the roots of the tmpfs a warm start mounted in the cage (owned from now on), in order.

        One that is not the bounded tmpfs asked for (or comes unasked) is closed, and said.
        """
        volumes = [volume for volume in self.volumes if isinstance(volume, CageTmpfs)]
        for volume, fd in itertools.zip_longest(volumes, roots):
            if fd is not None and (volume is None or not volume.hold(fd)):
                if volume is None:
                    os.close(fd)
                logger.warning("rollout %s: a root the warm start sent back is not its tmpfs", self.name)

    def launch_binds(self) -> list[tuple[int, str]] | None:
        """What a launch from a base namespace (:func:`~rollcage.cage.launcher`) must bind there.

        ``(detached copy, host path)`` of each tmpfs mounted on the host; ``None`` when one
        has no copy (the launch then needs the host's own namespace).
        """
        binds = []
        for volume in self.volumes:
            if isinstance(volume, TmpfsVolume):
                if volume.launch_copy is None:
                    return None
                binds.append((volume.launch_copy, str(volume.path)))
        return binds

    def enter_prefix(self) -> list[str]:
        """The argv prefix that puts the sandbox into its cgroups (``[]`` without any)."""
        return self.cgroups.enter_prefix()

    def cgroup_procs(self) -> list[str]:
        """The ``cgroup.procs`` files a process joins to count with the sandbox (``[]`` without cgroups)."""
        return [str(path) for path in self.cgroups.procs_files()]

    def _record(self) -> None:
        record = {
            "cgroups": self.cgroups.paths(),
            "mounts": [str(v.path) for v in self.volumes if isinstance(v, TmpfsVolume)],
            "private_dir": str(self.private_dir),
            "workspace_bounds": [self.config.workspace_bytes, self.config.workspace_inodes],
            "owner": list(self.owner) if self.owner else None,
        }
        record["rollout_dir"] = str(self.layout.root.absolute())
        for path in (self.layout.staging / _RECORD, self.private_dir / _PRIVATE_RECORD):
            with contextlib.suppress(OSError):
                path.write_text(json.dumps(record))

    # ----------------------------------------------------------------- while it runs

    def set_sandbox_root(self, pid: int | None) -> None:
        """The PID whose ``/proc/<pid>/root`` is the sandbox's root (bwrap's init), once known."""
        self._sandbox_root = None if pid is None else f"/proc/{pid}/root"

    def _root(self) -> str | None:
        return self._sandbox_root

    def members(self) -> list[int]:
        """PIDs in the rollout's cgroups (empty without cgroups)."""
        return self.cgroups.members()

    def check(self, *, final: bool = False) -> tuple[BudgetName, str] | None:
        """Read every counter, record peaks, and return the first breach: ``(budget, words)`` (blocking).

        A breach stays recorded (:attr:`breach`); later calls return it again.

        Args:
            final: The sandbox is gone: walk the workspace whatever the last walk cost.
        """
        with self._lock:
            return self._check(final=final)

    def _check(self, *, final: bool) -> tuple[BudgetName, str] | None:
        config = self.config
        current, peak = self.cgroups.memory_usage()
        self._memory_peak = _max(self._memory_peak, peak, current)
        self._cpu_ns = _max(self._cpu_ns, self.cgroups.cpu_ns())
        current, peak = self.cgroups.processes()
        self._processes_peak = _max(self._processes_peak, peak, current)
        if self.breach is not None:
            return self.breach
        kills = self.cgroups.oom_kills()
        if kills and config.memory_bytes is not None:
            self.breach = (
                "memory_bytes",
                f"the sandbox's memory budget of {_size(config.memory_bytes)} was exceeded: the kernel "
                f"killed {kills} of its processes",
            )
            return self.breach
        refused = self.cgroups.forks_refused()
        if refused and config.max_processes is not None:
            self.breach = (
                "processes",
                f"the sandbox's process budget of {config.max_processes} processes and threads was reached: "
                f"{refused} fork(s) refused",
            )
            return self.breach
        for volume in self.volumes:
            if isinstance(volume, PolledTree) and not final and not self._walk_due():
                continue
            started = time.monotonic()
            breached = volume.check()
            if isinstance(volume, PolledTree):
                self._walk_cost = time.monotonic() - started
                self._last_walk = time.monotonic()
            if breached:
                budget: BudgetName = breached[0]  # type: ignore[assignment]
                limit = getattr(config, _FIELDS[budget])
                used = volume.peak_bytes if budget.endswith("bytes") else volume.peak_inodes
                unit = _size(limit) if budget.endswith("bytes") else f"{limit} entries"
                shown = _size(used or 0) if budget.endswith("bytes") else f"{used} entries"
                self.breach = (budget, f"the {budget} budget of {unit} was exhausted ({shown} in use)")
                return self.breach
        return None

    def _walk_due(self) -> bool:
        # A walk of a big workspace costs CPU: at most a tenth of the time goes to it.
        return time.monotonic() - self._last_walk >= max(self.config.budget_poll_s, 10 * self._walk_cost)

    def kill(self) -> None:
        """SIGKILL everything in the rollout's cgroups."""
        self.cgroups.kill()

    # ----------------------------------------------------------------- after the end

    def finish(self) -> None:
        """Final reading, the workspace back into the rollout directory, mounts and cgroups removed."""
        with self._lock:
            self._finish()

    def _finish(self) -> None:
        with contextlib.suppress(OSError):
            self._check(final=True)
        if self.workspace_mount is not None:
            self._copy_out(self.workspace_mount)
        if self._prepared is not None:
            os.close(self._prepared)
            self._prepared = None
        self._unmount()
        for volume in self.volumes:
            volume.close()
        released = self.cgroups.remove()
        # Only empty mount points are removed: never a tree that might still be a mounted file system.
        for volume in self.volumes:
            if isinstance(volume, TmpfsVolume) and not volume.mounted and volume is not self.workspace_mount:
                with contextlib.suppress(OSError):
                    volume.path.rmdir()
        with contextlib.suppress(OSError):
            (self.private_dir / "fs").rmdir()
        if released and not any(isinstance(v, TmpfsVolume) and v.mounted for v in self.volumes):
            # Nothing is left for a later sweep to find by the record: the private directory can go
            # (the supervisor removes it once its proxy socket is gone too).
            with contextlib.suppress(OSError):
                (self.private_dir / _PRIVATE_RECORD).unlink()

    def _copy_out(self, volume: TmpfsVolume) -> None:
        config = self.config
        prepared, self._prepared = self._prepared, None
        try:
            if prepared is None:
                # No descriptor of the prepared workspace (the mount was made, the copy in failed): the
                # mount's files replace it whole, as a sweep would (a complete copy, then renames).
                with rollout_lock(self.layout.root, wait=True) as root_fd:
                    if root_fd is not None:
                        settle_locked(root_fd, ours=True)
                skipped: list[str] = []
            else:
                # Into the prepared workspace under the mount, which stays until the copy is whole (a
                # killed supervisor's sweep copies it again, settle_workspace): what the agent left
                # unchanged stays as it is on the disk, only what it changed is written.
                report = copy_tree(
                    volume.path,
                    prepared,
                    max_bytes=config.workspace_bytes,
                    max_inodes=config.workspace_inodes,
                    owner=self.owner,
                )
                if self.owner is not None:
                    os.fchown(prepared, *self.owner)
                unmount(volume.path)
                skipped = report.skipped
        except OSError as exc:
            # The infrastructure's failure (a disk full, as a rule), never the worker's: the agent's files
            # stay where they are, in the mount, which stays recorded for a later sweep to copy back.
            cause = "the disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "it failed"
            self.evidence_problem = (
                f"the agent's workspace could not be copied back onto the disk ({cause}: {exc}); it stays "
                f"mounted at {self.layout.workspace}, and the first rollcage process started after this one "
                "ends copies it back"
            )
            self.copy_problem = self.evidence_problem
            logger.error("rollout %s: %s", self.layout.root.name, self.evidence_problem)
            return
        finally:
            if prepared is not None:
                os.close(prepared)
        volume.mounted = False
        if skipped:
            self.copy_problem = "not copied back: " + "; ".join(skipped)

    @property
    def workspace_kept_mounted(self) -> bool:
        """The workspace could not be copied back and stays mounted (see :attr:`evidence_problem`)."""
        mount = self.workspace_mount
        return mount is not None and mount.mounted and self.evidence_problem is not None

    def _unmount(self) -> None:
        for volume in self.volumes:
            if isinstance(volume, TmpfsVolume) and not (
                volume is self.workspace_mount and self.evidence_problem is not None
            ):
                volume.unmount()

    def usage(self) -> RolloutUsage:
        """The sandbox's CPU time and peak memory, for the receipt (after :meth:`finish`)."""
        cpu = self.cgroups.cpu
        memory = self.cgroups.memory
        return RolloutUsage(
            cpu_s=None if self._cpu_ns is None else self._cpu_ns / 1e9,
            cpu_mechanism=cpu[0] if cpu is not None and self._cpu_ns is not None else "none",
            peak_memory_bytes=self._memory_peak,
            memory_mechanism=memory[0] if memory is not None and self._memory_peak is not None else "none",
        )

    def report(self) -> list[BudgetUse]:
        """One entry per budget, for the receipt."""
        config = self.config
        memory = self.cgroups.memory[0] if self.cgroups.memory else "rlimit"
        pids = self.cgroups.pids[0] if self.cgroups.pids else "rlimit"
        breached = self.breach[0] if self.breach else None
        uses = [
            BudgetUse(
                budget="memory_bytes",
                limit=config.memory_bytes,
                mechanism=memory if config.memory_bytes is not None else "none",
                peak=self._memory_peak,
                exceeded=breached == "memory_bytes",
            ),
            BudgetUse(
                budget="processes",
                limit=config.max_processes,
                mechanism=pids if config.max_processes is not None else "none",
                peak=self._processes_peak,
                exceeded=breached == "processes",
            ),
        ]
        for volume in self.volumes:
            for kind, mechanism, peak in (
                ("bytes", volume.bytes_mechanism, volume.peak_bytes),
                ("inodes", volume.inodes_mechanism, volume.peak_inodes),
            ):
                budget = f"{volume.name}_{kind}"
                uses.append(
                    BudgetUse(
                        budget=budget,
                        limit=getattr(config, _FIELDS[budget]),
                        mechanism=mechanism,
                        peak=peak,
                        exceeded=breached == budget,
                    )
                )
        return uses


_FIELDS: dict[str, str] = {
    "workspace_bytes": "workspace_bytes",
    "workspace_inodes": "workspace_inodes",
    "tmp_bytes": "tmp_size_bytes",
    "tmp_inodes": "tmp_inodes",
    "shm_bytes": "shm_bytes",
    "shm_inodes": "shm_inodes",
}


def _max(*values: int | None) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def release_leftovers(layout: RolloutLayout) -> None:
    """Release what a killed supervisor left for this rollout: its workspace onto the disk, mounts, cgroups.

    Only what is provably a gone supervisor's is touched (see :mod:`~rollcage.budgets._leftovers`);
    the rollout's workspace is settled under its lock, waiting for another process settling it.
    The record stays while anything it names is left. Blocking; idempotent; never raises.
    """
    try:
        record = json.loads((layout.staging / _RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict):
        # No record (never written, or removed): a settle begun by a killed sweeper may be left.
        with contextlib.suppress(OSError):
            settle_workspace(layout.root, wait=True)
        return
    if _release(record, layout, wait=True):
        with contextlib.suppress(OSError):
            (layout.staging / _RECORD).unlink()


def _release(record: dict[str, object], layout: RolloutLayout, *, wait: bool) -> bool:
    """Release what ``record`` names that is provably a gone supervisor's; whether nothing is left."""
    listed = record.get("mounts")
    mounts = [Path(m) for m in listed if isinstance(m, str)] if isinstance(listed, list) else []
    recorded_root = record.get("rollout_dir")
    workspaces = {layout.workspace.absolute()}
    if isinstance(recorded_root, str):
        workspaces.add(Path(recorded_root) / "workspace")
    done = True
    if any(mount in workspaces for mount in mounts) or not mounts:
        # The agent's files are evidence of the interrupted attempt: onto the disk first, by one owner.
        try:
            done = settle_workspace(layout.root, wait=wait) in ("settled", "nothing")
        except OSError as exc:
            logger.error("cannot keep the workspace a killed supervisor left in %s: %s", layout.root, exc)
            done = False
        if not done:
            return False  # the supervisor lives, or another process settles it: its record is not ours
    for mount in mounts:
        if mount not in workspaces and proved_leftover(mount):
            with contextlib.suppress(OSError):
                unmount(mount)
    cgroups = record.get("cgroups")
    for directory in cgroups if isinstance(cgroups, list) else []:
        if name_owner_gone(Path(str(directory)).name):
            kill_cgroup(Path(str(directory)))
            remove_cgroup(Path(str(directory)))
    private = record.get("private_dir")
    if isinstance(private, str) and private and name_owner_gone(Path(private).name):
        for mount in mounts:
            if mount.is_relative_to(private):
                with contextlib.suppress(OSError):
                    mount.rmdir()
        _remove_private_dir(Path(private))
    return not any(os.path.ismount(mount) for mount in mounts)


def remove_staged_view(layout: RolloutLayout) -> None:
    """Remove the worker's view staged in ``layout.view`` (its input and ``/rollout``), if there is one.

    What the worker wrote there is not evidence (``R`` keeps that); never through a link or a mount.
    """
    if layout.view is None:
        return
    with contextlib.suppress(OSError):
        layout.worker_input.unlink()
    root = layout.worker_root
    if root.is_dir() and not root.is_symlink() and not os.path.ismount(root):
        shutil.rmtree(root, ignore_errors=True)


def _remove_private_dir(private: Path) -> None:
    """A supervisor's private directory, once what it held is released: only what is known, only if empty.

    Its record, a proxy socket and the worker's staged input are unlinked; the worker's ``/rollout``
    (``root``: what an interrupted worker wrote is not evidence, ``R`` keeps that) and
    ``workspace-initial`` (a copy of the prepared workspace an earlier version set aside; the original
    stays on the disk) are removed; the mount points in ``fs``, ``fs`` and the directory itself are
    removed with ``rmdir``: a mount point still in use, or anything else found there, keeps them.
    """
    for name in (_PRIVATE_RECORD, "proxy.sock"):
        with contextlib.suppress(OSError):
            (private / name).unlink()
    remove_staged_view(RolloutLayout(private, view=private))
    initial = private / "workspace-initial"
    if initial.is_dir() and not initial.is_symlink() and not os.path.ismount(initial):
        shutil.rmtree(initial, ignore_errors=True)
    with contextlib.suppress(OSError):
        for point in (private / "fs").iterdir():
            with contextlib.suppress(OSError):
                point.rmdir()
    for directory in (private / "fs", private):
        with contextlib.suppress(OSError):
            directory.rmdir()


_swept = False
_sweep_lock = threading.Lock()


def sweep_orphans() -> None:
    """Release what supervisors that are gone left on this machine: mounts, cgroups (once per process).

    Found by name (see :func:`owner_tag`): the tmpfs mounts named
    ``rollcage-PID.START.PIDNS-mMNTNS`` in this mount namespace and the cgroups beside this
    process's, whose maker is provably gone. A workspace still mounted is copied onto the disk
    in its place first, by whichever sweeper holds its rollout's lock (one that finds it held
    leaves it to the holder). Blocking; never raises.
    """
    global _swept
    with _sweep_lock:
        if _swept:
            return
        _swept = True
    for point in _orphan_mounts():
        path = Path(point)
        with contextlib.suppress(OSError):
            if path.name == "workspace":
                layout = RolloutLayout(path.parent)
                try:
                    record = json.loads((layout.staging / _RECORD).read_text())
                except (OSError, ValueError):
                    record = None
                if not isinstance(record, dict):
                    record = {"mounts": [point], "rollout_dir": str(path.parent)}
                if _release(record, layout, wait=False):
                    with contextlib.suppress(OSError):
                        (layout.staging / _RECORD).unlink()
                continue
            if proved_leftover(path):
                unmount(path)
                logger.warning("released a mount of a supervisor that is gone: %s", point)
        if path.parent.name == "fs" and name_owner_gone(path.parent.parent.name):
            for leftover in (path, path.parent, path.parent.parent / _PRIVATE_RECORD, path.parent.parent):
                with contextlib.suppress(OSError):
                    leftover.unlink() if leftover.name == _PRIVATE_RECORD else leftover.rmdir()
    support = detect_cgroups()
    for found in (support.memory, support.pids, support.cpu):
        if found is None:
            continue
        with contextlib.suppress(OSError):
            for child in found[1].iterdir():
                if child.is_dir() and name_owner_gone(child.name):
                    kill_cgroup(child)
                    remove_cgroup(child)
    # Last: a private directory's mounts and cgroups are released above, by their names.
    for private in _orphan_private_dirs():
        _remove_private_dir(private)


def _orphan_private_dirs() -> list[Path]:
    """This user's private directories (``rollcage-ROLLOUT-PID.START-*``) whose maker is gone.

    Looked for wherever :func:`private_parent` puts them: the memory file system and the
    temporary directory (the choice depends on free room and ``TMPDIR`` at each start).
    """
    owners: dict[str, bool] = {}
    found = []
    # /tmp too: where a temporary directory too long for the proxy socket's path sends them.
    for parent in dict.fromkeys([MEMORY_DIR, tempfile.gettempdir(), "/tmp"]):
        try:
            with os.scandir(parent) as entries:
                for entry in entries:
                    if not entry.name.startswith("rollcage-"):
                        continue
                    owner = entry.name.rpartition("-")[0]  # the random part of the name is not the owner's
                    if owner not in owners:
                        owners[owner] = name_owner_gone(entry.name)
                    with contextlib.suppress(OSError):
                        if (
                            owners[owner]
                            and entry.is_dir(follow_symlinks=False)
                            and entry.stat(follow_symlinks=False).st_uid == os.geteuid()
                        ):
                            found.append(Path(entry.path))
        except OSError:
            continue
    return found


def _orphan_mounts() -> list[str]:
    """Mount points of the tmpfs mounts of this namespace named by a maker that is provably gone."""
    try:
        with open("/proc/thread-self/mountinfo", encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 4 and len(tail) > 1 and tail[0] == "tmpfs" and source_owner_gone(tail[1]):
            found.append(fields[4].replace("\\040", " "))
    return found
