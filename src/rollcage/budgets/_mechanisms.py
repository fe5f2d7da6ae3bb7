"""Budgets of one cage: memory and processes in total, bytes and inodes of each writable file system.

The mechanisms only: a rollout's budgets (planned before the run, made before its launch, read
while it runs, reported in its receipt) are :mod:`._rollout`, :mod:`._plan` and :mod:`._polls` beside it.

Memory and processes (:class:`CgroupSet`)
=========================================

Per-process limits (``RLIMIT_AS``) do not bound a cage: three processes each under
the limit hold three times as much. A cgroup does. :func:`detect_cgroups` finds,
once per process, what this machine allows:

* **cgroup v2** with the ``memory`` and ``pids`` controllers delegated to this
  process's cgroup: one child cgroup per cage (``memory.max``, ``memory.swap.max``
  0, ``memory.oom.group`` 1, ``pids.max``). Without root, the nearest ancestor
  this uid owns whose children get the controllers will do (a delegated subtree:
  systemd's ``user@UID.service``, a ``Delegate=yes`` scope's parent): the cages
  go beside this process's own cgroup, which cannot have children with
  controllers while it holds processes;
* **cgroup v1** ``memory`` and ``pids`` hierarchies writable here (root, or a
  delegated subtree): one child cgroup per cage in each (``memory.limit_in_bytes``
  and ``memory.memsw.limit_in_bytes``, ``pids.max``);
* neither: the per-process limits stay the only bound and the receipt says
  ``rlimit``.

Each resource is decided on its own (memory may be a v1 cgroup where processes
are only an rlimit). The cage enters its cgroups before anything runs in it: its
first process is a shell that writes its own PID into each ``cgroup.procs`` and
then executes bubblewrap, so every descendant is born inside. A breach is read
from the cgroup's own counters: an OOM kill (``oom_kill``) for memory, a refused
fork (``pids.events`` ``max``) for processes.

File systems (:class:`TmpfsVolume`, :class:`CageTmpfs`, :class:`PolledTree`, :class:`ProcRootTmpfs`)
=================================================================================================

A per-file limit (``RLIMIT_FSIZE``) does not bound a directory. As root the
supervisor mounts a tmpfs of its own for each writable place (``size=`` and
``nr_inodes=``): a hard bound, measured with one ``statvfs``; the workspace is
copied in before the start and out (bounded, never following a link) after the
end, so it stays on the host as evidence. A warm start (:mod:`rollcage.warm`)
mounts ``/tmp`` and ``/dev/shm`` with the same bounds inside the cage instead
(:class:`CageTmpfs`): every mount in the host's table is copied and read again by
every later launch's bubblewrap, so a host mount per place costs every other
rollout's start. Without root, bubblewrap's ``--size``
bounds the bytes of ``/tmp`` and ``/dev/shm`` and a bounded walk of the workspace
(and ``statvfs`` through ``/proc/<pid>/root`` for the inodes of ``/tmp``) finds a
breach after the fact, a poll interval late; ``RLIMIT_FSIZE`` bounds each file
meanwhile. The receipt names the mechanism of every budget.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import secrets
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollcage.procs import PidHandle, read_proc
from rollcage.protocol import BudgetMechanism

__all__ = [
    "CageTmpfs",
    "CgroupSet",
    "CgroupSupport",
    "CopyReport",
    "PolledTree",
    "ProcRootTmpfs",
    "TmpfsVolume",
    "Volume",
    "attach_mounts",
    "clone_mounts",
    "copy_tree",
    "detect_cgroups",
    "kill_cgroup",
    "mount_tmpfs",
    "mount_tmpfs_with_copy",
    "remove_cgroup",
    "unique_name",
    "unmount",
]

logger = logging.getLogger("rollcage.cage")


_MS_NOSUID = 2
_MS_NODEV = 4
_MNT_DETACH = 2


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_tmpfs(
    target: Path, *, size: int, inodes: int, uid: int, gid: int, mode: int = 0o700, source: str = "tmpfs"
) -> None:
    """Mount a tmpfs of at most ``size`` bytes and ``inodes`` inodes at ``target`` (root only).

    ``source`` names the mount in the mount table (its maker can be told from it).

    Raises:
        OSError: The mount was refused (not root, no ``CAP_SYS_ADMIN``).
    """
    options = f"size={size},nr_inodes={inodes},mode={mode:o},uid={uid},gid={gid}".encode()
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(source.encode(), os.fsencode(target), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot mount a tmpfs at {target}: {os.strerror(err)}")


_SYS_OPEN_TREE = 428  # the same numbers on every architecture (added after the tables were unified)
_SYS_MOVE_MOUNT = 429
_SYS_FSOPEN = 430
_SYS_FSCONFIG = 431
_SYS_FSMOUNT = 432
_OPEN_TREE_CLONE = 1
_AT_EMPTY_PATH = 0x1000
_AT_RECURSIVE = 0x8000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4
_FSCONFIG_SET_STRING = 1
_FSCONFIG_CMD_CREATE = 6
_MOUNT_ATTR_NOSUID = 0x2
_MOUNT_ATTR_NODEV = 0x4


def _syscall(number: int, *args: object, what: str) -> int:
    result = int(_libc().syscall(number, *args))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount_tmpfs_with_copy(
    target: Path, *, size: int, inodes: int, uid: int, gid: int, mode: int = 0o700, source: str = "tmpfs"
) -> int:
    """:func:`mount_tmpfs`, and a detached copy of the new mount for launches (Linux 5.2+: ``fsmount``).

    The copy is made before the mount is attached, so it belongs to no mount namespace:
    a launch binds it in a namespace of its own (:mod:`rollcage.cage._launch`) where
    the host's copy would be refused. The caller owns the descriptor.

    Raises:
        OSError: The mount, or the way of making it, was refused (then nothing is mounted).
    """
    options = {"source": source, "size": size, "nr_inodes": inodes, "mode": f"{mode:o}"}
    options |= {"uid": uid, "gid": gid}
    context = _syscall(_SYS_FSOPEN, b"tmpfs", 1, what="fsopen(tmpfs)")  # 1: FSOPEN_CLOEXEC
    try:
        for key, value in options.items():
            _syscall(
                _SYS_FSCONFIG, context, _FSCONFIG_SET_STRING, key.encode(), str(value).encode(), 0, what=key
            )
        _syscall(_SYS_FSCONFIG, context, _FSCONFIG_CMD_CREATE, None, None, 0, what="a tmpfs")
        mount = _syscall(
            _SYS_FSMOUNT, context, 1, _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, what="fsmount"
        )  # 1: FSMOUNT_CLOEXEC
    finally:
        os.close(context)
    try:
        copy = clone_mounts(mount)
        try:
            attach_mounts(mount, os.fspath(target))
        except OSError:
            os.close(copy)
            raise
    finally:
        os.close(mount)
    return copy


def clone_mounts(tree: str | int) -> int:
    """A detached copy of the mount tree at a path, or of a mount's descriptor, flags and all.

    (``open_tree``; Linux 5.2+.)

    Raises:
        OSError: The copy was refused.
    """
    at, path, empty = (-100, os.fsencode(tree), 0) if isinstance(tree, str) else (tree, b"", _AT_EMPTY_PATH)
    flags = _OPEN_TREE_CLONE | os.O_CLOEXEC | _AT_RECURSIVE | empty
    return _syscall(_SYS_OPEN_TREE, at, path, flags, what=f"cannot copy the mounts at {tree}")


def attach_mounts(tree: int, path: str) -> None:
    """Attach a detached mount tree (from :func:`clone_mounts`) at ``path``, made first if missing.

    Raises:
        OSError: The directory or the attachment was refused.
    """
    os.makedirs(path, mode=0o755, exist_ok=True)
    where = os.fsencode(path)
    what = f"cannot mount the copied mounts at {path}"
    _syscall(_SYS_MOVE_MOUNT, tree, b"", -100, where, _MOVE_MOUNT_F_EMPTY_PATH, what=what)


def unmount(target: Path) -> bool:
    """Detach the mount at ``target`` (lazily: it goes once nothing uses it); ``False`` if none was there."""
    libc = _libc()
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    if libc.umount2(os.fsencode(target), _MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(err, f"cannot unmount {target}: {os.strerror(err)}")
    return True


# --------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class CgroupSupport:
    """Where this process may make a cgroup per cage, per resource (``None``: not possible here)."""

    memory: tuple[Literal["cgroup2", "cgroup1"], Path] | None
    pids: tuple[Literal["cgroup2", "cgroup1"], Path] | None
    cpu: tuple[Literal["cgroup2", "cgroup1"], Path] | None = None
    """Where a cage's CPU time can be counted (v2 ``cpu.stat``, v1 ``cpuacct``): measured, never limited."""


