"""What a killed supervisor left: whose it is, whether its maker is provably gone, one owner to release it.

Every rollcage process sweeps, at its start, what supervisors that are gone left on the
machine (:func:`rollcage.budgets.sweep_orphans`), and a controller resuming a
run releases what its interrupted rollouts left (``kill_leftovers``). Several of them may
start at once, and some in a private mount namespace (``unshare -m``) or a PID namespace
of their own. Three rules keep the agent's files, the evidence, whole:

* **Provably gone.** A name (``PID.START.PIDNS``, :func:`owner_tag`) says which process
  made it, and in which PID namespace; a mount's name (:func:`mount_source`) says in which
  mount namespace too. A maker is gone only when the sweeper shares that PID namespace
  (a PID of another means nothing here, and one that is not visible proves nothing) and
  no process of that PID and start time runs. A mount is swept only from the mount
  namespace where its maker mounted it: elsewhere the sweeper sees a copy, which must
  never be copied back (its maker may have copied the truth back and gone, and the
  rollout directory moved on).
* **One owner per leftover.** Whoever settles a rollout's workspace holds an exclusive
  ``flock`` on the rollout directory ``R`` (:func:`rollout_lock`), and proves under it
  that the mount at ``R/workspace`` is the gone maker's (:func:`proved_leftover`: by
  the device of the mount it opened, not by a path read earlier). A sweeper that finds
  the lock held leaves the leftover to its holder; a supervisor about to mount there
  waits for it. Everything is done through the directory's descriptor, so a rollout
  directory moved meanwhile (set aside by a resuming controller) is followed.
* **Evidence is never overwritten.** The mount is copied into a fresh directory in the
  staging area; only a complete copy is renamed ``workspace-settled``; only then is the
  mount detached and the on-disk workspace replaced, by renames alone
  (:func:`settle_workspace`). A sweeper killed at any step leaves the mount (still the
  evidence) or a complete copy, and the next one carries on from there; one that finds
  the work done does nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollcage.budgets._mechanisms import copy_tree, unmount
from rollcage.procs import read_proc

__all__ = [
    "LOCK_WAIT_S",
    "Settled",
    "mount_source",
    "name_owner_gone",
    "owner_tag",
    "proved_leftover",
    "rollout_lock",
    "settle_locked",
    "settle_workspace",
    "source_owner_gone",
]

logger = logging.getLogger("rollcage.supervisor")

LOCK_WAIT_S = 600.0
"""How long a supervisor or a resuming controller waits for another process settling the same rollout."""

_NAMED = re.compile(r"^rollcage-(?:.+-)?(\d+)\.(\d+)(?:\.(\d+))?-[^/]+$")
"""A private directory or cgroup: ``rollcage-[ROLLOUT-]PID.START[.PIDNS]-RANDOM``."""
_MOUNTED = re.compile(r"^rollcage-(\d+)\.(\d+)(?:\.(\d+))?(?:-m(\d+))?$")
"""A tmpfs's source in the mount table: ``rollcage-PID.START[.PIDNS][-mMNTNS]``."""
_STAGING = ".sandbox"
_SETTLED = "workspace-settled"
"""A complete copy of a gone supervisor's workspace mount, waiting to replace the on-disk workspace."""
_REPLACED = "workspace-replaced"
"""The on-disk workspace a settled copy replaced, waiting to be removed."""
_PARTIAL = "workspace-partial-"


def _namespace(kind: Literal["mnt", "pid"]) -> int | None:
    """The inode of this thread's ``kind`` namespace (``None``: not readable here)."""
    try:
        return os.stat(f"/proc/thread-self/ns/{kind}").st_ino
    except OSError:
        return None


def owner_tag() -> str:
    """``PID.START.PIDNS`` of this process: with it, a later process can tell whether its maker still lives.

    ``START`` is the process's start time (a PID is reused, the pair is not); ``PIDNS`` the
    inode of its PID namespace, without which its PID proves nothing to a process elsewhere.
    """
    info = read_proc(os.getpid())
    start = info.starttime if info is not None else 0
    pidns = _namespace("pid")
    return f"{os.getpid()}.{start}" + (f".{pidns}" if pidns is not None else "")


def mount_source() -> str:
    """The source this process gives the tmpfs it mounts: its :func:`owner_tag` and its mount namespace."""
    mntns = _namespace("mnt")
    return f"rollcage-{owner_tag()}" + (f"-m{mntns}" if mntns is not None else "")


