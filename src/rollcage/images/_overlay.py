"""A rollout's copy-on-write root: an overlay whose lower is the image and whose upper is the rollout's.

``cow_root(image, directory, mountpoint)`` mounts overlayfs at ``mountpoint``: lower the image's
unpacked root (never written), upper and work directories inside ``directory`` (so what the
rollout writes costs O(bytes written) and counts against that directory's budget). Mounted
``nosuid,nodev``. Mounting needs ``CAP_SYS_ADMIN`` in the mount namespace's owner: root, or a
non-root caller inside its own user namespace (kernel 5.11+; bubblewrap 0.9+ has ``--overlay``,
Debian 12's 0.8 does not).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rollcage.errors import SandboxError
from rollcage.images._store import PreparedImage
from rollcage.images._unpack import remove_tree

__all__ = ["CowRoot", "cow_root"]

_MS_NOSUID: Final = 0x2
_MS_NODEV: Final = 0x4
_MNT_DETACH: Final = 0x2
_BAD: Final = (",", ":", "\\", "\n")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _plain(path: Path, what: str) -> str:
    text = str(path)
    if any(c in text for c in _BAD):
        raise SandboxError(f"{what} {text!r} holds one of , : \\ which overlay mount options cannot carry")
    return text


@dataclass(frozen=True, slots=True)
class CowRoot:
    """A mounted copy-on-write root; :meth:`remove` unmounts it."""

    path: Path
    """Where the merged root is mounted."""
    upper: Path
    """The rollout's writes (files created or changed, whiteouts for deletions)."""
    work: Path
    """overlayfs's scratch directory (same file system as ``upper``)."""

    def remove(self, *, keep_upper: bool = True) -> None:
        """Unmount (lazily if busy), remove the work directory, and ``upper`` too unless ``keep_upper``."""
        libc = _libc()
        if libc.umount2(os.fsencode(self.path), 0) != 0:
            err = ctypes.get_errno()
            if err == errno.EBUSY:
                libc.umount2(os.fsencode(self.path), _MNT_DETACH)
            elif err != errno.EINVAL:  # EINVAL: not mounted (removed before)
                raise SandboxError(f"unmounting the rollout root {self.path}: {os.strerror(err)}")
        remove_tree(self.work)
        if not keep_upper:
            remove_tree(self.upper)

    def __enter__(self) -> CowRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def cow_root(image: PreparedImage, directory: Path, mountpoint: Path) -> CowRoot:
    """Mount an overlay of ``image`` at ``mountpoint``, its upper and work under ``directory``.

    Raises ``SandboxError`` when the mount fails (not root, overlayfs missing, the upper's file
    system unsuitable). Call :meth:`CowRoot.remove` (or use it as a context manager) when done.

    **Cancellation:** one system call; nothing to cancel.
    """
    upper, work = directory / "upper", directory / "work"
    upper.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    mountpoint.mkdir(parents=True, exist_ok=True)
    options = (
        f"lowerdir={_plain(image.root, 'image root')},upperdir={_plain(upper, 'upper directory')},"
        f"workdir={_plain(work, 'work directory')}"
    )
    target = _plain(mountpoint, "mount point")
    libc = _libc()
    if libc.mount(b"overlay", os.fsencode(target), b"overlay", _MS_NOSUID | _MS_NODEV, options.encode()) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"mounting the overlay for {image.ref} at {target}: {os.strerror(err)}")
    return CowRoot(mountpoint, upper, work)
