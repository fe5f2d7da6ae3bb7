"""A fresh root from an image and a rollout's changes, and one bounded command run in it.

After a rollout in an image root, its rollout directory keeps ``changes/``: the upper directory of
its overlay (overlayfs's format: a whiteout is a 0:0 character device, an opaque directory carries
``trusted.overlay.opaque``). Grading and ``workspace.diff`` never use the agent's own root: they
rebuild one here.

``fresh_root(image_root, changes, scratch)`` (root only):

1. mounts a size-bounded tmpfs at ``scratch``;
2. copies ``changes/`` into it (a *snapshot*: a process the agent left behind, were there one,
   could change ``changes/`` further, never the root made from the copy). Regular files,
   directories, symbolic links, FIFOs, whiteouts and the opaque mark are kept; everything is
   given to ``uid`` (the uid the grading cage runs as), with setuid/setgid bits dropped;
   sockets and devices other than whiteouts are left out;
3. mounts an overlay: lowers = the snapshot over the image, upper = the tmpfs (a scratch that
   goes with it), ``nosuid,nodev``. The image is seen through an idmapped mount (Linux 5.12+,
   overlayfs on idmapped layers 5.19+) in which what the image's user owns (root, for most images)
   belongs to ``uid`` (default :data:`FRESH_UID`; the tests grader leases one per grade,
   :func:`lease_uid`), the uid the command runs as: it may change the image's files as that user
   in a container would (a SWE-bench evaluation applies its test patch inside the repository),
   and the store is never written either way. Where that mount is refused the image keeps its
   owners (logged once).

:func:`run_in_root` runs one shell command with that tree as ``/``: it is
:func:`rollcage.cage.run_contained` with ``root`` (the two-stage launch as root: an outer bwrap
with the host's programs only, ``setpriv`` to :data:`FRESH_UID`, ``prlimit``, and an inner bwrap
with new user, PID, IPC, UTS and network namespaces whose root is the fresh tree), bounded in
wall-clock time, CPU, memory, processes, file size and kept output, with the same handshake that
tells a cage that could not be made (:class:`~rollcage.errors.SandboxError`) from a command that
failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollcage.budgets import mount_tmpfs, unmount
from rollcage.cage import ContainedRun, RunLimits, run_contained
from rollcage.cage.idmap import IdMap, idmapped_bind, mapping_namespace
from rollcage.errors import SandboxError

logger = logging.getLogger("rollcage.controller")

__all__ = [
    "CAGE_UIDS",
    "FRESH_UID",
    "ChangesError",
    "FreshRoot",
    "fresh_root",
    "lease_uid",
    "run_in_root",
    "snapshot_changes",
]

FRESH_UID: Final = 65533
"""The host uid (and gid) a fresh root's command runs as, and that owns the snapshot of the changes,
unless the caller gives one (the tests grader gives each grade its own, :func:`lease_uid`).

Not 65534 ("nobody", the uid of ``run_contained``'s cages and, as root, of sandboxes): a process
budget kept as ``RLIMIT_NPROC`` counts every process of its uid, so a fork bomb under another
uid must not keep a grading cage from starting."""

_MS_NOSUID: Final = 0x2
_MS_NODEV: Final = 0x4
_MS_RDONLY: Final = 0x1
_MNT_DETACH: Final = 0x2
_OPAQUE: Final = (b"trusted.overlay.opaque", b"user.overlay.opaque")
_MAX_ENTRIES: Final = 1_000_000


class ChangesError(SandboxError):
    """A rollout's ``changes/`` cannot be used (missing, not a directory, too large for the scratch)."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str, flags: int, options: str) -> None:
    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    if libc.mount(source.encode(), os.fsencode(target), fstype.encode(), flags, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"mounting {fstype} at {target}: {os.strerror(err)}")


def _umount(target: Path) -> None:
    libc = _libc()
    if libc.umount2(os.fsencode(target), 0) != 0 and ctypes.get_errno() == errno.EBUSY:
        libc.umount2(os.fsencode(target), _MNT_DETACH)


def snapshot_changes(changes: Path, dest: Path, *, owner: tuple[int, int] = (FRESH_UID, FRESH_UID)) -> int:
    """Copy an overlay upper directory ``changes`` to the new directory ``dest`` (see the module docstring).

    Nothing in ``changes`` is followed: every entry is opened relative to its directory without
    following symbolic links. Returns the number of entries copied.

    Raises:
        ChangesError: ``changes`` is missing or no directory, or has over a million entries.
        OSError: Copying failed (``ENOSPC``: the scratch is too small).
    """
    try:
        top = os.open(changes, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ChangesError(f"the rollout's changes {changes} cannot be read: {exc.strerror or exc}") from exc
    dest.mkdir(mode=0o755)
    os.chown(dest, *owner)
    count = 0
    stack: list[tuple[int, Path]] = [(top, dest)]
    try:
        _copy_opaque(top, dest)
        while stack:
            fd, target = stack.pop()
            try:
                names = sorted(os.listdir(fd))
                for name in names:
                    count += 1
                    if count > _MAX_ENTRIES:
                        raise ChangesError(
                            f"the rollout's changes {changes} hold over {_MAX_ENTRIES} entries"
                        )
                    child = _copy_entry(fd, name, target / name, owner)
                    if child is not None:
                        stack.append(child)
            finally:
                os.close(fd)
    except BaseException:
        for fd, _ in stack:
            os.close(fd)
        raise
    return count


def _copy_entry(parent: int, name: str, target: Path, owner: tuple[int, int]) -> tuple[int, Path] | None:
    """Copy one entry; a directory is made and returned (opened) for the caller to walk."""
    info = os.lstat(name, dir_fd=parent)
    mode = stat.S_IMODE(info.st_mode) & 0o1777  # no setuid/setgid, whatever the agent set
    if stat.S_ISDIR(info.st_mode):
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            target.mkdir(mode=0o700)
            os.chmod(target, mode | 0o700 if mode else 0o755)
            os.chown(target, *owner)
            _copy_opaque(fd, target)
        except BaseException:
            os.close(fd)
            raise
        return fd, target
    if stat.S_ISREG(info.st_mode):
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        try:
            dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                while chunk := os.read(src, 1 << 20):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dst, view) :]
                os.fchmod(dst, mode)
                os.fchown(dst, *owner)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    elif stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(name, dir_fd=parent), target)
        os.lchown(target, *owner)
    elif stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
        os.mknod(target, stat.S_IFCHR | 0o000, 0)  # a whiteout: the image's entry is deleted
    elif stat.S_ISFIFO(info.st_mode):
        os.mkfifo(target, mode)
        os.chown(target, *owner)
    return None