@functools.cache
def _proc_is_ours() -> bool:
    """``/proc`` shows this process's PID namespace (not so after ``unshare -p`` without a new ``/proc``)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _gone(pid: int, start: int, pidns: int | None) -> bool:
    if pidns is not None and pidns != _namespace("pid"):
        return False  # another PID namespace's process: not visible from here, so never proved gone
    if pid == os.getpid() or not _proc_is_ours():
        return False
    info = read_proc(pid)
    return info is None or info.starttime != start


def name_owner_gone(name: str) -> bool:
    """A private directory's or cgroup's maker, named in ``name``, is provably gone."""
    match = _NAMED.search(name)
    if match is None:
        return False
    pidns = match.group(3)
    return _gone(int(match.group(1)), int(match.group(2)), int(pidns) if pidns else None)


def source_owner_gone(source: str) -> bool:
    """A mount of this source is a gone maker's, in this mount namespace: this process may release it.

    A mount named in another mount namespace is a copy here (made by ``unshare``, or
    propagated); its maker's own namespace is where it is released, never here.
    """
    match = _MOUNTED.match(source)
    if match is None:
        return False
    mntns = match.group(4)
    if mntns is not None and int(mntns) != _namespace("mnt"):
        return False
    pidns = match.group(3)
    return _gone(int(match.group(1)), int(match.group(2)), int(pidns) if pidns else None)


def _source_of(device: int) -> str | None:
    """The source of the tmpfs with this device number in this thread's mount table, if any."""
    try:
        with open("/proc/thread-self/mountinfo", encoding="utf-8", errors="surrogateescape") as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    wanted = f"{os.major(device)}:{os.minor(device)}"
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) > 2 and fields[2] == wanted and len(tail) > 1 and tail[0] == "tmpfs":
            return tail[1]
    return None


def proved_leftover(path: str | os.PathLike[str]) -> bool:
    """The mount seen at ``path`` is a tmpfs of a maker provably gone, mounted in this namespace.

    Proved by the device of what ``path`` opens (the top mount there, at this moment), never
    by a mount table read earlier. Blocking; never raises.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        device = os.fstat(fd).st_dev
        parent = os.stat(os.path.join(os.fspath(path), os.pardir)).st_dev
    except OSError:
        return False
    finally:
        os.close(fd)
    if device == parent:
        return False  # not a mount point
    source = _source_of(device)
    return source is not None and source_owner_gone(source)


@contextlib.contextmanager
def rollout_lock(root: Path, *, wait: bool, wait_s: float = LOCK_WAIT_S) -> Iterator[int | None]:
    """Hold the exclusive lock on rollout directory ``root``: yield its descriptor, or ``None``.

    ``None`` when the directory is not there, or another process holds the lock and
    ``wait`` is false (that process owns what is left there). Released on exit, and
    by the kernel if this process dies.

    Raises:
        OSError: ``wait`` is true and the lock was held for ``wait_s`` seconds.

    **Cancellation:** a blocking wait of at most ``wait_s`` seconds; run it in a thread.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        yield fd if _acquire(fd, root, wait=wait, wait_s=wait_s) else None
    finally:
        os.close(fd)


