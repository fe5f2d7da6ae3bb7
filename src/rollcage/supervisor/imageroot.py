"""A rollout's copy-on-write image root, mounted by the supervisor (root) and kept as evidence.

Layout, in the rollout directory ``R``::

    R/changes/          the overlay's upper once the rollout ended: every file it wrote, whiteouts
                        (0:0 character devices) for deletions, trusted.overlay.opaque on opaque dirs
    R/.image/fs/        a tmpfs bounded like the workspace (workspace_bytes, workspace_inodes),
                        holding upper/ and work/ while the rollout runs; upper/ is copied to
                        changes/ at the end
    R/.image/lower/     where the id-mapped image is attached while the overlay is mounted
    R/.image/skel/      a lower layer above the image holding only mount points (see below)
    R/.image/root/      the merged root, bound into the worker's sandbox at IMAGE_ROOT
    R/image.json        the image the rollout ran in (written at the end)

Ownership. The store keeps the image's owners (mostly uid 0). The sandbox runs as an unprivileged
host uid (``run_as_uid``), which must own the files of the image's ``User`` for agent code to
change them, as a container's user does. So the overlay's lower is an *id-mapped* mount of the
image root (``rollcage.cage.idmap``: ``mount_setattr(MOUNT_ATTR_IDMAP)``, Linux 5.12+; overlayfs
accepts one as a layer since 5.19): the image user's files appear owned by the sandbox's host uid;
everyone else's by nobody.
The store itself is never written: the mapping is a property of the mount, and every write
lands in ``changes/`` (copy-up is done by overlayfs with the mounter's credentials).

The mount points the agent's cage binds over the image (``/proc``, ``/dev``, ``/tmp`` and the rollout's
workspace, ``/rollout/workspace``, bound there as for a rollout without an image) come from a small
layer above the image, so that bubblewrap finds them made and never writes them into ``changes/``.

The upper is bounded: a rollout writes into the image's root what it writes into its workspace, at
most as much (ENOSPC past it), on a file system of its own that costs O(bytes written).

Mounting needs root (bubblewrap 0.8 has no ``--overlay``); a supervisor that is not root refuses
an image rollout with one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollcage.cage.idmap import idmapped_bind, mapping_namespace
from rollcage.durable import publish_bytes
from rollcage.errors import SandboxError
from rollcage.protocol import ImageSandbox

__all__ = ["MOUNT_POINTS", "ImageRoot", "mount_image_root", "release_image_root"]

MOUNT_POINTS: Final = ("proc", "dev", "tmp", "rollout/workspace")
"""Where the agent's cage mounts over the image (:func:`rollcage.cage.image_prefix`), relative to ``/``."""

_MS_NOSUID: Final = 0x2
_MS_NODEV: Final = 0x4
_MNT_DETACH: Final = 0x2
_BAD: Final = (",", ":", "\\", "\n")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _fail(what: str) -> SandboxError:
    code = ctypes.get_errno()
    return SandboxError(f"{what}: {os.strerror(code)}")


def _plain(path: Path, what: str) -> str:
    text = str(path)
    if any(c in text for c in _BAD):
        raise SandboxError(f"{what} {text!r} holds one of , : \\ which overlay mount options cannot carry")
    return text


def _unmount(path: Path) -> None:
    if _libc.umount2(os.fsencode(path), 0) != 0:
        code = ctypes.get_errno()
        if code == errno.EBUSY:
            _libc.umount2(os.fsencode(path), _MNT_DETACH)
        elif code not in (errno.EINVAL, errno.ENOENT):
            raise SandboxError(f"unmounting {path}: {os.strerror(code)}")