def _copy_opaque(fd: int, target: Path) -> None:
    for key in _OPAQUE:
        try:
            value = os.getxattr(fd, key)
        except OSError:
            continue
        if value == b"y":
            os.setxattr(target, b"trusted.overlay.opaque", b"y")
            return


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


def _shift_map(owner: int, uid: int) -> IdMap:
    """``owner`` -> ``uid``, every other id below ``uid`` to itself.

    An id-mapped mount with it shows what ``owner`` owns (uid and gid alike) as owned by the cage's
    uid and leaves other owners as they are.
    """
    lines = [(owner, uid, 1)]
    if owner > 0:
        lines.append((0, 0, owner))
    if owner + 1 < uid:
        lines.append((owner + 1, owner + 1, uid - owner - 1))
    return tuple(lines)


CAGE_UIDS: Final = range(0x70000000, 0x70000000 + 0x10000)
"""Host uids (and gids) a grading cage in a fresh root may have one of for itself (:func:`lease_uid`).

Above every id an image maps to itself (:data:`FRESH_UID` and below), in a range systemd leaves
unused (``0x70000000``...), owned by no account."""
_LEASES: Final = Path("/run/rollcage/cage-uids")


@contextlib.contextmanager
def lease_uid(directory: Path = _LEASES) -> Iterator[int]:
    """A uid of :data:`CAGE_UIDS` that no other holder (of any process) has while the block runs.

    Why: a process budget kept as ``RLIMIT_NPROC`` counts every process of its uid, and a cage over a
    root of its own sets it before its user namespace exists (the image has no ``prlimit``), so two
    cages under one uid share one budget: a fork bomb in one would keep the other from starting.
    With a uid each, no cage can hurt another. The lease is an flock'ed file: a holder killed by
    SIGKILL releases it.

    Raises:
        SandboxError: Every uid of the range is held.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    start = secrets.randbelow(len(CAGE_UIDS))
    for step in range(len(CAGE_UIDS)):
        uid = CAGE_UIDS[(start + step) % len(CAGE_UIDS)]
        path = directory / f"{uid}.lease"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not _locked_in_place(fd, path):
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            # Removed while still locked: whoever opened it meanwhile finds it gone (_locked_in_place),
            # so the directory holds only the leases held now.
            path.unlink(missing_ok=True)
            os.close(fd)
        return
    raise SandboxError(f"every grading uid ({len(CAGE_UIDS)}, from {CAGE_UIDS[0]}) is in use")


def _locked_in_place(fd: int, path: Path) -> bool:
    """Whether ``fd`` is now locked by us and still the file at ``path`` (not one its holder removed)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class FreshRoot:
    """A mounted fresh root."""

    path: Path
    """The merged tree: the image, the rollout's changes over it, writable into a scratch."""
    changes: int
    """Entries copied from ``changes/``."""