def _acquire(fd: int, root: Path, *, wait: bool, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if not wait:
                return False
            if time.monotonic() >= deadline:
                raise OSError(
                    f"another process has been settling what a killed supervisor left in {root} "
                    f"for over {wait_s:g} s"
                ) from None
            # A settle copies a workspace (seconds as a rule); the kernel offers no timed flock.
            time.sleep(0.05)


Settled = Literal["settled", "nothing", "busy", "not_ours"]
"""What :func:`settle_workspace` found: it settled a leftover; nothing was left; another process holds
the rollout (and settles it); the mount there is not provably a gone maker's (left alone)."""


@dataclass
class _Paths:
    """``R``'s places, through its locked descriptor (a directory moved meanwhile is followed)."""

    root: str

    @property
    def workspace(self) -> str:
        return f"{self.root}/workspace"

    @property
    def staging(self) -> str:
        return f"{self.root}/{_STAGING}"

    @property
    def settled(self) -> str:
        return f"{self.staging}/{_SETTLED}"

    @property
    def replaced(self) -> str:
        return f"{self.staging}/{_REPLACED}"


def settle_workspace(root: Path, *, wait: bool) -> Settled:
    """Put a gone supervisor's workspace mount at ``root/workspace`` onto the disk, in its place.

    Takes the rollout's lock (:func:`rollout_lock`; with ``wait`` false, a held lock
    answers ``busy``) and calls :func:`settle_locked`. Blocking.

    Raises:
        OSError: The copy or a rename failed (a disk full); the mount, the evidence, stays.
    """
    with rollout_lock(root, wait=wait) as fd:
        if fd is None:
            return "busy" if root.is_dir() else "nothing"
        return settle_locked(fd)


def settle_locked(root_fd: int, *, ours: bool = False) -> Settled:
    """:func:`settle_workspace` for a caller that holds the rollout's lock (``root_fd``, its descriptor).

    ``ours``: the mount is the caller's own (a supervisor that cannot copy in place), no proof needed.

    The steps, each one safe to be killed after:

    1. the mount at ``workspace`` is proved a gone maker's (else ``not_ours``: nothing is touched);
    2. it is copied into a fresh ``workspace-partial-*`` in the staging area, within the
       mount's own bounds (its size and inodes) and with its owner;
    3. the complete copy is renamed ``workspace-settled``; then the mount is detached;
    4. the on-disk workspace is renamed ``workspace-replaced``, the copy renamed
       ``workspace``, and the replaced one removed.

    A later call finishes what a killed one began: with the mount still there it copies
    again (the mount is the evidence; a copy is only ever a copy of it), without it it
    carries on from step 4.

    Raises:
        OSError: The copy or a rename failed; what is left is a state the next call carries on from.
    """
    paths = _Paths(f"/proc/self/fd/{root_fd}")
    result: Settled = "nothing"
    if os.path.ismount(paths.workspace):
        if not ours and not proved_leftover(paths.workspace):
            return "not_ours"
        made_staging = not os.path.isdir(paths.staging)
        os.makedirs(paths.staging, mode=0o700, exist_ok=True)
        _remove_copies(paths)
        _copy_mount(paths)
        unmount(Path(paths.workspace))
        # Older mounts under it (stacked by a version that mounted over a leftover): superseded.
        while not ours and os.path.ismount(paths.workspace) and proved_leftover(paths.workspace):
            unmount(Path(paths.workspace))
        if not ours:
            logger.warning("kept the workspace of a supervisor that is gone: %s", _real(root_fd))
        result = "settled"
    else:
        made_staging = False
    if os.path.isdir(paths.settled) and not os.path.islink(paths.settled):
        if os.path.lexists(paths.workspace) and not os.path.lexists(paths.replaced):
            os.rename(paths.workspace, paths.replaced)
        if not os.path.lexists(paths.workspace):
            os.rename(paths.settled, paths.workspace)
            result = "settled"
    if os.path.lexists(paths.replaced) and not os.path.lexists(paths.settled):
        _remove_tree(paths.replaced)
    if made_staging:
        with contextlib.suppress(OSError):
            os.rmdir(paths.staging)
    return result


def _copy_mount(paths: _Paths) -> None:
    """Steps 2 and 3: a complete copy of the mount, named ``workspace-settled`` only once complete."""
    mount = os.open(paths.workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info, room = os.fstat(mount), os.fstatvfs(mount)
        # Whatever the bounds were, the mount cannot hold more than its size and inodes.
        max_bytes = max(room.f_blocks * room.f_frsize, 1)
        max_inodes = max(room.f_files, 1)
        owner = (info.st_uid, info.st_gid) if os.geteuid() == 0 else None
        partial = tempfile.mkdtemp(prefix=_PARTIAL, dir=paths.staging)
        try:
            report = copy_tree(mount, Path(partial), max_bytes=max_bytes, max_inodes=max_inodes, owner=owner)
            if owner is not None:
                os.chown(partial, *owner)
            os.chmod(partial, info.st_mode & 0o7777)
            os.rename(partial, paths.settled)
        except BaseException:
            _remove_tree(partial)
            raise
    finally:
        os.close(mount)
    if report.skipped:
        logger.warning("a gone supervisor's workspace was not all copied back: %s", report.skipped)


def _remove_copies(paths: _Paths) -> None:
    """What killed settlers of this mount left: copies (the mount still holds the evidence)."""
    with os.scandir(paths.staging) as entries:
        names = [entry.name for entry in entries if entry.name.startswith(_PARTIAL)]
    for name in [*names, _SETTLED]:
        _remove_tree(f"{paths.staging}/{name}")


def _remove_tree(path: str) -> None:
    """Remove a directory of this module's (never through a link, never a mount point)."""
    if os.path.isdir(path) and not os.path.islink(path) and not os.path.ismount(path):
        shutil.rmtree(path, ignore_errors=True)


def _real(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") + "/workspace"
    except OSError:
        return "a rollout directory"