@dataclass(slots=True)
class ImageRoot:
    """A rollout's mounted image root; :meth:`finish` unmounts it and leaves the evidence."""

    image: ImageSandbox
    rollout_dir: Path

    @property
    def merged(self) -> Path:
        """Where the merged root is mounted on the host."""
        return self.rollout_dir / ".image" / "root"

    @property
    def changes(self) -> Path:
        """The overlay's upper directory: the rollout's writes."""
        return self.rollout_dir / "changes"

    def finish(self) -> None:
        """Unmount, keep the writes in ``changes/``, write ``image.json``, remove the scratch (idempotent)."""
        release_image_root(self.rollout_dir)
        record = {
            "ref": self.image.ref,
            "digest": self.image.manifest_digest or self.image.digest,
            "image_id": self.image.digest,
            "root": self.image.root,
            "working_dir": self.image.working_dir,
            "env": list(self.image.env),
            "user": self.image.user,
        }
        publish_bytes(self.rollout_dir / "image.json", json.dumps(record, indent=2).encode(), mode=0o644)


def release_image_root(rollout_dir: Path) -> None:
    """Unmount a rollout's image root (left by this or a killed supervisor) and remove its scratch.

    What the rollout wrote is copied into ``changes/`` first (once: a ``changes/`` already there is
    whole), the rollout's evidence.
    """
    scratch = rollout_dir / ".image"
    if not scratch.is_dir():
        return
    for place in ("root", "lower"):
        _unmount(scratch / place)
    fs = scratch / "fs"
    changes = rollout_dir / "changes"
    if (fs / "upper").is_dir() and not changes.exists():
        partial = rollout_dir / ".changes.partial"
        if partial.exists():
            shutil.rmtree(partial)
        copy_changes(fs / "upper", partial)
        os.rename(partial, changes)
    _unmount(fs)
    for place in ("root", "lower", "fs"):
        if os.path.ismount(scratch / place):
            # Never walk into a file system still mounted: under root/ and lower/ is the image.
            raise SandboxError(f"{scratch / place} is still mounted; the rollout's image scratch was left")
    shutil.rmtree(scratch)


_OPAQUE: Final = "trusted.overlay.opaque"