@contextlib.contextmanager
def fresh_root(
    image_root: Path,
    changes: Path,
    scratch: Path,
    *,
    size_bytes: int,
    inodes: int = 1 << 20,
    writable: bool = True,
    shift_owner: bool = True,
    owner: int = 0,
    uid: int = FRESH_UID,
) -> Iterator[FreshRoot]:
    """Mount a fresh root of ``image_root`` plus ``changes`` under the new directory ``scratch`` (root only).

    Everything is unmounted and ``scratch`` removed when the block ends, whatever happened.
    ``size_bytes`` bounds the snapshot and whatever is written into the root together.
    ``writable=False`` mounts the overlay read-only. ``shift_owner``: the image is seen through an
    idmapped mount in which what ``owner`` owns (the uid of the image's ``User``; root when it names
    none) is owned by ``uid`` (the cage's; it owns the snapshot too), so the command may write
    those files as the image's user in a container would; where the kernel or the store's file
    system refuses an idmapped mount, the image keeps its owners (logged once).

    Raises:
        ChangesError: ``changes`` cannot be used, or does not fit in ``size_bytes``.
        SandboxError: A mount was refused (not root, no overlayfs).

    **Cancellation:** blocking; run it in a thread.
    """
    if not image_root.is_dir():
        raise SandboxError(f"the image root {image_root} is gone (was the image removed from the store?)")
    for path in (image_root, scratch):
        if any(c in str(path) for c in ",:\\\n"):
            raise SandboxError(f"{path!r} holds one of , : \\ which overlay mount options cannot carry")
    scratch.mkdir(mode=0o700)
    mounted: list[Path] = []
    try:
        try:
            # Not named rollcage-...: the launcher leaves those out of the cages it starts, and
            # run_contained (git on a fresh root) must see this one.
            mount_tmpfs(
                scratch, size=size_bytes, inodes=inodes, uid=0, gid=0, mode=0o755, source="fresh-root"
            )
        except OSError as exc:
            raise SandboxError(
                f"a fresh root needs root (a tmpfs and an overlay are mounted): {exc}"
            ) from exc
        mounted.append(scratch)
        try:
            count = snapshot_changes(changes, scratch / "changes", owner=(uid, uid))
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ChangesError(
                    f"the rollout's changes {changes} do not fit in the grading scratch ({size_bytes} bytes)"
                ) from exc
            raise ChangesError(f"the rollout's changes {changes} cannot be copied: {exc}") from exc
        upper, work, merged = scratch / "upper", scratch / "work", scratch / "root"
        for directory in (upper, work, merged):
            directory.mkdir(mode=0o755)
        lower = image_root
        if shift_owner:
            lower = scratch / "image"
            lower.mkdir(mode=0o755)
            try:
                shift = _shift_map(owner, uid)
                idmapped_bind(image_root, lower, mapping_namespace(shift, shift))
            except SandboxError as exc:
                _warn_once(f"image roots are used with their own owners (no idmapped mount: {exc})")
                lower = image_root
            else:
                mounted.append(lower)
        options = f"lowerdir={scratch / 'changes'}:{lower}"
        if writable:
            options += f",upperdir={upper},workdir={work}"
        _mount(
            "overlay", merged, "overlay", _MS_NOSUID | _MS_NODEV | (0 if writable else _MS_RDONLY), options
        )
        mounted.append(merged)
        yield FreshRoot(merged, count)
    finally:
        for path in reversed(mounted):
            with contextlib.suppress(OSError):
                unmount(path) if path == scratch else _umount(path)
        with contextlib.suppress(OSError):
            scratch.rmdir()


async def run_in_root(
    root: Path,
    command: str,
    *,
    cwd: str,
    env: Mapping[str, str],
    timeout_s: float,
    limits: RunLimits | None = None,
    uid: int = FRESH_UID,
) -> ContainedRun:
    """Run ``/bin/sh -c command`` with ``root`` as ``/`` in a fresh cage, as host uid ``uid``.

    :func:`rollcage.cage.run_contained` over ``root`` (see the module docstring): one contained-run
    path for graders in images and plain graders alike.

    Args:
        root: A mounted tree (:func:`fresh_root`); the command may write it.
        command: The shell command.
        cwd: Its working directory, in the root.
        env: Its entire environment.
        timeout_s: Wall-clock bound; past it the whole cage is killed (``timed_out``).
        limits: CPU, memory, processes, file size, open files and kept output (``scratch_bytes`` unused).
        uid: The host uid (and gid) it runs as: the one :func:`fresh_root` gave the root (its
            ``uid``). Its process budget is its own where a pids cgroup is made; else it is that
            uid's ``RLIMIT_NPROC``: give each concurrent cage a uid of its own (:func:`lease_uid`).

    Raises:
        SandboxError: Not root, bubblewrap is missing, or the cage could not be made (the image has no
            ``/bin/sh``, for one).

    **Cancellation:** the whole cage is killed and reaped, and its cgroup removed, before the
    cancellation propagates.
    """
    return await run_contained(
        ["/bin/sh", "-c", command],
        root=root,
        cwd=cwd,
        env=env,
        timeout_s=timeout_s,
        limits=limits,
        host_uid=uid,
    )