def _mountinfo() -> Iterator[tuple[str, str, str, list[str]]]:
    """(root, mount point, fstype, super options) of every mount this process sees."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError:
        return
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = fields[3].replace("\\040", " "), fields[4].replace("\\040", " ")
        yield root, point, tail[0], tail[2].split(",")


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and ``""`` for the v2 hierarchy."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as file:
            for line in file.read().splitlines():
                _, controllers, path = line.split(":", 2)
                if controllers == "":
                    paths[""] = path
                for controller in controllers.split(","):
                    if controller:
                        paths[controller] = path
    except (OSError, ValueError):
        pass
    return paths


def _join(point: str, root: str, path: str) -> Path:
    # The mount may show a sub-tree of the hierarchy (a container's cgroup namespace).
    relative = path[len(root) :] if root != "/" and path.startswith(root) else path
    return Path(point) / relative.lstrip("/")


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


@functools.cache
def detect_cgroups() -> CgroupSupport:
    """What this machine lets this process do with cgroups (once per process; blocking)."""
    own = _own_cgroups()
    v2: Path | None = None
    top: Path | None = None
    v1: dict[str, Path] = {}
    for root, point, fstype, options in _mountinfo():
        if fstype == "cgroup2" and "" in own and v2 is None:
            v2, top = _join(point, root, own[""]), Path(point)
        elif fstype == "cgroup":
            for controller in ("memory", "pids", "cpuacct"):
                if controller in options and controller in own and controller not in v1:
                    v1[controller] = _join(point, root, own[controller])
    found: dict[str, tuple[Literal["cgroup2", "cgroup1"], Path]] = {}
    for parent in _v2_candidates(v2, top, euid=os.geteuid()):
        controllers = _v2_controllers(parent)
        if controllers:
            for controller in controllers:
                found[controller] = ("cgroup2", parent)
            # Every v2 cgroup counts its CPU time (cpu.stat), with or without the cpu controller.
            found["cpuacct"] = ("cgroup2", parent)
            break
    else:
        if v2 is not None and _writable_dir(v2):
            found["cpuacct"] = ("cgroup2", v2)
    for controller, path in v1.items():
        if controller not in found and _writable_dir(path):
            found[controller] = ("cgroup1", path)
    support = CgroupSupport(memory=found.get("memory"), pids=found.get("pids"), cpu=found.get("cpuacct"))
    logger.debug("cgroups for the sandbox: memory %s, pids %s", support.memory, support.pids)
    return support


def _v2_candidates(own: Path | None, top: Path | None, *, euid: int) -> Iterator[Path]:
    """Where a cage's v2 cgroups may go: this process's cgroup, then, without root, its delegated ancestors.

    A cgroup with processes in it cannot give its children controllers (v2's "no internal
    processes" rule), so a process in a delegated leaf (``systemd-run --user --scope -p
    Delegate=yes``, a session of ``user@UID.service``) makes its cages beside itself, in the
    nearest ancestor it owns. Only up through cgroups this uid owns (the delegation: systemd
    hands the subtree's directories and ``cgroup.procs`` to the user), and never for root,
    whose every ancestor is writable but not its to use.
    """
    if own is None or top is None:
        return
    here = own
    while True:
        yield here
        if euid == 0 or here == top or not here.is_relative_to(top):
            return
        here = here.parent
        try:
            owned = here.stat().st_uid == euid and (here / "cgroup.procs").stat().st_uid == euid
        except OSError:
            return
        if not owned:
            return


def _v2_controllers(parent: Path) -> list[str]:
    """The controllers (``memory``, ``pids``) that a child of ``parent`` made by this process gets."""
    if not _writable_dir(parent) or not os.access(parent / "cgroup.procs", os.W_OK):
        return []
    try:
        available = set((parent / "cgroup.controllers").read_text().split())
        delegated = set((parent / "cgroup.subtree_control").read_text().split())
    except OSError:
        return []
    return [
        controller
        for controller in ("memory", "pids")
        if controller in delegated or (controller in available and _enable(parent, controller))
    ]


def _enable(v2: Path, controller: str) -> bool:
    # Refused (EBUSY) when the cgroup holds processes itself and is not the root: then not ours to use.
    try:
        (v2 / "cgroup.subtree_control").write_text(f"+{controller}")
    except OSError:
        return False
    return True


def _read(directory: Path, name: str) -> bytes | None:
    """A cgroup file, whole: one open and one read (a page at most), no text layer.

    Read several times per rollout per budget poll: pathlib's ``read_text`` cost about
    40 us a file, this about a quarter of that.
    """
    try:
        fd = os.open(f"{directory}/{name}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_int(directory: Path, name: str) -> int | None:
    data = _read(directory, name)
    text = b"" if data is None else data.strip()
    return int(text) if text.isdigit() else None


def _read_key(directory: Path, name: str, key: str) -> int | None:
    data = _read(directory, name)
    for line in [] if data is None else data.splitlines():
        found, _, value = line.partition(b" ")
        if found == key.encode() and value.strip().isdigit():
            return int(value)
    return None


@dataclass
class CgroupSet:
    """The cgroups one cage runs in: total memory and process limits, their counters, the way in.

    Attributes:
        memory: ``(mechanism, directory)`` of the memory cgroup; ``None``: rlimits only.
        pids: ``(mechanism, directory)`` of the pids cgroup; ``None``: rlimits only.
    """

    memory: tuple[Literal["cgroup2", "cgroup1"], Path] | None = None
    pids: tuple[Literal["cgroup2", "cgroup1"], Path] | None = None
    cpu: tuple[Literal["cgroup2", "cgroup1"], Path] | None = None
    _dirs: list[Path] = field(default_factory=list)

    @classmethod
    def create(
        cls,
        name: str,
        *,
        memory_bytes: int | None,
        max_processes: int | None,
        support: CgroupSupport | None = None,
        count_cpu: bool = False,
    ) -> CgroupSet:
        """Make the cgroups for one cage (blocking); a resource that cannot have one falls back to rlimits.

        Args:
            name: A unique name (a directory in each hierarchy).
            memory_bytes: Total memory of the cage; ``None``: no memory cgroup.
            max_processes: Total processes and threads; ``None``: no pids cgroup.
            support: What the machine allows (default :func:`detect_cgroups`).
            count_cpu: Also count the cage's CPU time (:meth:`cpu_ns`) where the machine allows.
        """
        support = support if support is not None else detect_cgroups()
        made = cls()
        if memory_bytes is not None and support.memory is not None:
            kind, parent = support.memory
            directory = made._make(parent / name)
            if directory is not None and made._limit_memory(kind, directory, memory_bytes):
                made.memory = (kind, directory)
        if max_processes is not None and support.pids is not None:
            kind, parent = support.pids
            same = made.memory is not None and made.memory[1] == parent / name
            directory = parent / name if same else made._make(parent / name)
            if directory is not None and _write(directory / "pids.max", str(max_processes)):
                made.pids = (kind, directory)
        if count_cpu and support.cpu is not None:
            # Counted only (the rollout's CPU time for metrics.json), in whichever of the cage's
            # cgroups is in the same hierarchy, else one of its own.
            kind, parent = support.cpu
            target = parent / name
            if target in made._dirs or made._make(target) is not None:
                made.cpu = (kind, target)
        return made

    def _make(self, path: Path) -> Path | None:
        try:
            path.mkdir()
        except FileExistsError:
            pass
        except OSError as exc:
            logger.warning("cannot create cgroup %s (%s); falling back to rlimits", path, exc)
            return None
        self._dirs.append(path)
        return path

    @staticmethod
    def _limit_memory(kind: str, directory: Path, limit: int) -> bool:
        if kind == "cgroup2":
            ok = _write(directory / "memory.max", str(limit))
            # No swap: a cage over its budget is killed, not slowed to a crawl.
            _write(directory / "memory.swap.max", "0", quiet=True)
            # The whole cage dies together, as the rollout does.
            _write(directory / "memory.oom.group", "1", quiet=True)
            return ok
        ok = _write(directory / "memory.limit_in_bytes", str(limit))
        _write(directory / "memory.memsw.limit_in_bytes", str(limit), quiet=True)
        return ok

    @property
    def active(self) -> bool:
        """Whether any cgroup is in use."""
        return self.memory is not None or self.pids is not None or self.cpu is not None

    def procs_files(self) -> list[Path]:
        """The ``cgroup.procs`` files the cage's first process must write itself into."""
        dirs = {group[1] for group in (self.memory, self.pids, self.cpu) if group is not None}
        return [directory / "cgroup.procs" for directory in sorted(dirs)]

    def cpu_ns(self) -> int | None:
        """CPU time (user + system) of everything that ran in the cage, in ns; ``None`` where unknown."""
        if self.cpu is None:
            return None
        kind, directory = self.cpu
        if kind == "cgroup2":
            usec = _read_key(directory, "cpu.stat", "usage_usec")
            return None if usec is None else usec * 1000
        return _read_int(directory, "cpuacct.usage")

    def enter_prefix(self) -> list[str]:
        """An argv prefix that moves the process into the cgroups, then executes the rest (``[]`` if none)."""
        files = self.procs_files()
        if not files:
            return []
        script = (
            'for f in "$@"; do [ "$f" = -- ] && break; echo $$ > "$f" || exit 125; shift; done; '
            'shift; exec "$@"'
        )
        return ["/bin/sh", "-c", script, "rollcage-cgroup", *map(str, files), "--"]

    def memory_usage(self) -> tuple[int | None, int | None]:
        """(current, peak) bytes of the memory cgroup; ``None`` where unknown."""
        if self.memory is None:
            return None, None
        kind, directory = self.memory
        if kind == "cgroup2":
            return _read_int(directory, "memory.current"), _read_int(directory, "memory.peak")
        current = _read_int(directory, "memory.usage_in_bytes")
        return current, _read_int(directory, "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        """Processes the kernel killed because the cage was over its memory budget."""
        if self.memory is None:
            return 0
        kind, directory = self.memory
        name = "memory.events" if kind == "cgroup2" else "memory.oom_control"
        return _read_key(directory, name, "oom_kill") or 0

    def processes(self) -> tuple[int | None, int | None]:
        """(current, peak) processes and threads of the pids cgroup; ``None`` where unknown."""
        if self.pids is None:
            return None, None
        _, directory = self.pids
        return _read_int(directory, "pids.current"), _read_int(directory, "pids.peak")

    def forks_refused(self) -> int:
        """Forks and clones refused because the cage was at its process budget."""
        if self.pids is None:
            return 0
        return _read_key(self.pids[1], "pids.events", "max") or 0

    def members(self) -> list[int]:
        """PIDs in the cage's cgroups now (in this process's PID namespace)."""
        pids: set[int] = set()
        for procs in self.procs_files():
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(line) for line in procs.read_text().split())
        return sorted(pids)

    def kill(self) -> None:
        """SIGKILL everything in the cage's cgroups (v2: ``cgroup.kill``, atomic against fork)."""
        for procs in self.procs_files():
            kill_cgroup(procs.parent)

    def remove(self, *, wait_s: float = 2.0) -> bool:
        """Remove the cgroups (after everything in them is gone); ``False`` if one is still busy."""
        end = time.monotonic() + wait_s
        removed = [remove_cgroup(d, wait_s=max(end - time.monotonic(), 0.0)) for d in reversed(self._dirs)]
        self._dirs.clear()
        return all(removed)

    def paths(self) -> list[str]:
        """The cgroup directories made (to be found and removed after a crash)."""
        return [str(directory) for directory in self._dirs]


def remove_cgroup(directory: Path, *, wait_s: float = 2.0) -> bool:
    """Remove an empty cgroup, waiting up to ``wait_s`` for its last processes to go (blocking)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= end:
                logger.warning("cannot remove cgroup %s: %s", directory, exc)
                return False
            time.sleep(0.01)


def kill_cgroup(directory: Path) -> None:
    """SIGKILL every process in the cgroup ``directory`` (v2 ``cgroup.kill``: atomic; blocking)."""
    if (directory / "cgroup.kill").exists() and _write(directory / "cgroup.kill", "1", quiet=True):
        return
    try:
        pids = [int(line) for line in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return
    for pid in pids:
        info = read_proc(pid)
        # Through a pidfd checked against the cgroup after opening: a reused PID is never hit.
        handle = None if info is None else PidHandle.open_checked(info, lambda p: _in_cgroup(p, directory))
        if handle is not None:
            try:
                handle.send(signal.SIGKILL)
            except OSError:
                pass  # not ours to signal after all: nothing more to do here
            finally:
                handle.close()


def _in_cgroup(pid: int, directory: Path) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as file:
            return f"{directory.name}\n" in file.read()
    except OSError:
        return False


def _write(path: Path, value: str, *, quiet: bool = False) -> bool:
    try:
        with open(path, "w", encoding="ascii") as file:
            file.write(value)
    except OSError as exc:
        if not quiet:
            logger.warning("cannot write %s to %s: %s", value, path, exc)
        return False
    return True


# --------------------------------------------------------------------------- file systems


class Volume:
    """A writable place of the cage with a bytes and an inodes budget."""

    def __init__(self, name: str, *, max_bytes: int, max_inodes: int) -> None:
        self.name = name
        self.max_bytes = max_bytes
        self.max_inodes = max_inodes
        self.peak_bytes: int | None = None
        self.peak_inodes: int | None = None

    bytes_mechanism: BudgetMechanism = "none"
    inodes_mechanism: BudgetMechanism = "none"

    def usage(self) -> tuple[int, int] | None:
        """(bytes, inodes) in use now; ``None`` when it cannot be measured now."""
        raise NotImplementedError

    def full(self, used_bytes: int, used_inodes: int) -> tuple[bool, bool]:
        """Whether the bytes and the inodes budget are exhausted at this usage."""
        return used_bytes > self.max_bytes, used_inodes > self.max_inodes

    def close(self) -> None:
        """Let go of what the volume holds (idempotent)."""

    def check(self) -> list[str]:
        """Measure (recording the peak) and name the budgets breached: ``workspace_bytes`` etc. (blocking)."""
        used = self.usage()
        if used is None:
            return []
        used_bytes, used_inodes = used
        self.peak_bytes = max(self.peak_bytes or 0, used_bytes)
        self.peak_inodes = max(self.peak_inodes or 0, used_inodes)
        over_bytes, over_inodes = self.full(used_bytes, used_inodes)
        return [
            f"{self.name}_{kind}" for kind, over in (("bytes", over_bytes), ("inodes", over_inodes)) if over
        ]


def _statvfs_usage(path: str | int) -> tuple[int, int, int, int] | None:
    """(bytes used, bytes free, inodes used, inodes free) of the file system at ``path`` (or an fd)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return (
        (st.f_blocks - st.f_bfree) * st.f_frsize,
        st.f_bfree * st.f_frsize,
        st.f_files - st.f_ffree,
        st.f_ffree,
    )


def _reached(found: tuple[int, int, int, int] | None) -> tuple[bool, bool]:
    """Whether a tmpfs with hard bounds is full in bytes and in inodes (``statvfs`` numbers)."""
    if found is None:
        return False, False
    _, free_bytes, _, free_inodes = found
    # A hard limit is never exceeded, only reached: a write past it failed with ENOSPC.
    return free_bytes < 4096, free_inodes == 0


def _pages(size: int) -> int:
    return -(-size // 4096) * 4096


def _used(found: tuple[int, int, int, int] | None) -> tuple[int, int] | None:
    """(bytes, inodes) in use on a tmpfs from its ``statvfs`` numbers; its root directory is not counted."""
    if found is None:
        return None
    used_bytes, _, used_inodes, _ = found
    return used_bytes, max(used_inodes - 1, 0)


class TmpfsVolume(Volume):
    """A tmpfs the supervisor mounted (root): a hard bound on bytes and inodes, read by ``statvfs``."""

    bytes_mechanism: BudgetMechanism = "tmpfs"
    inodes_mechanism: BudgetMechanism = "tmpfs"

    def __init__(
        self,
        name: str,
        path: Path,
        *,
        max_bytes: int,
        max_inodes: int,
        owner: tuple[int, int],
        source: str = "tmpfs",
    ) -> None:
        super().__init__(name, max_bytes=max_bytes, max_inodes=max_inodes)
        self.path = path
        self.launch_copy: int | None = None
        """A detached copy of the mount, for a launch to bind (:mod:`rollcage.cage._launch`); ``None``:
        the kernel could not make one, and launches need the host's namespace."""
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # One inode more than the budget: the root directory takes one.
        size, inodes, (uid, gid) = max_bytes, max_inodes + 1, owner
        try:
            self.launch_copy = mount_tmpfs_with_copy(
                path, size=size, inodes=inodes, uid=uid, gid=gid, source=source
            )
        except OSError as exc:
            logger.debug("no detached copy of the tmpfs at %s (%s): mounted the plain way", path, exc)
            mount_tmpfs(path, size=size, inodes=inodes, uid=uid, gid=gid, source=source)
        self.mounted = True

    def usage(self) -> tuple[int, int] | None:
        return _used(_statvfs_usage(str(self.path)))

    def full(self, used_bytes: int, used_inodes: int) -> tuple[bool, bool]:
        return _reached(_statvfs_usage(str(self.path)))

    def unmount(self) -> None:
        """Detach the tmpfs (idempotent)."""
        if self.mounted:
            with contextlib.suppress(OSError):
                unmount(self.path)
            self.mounted = False

    def close(self) -> None:
        """Let go of the launch copy (the mount on the host stays until :meth:`unmount`)."""
        if self.launch_copy is not None:
            os.close(self.launch_copy)
            self.launch_copy = None


class ProcRootTmpfs(Volume):
    """A tmpfs bubblewrap made inside the cage (``--size``), measured through ``/proc/<pid>/root``.

    The bytes are a hard bound (``tmpfs``); bubblewrap cannot bound the inodes, so
    they are polled. The file system is held by a descriptor from the first poll
    that finds it (recognised by its size), so the last reading, after the cage is
    gone, still sees it.
    """

    bytes_mechanism: BudgetMechanism = "tmpfs"
    inodes_mechanism: BudgetMechanism = "poll"

    def __init__(
        self, name: str, inside: str, root_of: Callable[[], str | None], *, max_bytes: int, max_inodes: int
    ) -> None:
        super().__init__(name, max_bytes=max_bytes, max_inodes=max_inodes)
        self._inside = inside.lstrip("/")
        self._root_of = root_of
        self._free_bytes = max_bytes
        self._fd: int | None = None

    def _held(self) -> int | None:
        if self._fd is not None:
            return self._fd
        root = self._root_of()
        if root is None:
            return None
        try:
            fd = os.open(os.path.join(root, self._inside), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        # Until bubblewrap has mounted it, the path shows something else: only the bounded tmpfs is kept.
        found = _statvfs_usage(fd)
        if found is None or found[0] + found[1] != _pages(self.max_bytes):
            os.close(fd)
            return None
        self._fd = fd
        return fd

    def usage(self) -> tuple[int, int] | None:
        fd = self._held()
        found = None if fd is None else _statvfs_usage(fd)
        if found is not None:
            self._free_bytes = found[1]
        return _used(found)

    def full(self, used_bytes: int, used_inodes: int) -> tuple[bool, bool]:
        return self._free_bytes < 4096, used_inodes > self.max_inodes

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class CageTmpfs(Volume):
    """A tmpfs with hard bounds that a warm start mounted inside the cage (see :mod:`rollcage.warm`).

    The host's mount table never holds it, so it costs the other cages' launches
    nothing, and it goes with its cage whoever dies. It is measured through the
    descriptor of its root that the start sends back (:meth:`hold`), so the last
    reading, after the cage is gone, still sees it.
    """

    bytes_mechanism: BudgetMechanism = "tmpfs"
    inodes_mechanism: BudgetMechanism = "tmpfs"

    def __init__(self, name: str, inside: str, *, max_bytes: int, max_inodes: int) -> None:
        super().__init__(name, max_bytes=max_bytes, max_inodes=max_inodes)
        self.inside = inside
        """Where the cage has it (``/tmp``)."""
        self._fd: int | None = None
        self._closed = False

    @property
    def mount_inodes(self) -> int:
        """Its ``nr_inodes``: one more than the budget, for its root directory."""
        return self.max_inodes + 1

    def hold(self, fd: int) -> bool:
        """Take ``fd`` (the root of the mounted tmpfs; owned from now on); ``False`` if it is not that.

        Only a tmpfs of exactly this size and inode count is kept, so a descriptor of
        anything else is closed and measures nothing.
        """
        found = _statvfs_usage(fd)
        if (
            self._closed
            or self._fd is not None
            or found is None
            or found[0] + found[1] != _pages(self.max_bytes)
            or found[2] + found[3] != self.mount_inodes
        ):
            os.close(fd)
            return False
        self._fd = fd
        return True

    def usage(self) -> tuple[int, int] | None:
        fd = self._fd
        return _used(None if fd is None else _statvfs_usage(fd))

    def full(self, used_bytes: int, used_inodes: int) -> tuple[bool, bool]:
        fd = self._fd
        return _reached(None if fd is None else _statvfs_usage(fd))

    def close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class PolledTree(Volume):
    """A host directory measured by a bounded walk (the workspace without root): late by one poll."""

    bytes_mechanism: BudgetMechanism = "poll"
    inodes_mechanism: BudgetMechanism = "poll"

    def __init__(self, name: str, path: Path, *, max_bytes: int, max_inodes: int) -> None:
        super().__init__(name, max_bytes=max_bytes, max_inodes=max_inodes)
        self.path = path

    def usage(self) -> tuple[int, int] | None:
        # Disk use (blocks), not apparent size: a sparse file costs what it occupies. The walk stops
        # once both budgets are over, so its cost is bounded by the inode budget.
        used_bytes = 0
        used_inodes = 0
        stack = [str(self.path)]
        while stack:
            directory = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                used_inodes += 1
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                used_bytes += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    stack.append(entry.path)
            if used_bytes > self.max_bytes and used_inodes > self.max_inodes:
                break
        return used_bytes, used_inodes


# --------------------------------------------------------------------------- copying a tree


@dataclass
class CopyReport:
    """What :func:`copy_tree` copied and what it left out."""

    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)

    def skip(self, path: str, why: str) -> None:
        if len(self.skipped) < 20:
            self.skipped.append(f"{path}: {why}")


def copy_tree(
    source: Path | int,
    dest: Path | int,
    *,
    max_bytes: int,
    max_inodes: int,
    owner: tuple[int, int] | None = None,
) -> CopyReport:
    """Make the directory ``dest`` hold a copy of the tree ``source``, never following a link (blocking).

    Regular files, directories and symbolic links (as links) are copied; anything
    else is skipped. Hard links stay hard links (a thousand names of one file cost
    one file). Modes keep their permission bits only (no setuid, setgid or sticky
    bit). The copy stops at ``max_bytes`` of apparent size (a sparse file counts
    in full) and ``max_inodes`` entries; what was left out is named in the report.
    The source is read through directory descriptors, so a link planted in it
    never leads outside.

    ``dest`` is normally empty. What it holds already is made to match the source, as
    if it had been: an entry the source lacks (or leaves out) is removed, one of another
    kind replaced, a link with another target made again, a regular file with other
    bytes rewritten in place (a new file where its inode has other names: never written
    through), and a file with the same bytes or a link with the same target kept as it
    is. Copying a tree back over the one it was copied from writes only what changed.

    Args:
        source: A directory whose content may be hostile, or an open descriptor of one (the
            caller's, left open): a directory something is mounted over stays readable so.
        dest: A directory of the caller's, or an open descriptor of one (left open).
        max_bytes: Bound on the bytes the copy holds.
        max_inodes: Bound on the entries it holds.
        owner: ``(uid, gid)`` to give every entry; ``None``: the caller's.
    """
    report = CopyReport()
    links: dict[tuple[int, int], str] = {}
    inodes = 0
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY
    stack: list[tuple[int, int, str]] = []
    top = os.dup(dest) if isinstance(dest, int) else os.open(dest, flags)
    try:
        first = os.dup(source) if isinstance(source, int) else os.open(source, flags)
        try:
            into = os.dup(top)
        except BaseException:
            os.close(first)
            raise
        stack.append((first, into, ""))
        while stack:
            src_dir, dst_dir, prefix = stack.pop()
            try:
                with os.scandir(src_dir) as scan:
                    names = sorted(entry.name for entry in scan)
                with os.scandir(dst_dir) as scan:
                    present = {entry.name for entry in scan}
                for name in present.difference(names):
                    _remove_entry(dst_dir, name, os.stat(name, dir_fd=dst_dir, follow_symlinks=False))
                for name in names:
                    rel = f"{prefix}{name}"
                    have = os.stat(name, dir_fd=dst_dir, follow_symlinks=False) if name in present else None
                    if inodes >= max_inodes:
                        report.skip(rel, f"over the bound of {max_inodes} entries")
                        _remove_entry(dst_dir, name, have)
                        continue
                    try:
                        info = os.stat(name, dir_fd=src_dir, follow_symlinks=False)
                    except OSError as exc:
                        report.skip(rel, str(exc))
                        _remove_entry(dst_dir, name, have)
                        continue
                    mode = stat.S_IMODE(info.st_mode) & 0o777
                    if stat.S_ISDIR(info.st_mode):
                        if have is not None and not stat.S_ISDIR(have.st_mode):
                            _remove_entry(dst_dir, name, have)
                            have = None
                        if have is None:
                            os.mkdir(name, 0o700, dir_fd=dst_dir)
                        inodes += 1
                        below = os.open(name, flags, dir_fd=src_dir)
                        try:
                            into = os.open(name, flags, dir_fd=dst_dir)
                        except BaseException:
                            os.close(below)
                            raise
                        stack.append((below, into, f"{rel}/"))
                        os.fchmod(into, mode | 0o700)
                    elif stat.S_ISLNK(info.st_mode):
                        target = os.readlink(name, dir_fd=src_dir)
                        if have is not None and not (
                            stat.S_ISLNK(have.st_mode) and os.readlink(name, dir_fd=dst_dir) == target
                        ):
                            _remove_entry(dst_dir, name, have)
                            have = None
                        if have is None:
                            os.symlink(target, name, dir_fd=dst_dir)
                        inodes += 1
                    elif stat.S_ISREG(info.st_mode):
                        key = (info.st_dev, info.st_ino)
                        if key in links:
                            _remove_entry(dst_dir, name, have)
                            os.link(links[key], name, dst_dir_fd=dst_dir, follow_symlinks=False)
                            continue
                        if report.bytes + info.st_size > max_bytes:
                            report.skip(rel, f"{info.st_size} bytes would pass the bound of {max_bytes}")
                            _remove_entry(dst_dir, name, have)
                            continue
                        report.bytes += _copy_file(src_dir, dst_dir, name, have, mode, info.st_size)
                        report.files += 1
                        inodes += 1
                        if info.st_nlink > 1:
                            # Named through the top descriptor: the destination may be under a mount.
                            links[key] = f"/proc/self/fd/{top}/{rel}"
                    else:
                        report.skip(rel, "not a regular file, directory or link")
                        _remove_entry(dst_dir, name, have)
                        continue
                    if owner is not None:
                        os.chown(name, *owner, dir_fd=dst_dir, follow_symlinks=False)
            finally:
                os.close(src_dir)
                os.close(dst_dir)
    finally:
        for src_dir, dst_dir, _ in stack:
            os.close(src_dir)
            os.close(dst_dir)
        os.close(top)
    return report


def _remove_entry(directory: int, name: str, info: os.stat_result | None) -> None:
    """Remove ``name`` (whose ``lstat`` is ``info``; ``None``: there is none) in ``directory``.

    A directory goes with its content, never through a link.
    """
    if info is None:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(name, dir_fd=directory)
    else:
        os.unlink(name, dir_fd=directory)


def _copy_file(
    src_dir: int, dst_dir: int, name: str, have: os.stat_result | None, mode: int, size: int
) -> int:
    """Copy the regular file ``name`` (at most ``size`` bytes); the bytes the copy holds.

    A regular file already there with the same bytes is kept; with others it is rewritten in place
    unless its inode has other names (then it is replaced, so that nothing is written through).
    """
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=src_dir)
    try:
        alone = have if have is not None and stat.S_ISREG(have.st_mode) and have.st_nlink == 1 else None
        dst = -1
        if alone is not None:
            with contextlib.suppress(PermissionError):  # a read-only file, without root: replaced
                dst = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dst_dir)
        if alone is not None and dst >= 0:
            try:
                if alone.st_size == size and _same_bytes(src, dst, size):
                    if stat.S_IMODE(alone.st_mode) != mode:
                        os.fchmod(dst, mode)
                    return size
                os.lseek(src, 0, os.SEEK_SET)
                os.ftruncate(dst, 0)
                os.lseek(dst, 0, os.SEEK_SET)
                return _write_copy(src, dst, mode, size)
            finally:
                os.close(dst)
        _remove_entry(dst_dir, name, have)
        create = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dst = os.open(name, create, 0o600, dir_fd=dst_dir)
        try:
            return _write_copy(src, dst, mode, size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _write_copy(src: int, dst: int, mode: int, size: int) -> int:
    copied = 0
    # At most the size seen: a file that grows meanwhile (a survivor) cannot pass the bound.
    while copied < size and (chunk := os.read(src, min(1 << 20, size - copied))):
        view = memoryview(chunk)
        while view:
            # A short write (a disk that just filled up) is followed by the error, never by a gap.
            view = view[os.write(dst, view) :]
        copied += len(chunk)
    os.fchmod(dst, mode)
    return copied


def _same_bytes(first: int, second: int, size: int) -> bool:
    """The two files' first ``size`` bytes are equal, and ``second`` holds no more."""
    seen = 0
    while seen < size:
        want = min(1 << 20, size - seen)
        chunk = os.read(first, want)
        if not chunk or chunk != os.read(second, len(chunk)):
            return False
        seen += len(chunk)
    return not os.read(second, 1)


def unique_name(prefix: str) -> str:
    """A name for per-cage objects (cgroups): ``prefix`` and 12 random hex digits."""
    return f"{prefix}-{secrets.token_hex(6)}"