def copy_changes(upper: Path, dest: Path) -> None:
    """Copy an overlay upper directory to ``dest`` as overlayfs wrote it (links never followed).

    Kept: directories, regular files, symbolic links, FIFOs, whiteouts (0:0 character devices),
    modes, owners, modification times and the opaque-directory mark. Any other device is skipped
    (overlayfs writes none; agent code in its cage cannot make one).
    """
    os.mkdir(dest, 0o700)
    _copy_meta(upper, dest, os.lstat(upper))
    stack = [(upper, dest)]
    while stack:
        source, target = stack.pop()
        with os.scandir(source) as entries:
            for entry in entries:
                src, dst = Path(entry.path), target / entry.name
                st = os.lstat(src)
                mode = st.st_mode
                if stat.S_ISDIR(mode):
                    os.mkdir(dst, 0o700)
                    stack.append((src, dst))
                elif stat.S_ISREG(mode):
                    _copy_file(src, dst)
                elif stat.S_ISLNK(mode):
                    os.symlink(os.readlink(src), dst)
                elif stat.S_ISCHR(mode) and st.st_rdev == 0:
                    os.mknod(dst, stat.S_IFCHR | 0o000, 0)
                elif stat.S_ISFIFO(mode):
                    os.mkfifo(dst, 0o600)
                else:
                    continue
                _copy_meta(src, dst, st)
    # Directories' times last: making their entries changed them.
    for dirpath, _, _ in os.walk(upper):
        relative = os.path.relpath(dirpath, upper)
        st = os.lstat(dirpath)
        os.utime(dest / relative, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_file(src: Path, dst: Path) -> None:
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            while os.sendfile(out, fd, None, 1 << 24):
                pass
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _copy_meta(src: Path, dst: Path, st: os.stat_result) -> None:
    os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        with contextlib.suppress(OSError):
            os.setxattr(dst, _OPAQUE, os.getxattr(src, _OPAQUE, follow_symlinks=False), follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def mount_image_root(
    image: ImageSandbox,
    rollout_dir: Path,
    owner: tuple[int, int] | None,
    *,
    max_bytes: int | None = None,
    max_inodes: int | None = None,
) -> ImageRoot:
    """Mount ``image`` copy-on-write for the rollout in ``rollout_dir`` (see the module docstring).

    Args:
        image: The rollout's image.
        rollout_dir: The rollout directory ``R``.
        owner: ``(uid, gid)`` the sandbox runs as on the host (the two-stage launch); the image's
            user's files are mapped to it.
        max_bytes: Bound of what the rollout may write in the root (its workspace's); ``None``: the
            kernel's default for a tmpfs.
        max_inodes: Bound of the files it may make there; ``None``: the kernel's default.

    Raises:
        SandboxError: Not root, no unprivileged sandbox uid, or the kernel refused a step; one line.
    """
    if os.geteuid() != 0 or owner is None:
        raise SandboxError(
            "an image rollout needs a supervisor running as root with an unprivileged sandbox uid "
            "(run_as_uid) to mount its copy-on-write root (bubblewrap 0.8 cannot); run rollcage as root"
        )
    if not os.path.isdir(image.root):
        raise SandboxError(f"the image root {image.root} of {image.ref} is gone (removed from the store?)")
    release_image_root(rollout_dir)  # an earlier, killed attempt's mounts in this directory
    try:
        return _mount(image, rollout_dir, owner, max_bytes, max_inodes)
    except BaseException:
        release_image_root(rollout_dir)
        raise


def _mount(
    image: ImageSandbox,
    rollout_dir: Path,
    owner: tuple[int, int],
    max_bytes: int | None,
    max_inodes: int | None,
) -> ImageRoot:
    scratch = rollout_dir / ".image"
    root = ImageRoot(image, rollout_dir)
    if root.changes.exists():
        shutil.rmtree(root.changes)  # an attempt in this directory before (staged again): not this one's
    fs, lower, merged, skeleton = scratch / "fs", scratch / "lower", root.merged, scratch / "skel"
    for directory in (lower, merged, fs):
        directory.mkdir(parents=True, exist_ok=True)
    bounds = "mode=0700" + (f",size={max_bytes}" if max_bytes else "")
    bounds += f",nr_inodes={max_inodes}" if max_inodes else ""
    # Its source names it rollcage's: launches leave it out of their base namespace (rollcage.cage).
    if _libc.mount(b"rollcage-image", os.fsencode(fs), b"tmpfs", _MS_NOSUID | _MS_NODEV, bounds.encode()):
        raise _fail(f"mounting the bounded file system of the image root at {fs}")
    upper, work = fs / "upper", fs / "work"
    upper.mkdir()
    work.mkdir()
    for place in MOUNT_POINTS:
        (skeleton / place).mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(scratch, 0o711)  # the sandbox's uid passes through to the merged root; nothing else
    # The upper's top directory is the merged root's "/": the image root's mode, and its owner as the
    # id-mapped lower shows it (the sandbox's uid where the image's user owns it, else host root's: nobody).
    st = os.stat(image.root)
    os.chown(
        upper,
        owner[0] if st.st_uid == image.uid else 0,
        owner[1] if st.st_gid == image.gid else 0,
    )
    os.chmod(upper, st.st_mode & 0o7777)
    # The image user's ids are the sandbox's; nothing else is mapped (everyone else's files: nobody's).
    userns = mapping_namespace(((image.uid, owner[0], 1),), ((image.gid, owner[1], 1),))
    idmapped_bind(image.root, lower, userns)
    try:
        lowers = f"{_plain(skeleton, 'mount points')}:{_plain(lower, 'image mount')}"
        options = (
            f"lowerdir={lowers},upperdir={_plain(upper, 'changes directory')},"
            f"workdir={_plain(work, 'work directory')}"
        )
        if (
            _libc.mount(
                b"rollcage-image", os.fsencode(merged), b"overlay", _MS_NOSUID | _MS_NODEV, options.encode()
            )
            != 0
        ):
            raise _fail(f"mounting the copy-on-write root of {image.ref} at {merged}")
    finally:
        # The overlay holds its own reference to the lower: the attached copy is no longer needed.
        _unmount(lower)
    return root
