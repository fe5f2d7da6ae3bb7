"""Id-mapped mounts of an image root: the image's files shown as owned by the uid a cage runs as.

The store keeps an image's owners (mostly uid 0). A cage runs as an unprivileged host uid, which
must own the files of the image's ``User`` to change them, as a container's user does. An
*id-mapped* mount (``mount_setattr(MOUNT_ATTR_IDMAP)``, Linux 5.12+; overlayfs accepts one as a
layer since 5.19) shows them so without writing the store: the mapping is a property of the
mount. Used by the supervisor's rollout roots (``rollcage.supervisor.imageroot``) and by the
grader's fresh roots (``rollcage.controller._fresh_root``), each with a mapping of its own.

Root only (the maps of the mapping namespace are written from this process).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import subprocess
import threading
from pathlib import Path
from typing import Final

from rollcage.errors import SandboxError

__all__ = ["IdMap", "attach_mount", "idmapped_bind", "idmapped_clone", "mapping_namespace"]

IdMap = tuple[tuple[int, int, int], ...]
"""Lines of a ``uid_map`` or ``gid_map``: ``(inside, outside, count)``."""

_SYS_OPEN_TREE: Final = 428  # the same numbers on every architecture
_SYS_MOVE_MOUNT: Final = 429
_SYS_MOUNT_SETATTR: Final = 442
_OPEN_TREE_CLONE: Final = 1
_AT_EMPTY_PATH: Final = 0x1000
_AT_FDCWD: Final = -100
_MOVE_MOUNT_F_EMPTY_PATH: Final = 0x4
_MOUNT_ATTR_RDONLY: Final = 0x1
_MOUNT_ATTR_IDMAP: Final = 0x00100000
_HELPER_EXIT_S: Final = 30.0

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long

_lock = threading.Lock()
_namespaces: dict[tuple[IdMap, IdMap], int] = {}


class _MountAttr(ctypes.Structure):
    _fields_ = (
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    )


def _fail(what: str) -> SandboxError:
    return SandboxError(f"{what}: {os.strerror(ctypes.get_errno())}")


def mapping_namespace(uid_map: IdMap, gid_map: IdMap) -> int:
    """A user namespace with these maps (an open descriptor, kept for the process: made once per mapping).

    Made by a short-lived ``unshare --user`` helper (a threaded process may not unshare a user
    namespace itself) whose maps this process writes; the helper then exits.

    Raises:
        SandboxError: ``unshare`` (util-linux) cannot be run, or the maps cannot be written (not root).
    """
    key = (tuple(uid_map), tuple(gid_map))
    with _lock:
        if key in _namespaces:
            return _namespaces[key]
        try:
            # It waits for the end of its stdin: closing it ends the helper, whatever happened here.
            helper = subprocess.Popen(
                ["unshare", "--user", "--", "/bin/sh", "-c", "echo ready; exec cat"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
            )
        except OSError as exc:
            raise SandboxError(f"cannot start unshare (util-linux) to map the image's owner: {exc}") from exc
        assert helper.stdout is not None and helper.stdin is not None
        try:
            if helper.stdout.readline() != b"ready\n":
                raise SandboxError("unshare --user did not start, so the image's owner cannot be mapped")
            uids, gids = ("".join(f"{a} {b} {n}\n" for a, b, n in ids) for ids in key)
            with open(f"/proc/{helper.pid}/uid_map", "w", encoding="ascii") as handle:
                handle.write(uids)
            with open(f"/proc/{helper.pid}/setgroups", "w", encoding="ascii") as handle:
                handle.write("deny")
            with open(f"/proc/{helper.pid}/gid_map", "w", encoding="ascii") as handle:
                handle.write(gids)
            fd = os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise SandboxError(f"cannot map the image's owner to the sandbox's uid: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                helper.stdin.close()
            helper.stdout.close()
            try:
                # Its stdin closed, its cat ends at once.
                helper.wait(timeout=_HELPER_EXIT_S)
            except subprocess.TimeoutExpired as exc:
                raise SandboxError("the user namespace helper (unshare) did not exit") from exc
        _namespaces[key] = fd
        return fd


def idmapped_clone(source: str | Path, userns: int) -> int:
    """A detached, read-only, id-mapped copy of the mount tree at ``source`` (a descriptor; close it).

    Raises:
        SandboxError: The kernel (before 5.12) or ``source``'s file system refuses.
    """
    fd = _libc.syscall(
        ctypes.c_long(_SYS_OPEN_TREE),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(source)),
        ctypes.c_uint(_OPEN_TREE_CLONE | os.O_CLOEXEC),
    )
    if fd < 0:
        raise _fail(f"cloning the image root {source}")
    attr = _MountAttr(_MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY, 0, 0, userns)
    result = _libc.syscall(
        ctypes.c_long(_SYS_MOUNT_SETATTR),
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_uint(_AT_EMPTY_PATH),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    if result != 0:
        error = _fail(f"id-mapping the image root {source} (its file system must allow id-mapped mounts)")
        os.close(int(fd))
        raise error
    return int(fd)


def attach_mount(fd: int, target: str | Path) -> None:
    """Attach the detached mount ``fd`` (:func:`idmapped_clone`) at ``target``.

    Raises:
        SandboxError: The kernel refused.
    """
    result = _libc.syscall(
        ctypes.c_long(_SYS_MOVE_MOUNT),
        ctypes.c_int(fd),
        ctypes.c_char_p(b""),
        ctypes.c_int(_AT_FDCWD),
        ctypes.c_char_p(os.fsencode(target)),
        ctypes.c_uint(_MOVE_MOUNT_F_EMPTY_PATH),
    )
    if result != 0:
        raise _fail(f"attaching the image root at {target}")


def idmapped_bind(source: str | Path, target: str | Path, userns: int) -> None:
    """Bind ``source`` at ``target`` read-only through an id-mapped mount with ``userns``'s maps.

    Raises:
        SandboxError: The kernel or ``source``'s file system refuses.
    """
    fd = idmapped_clone(source, userns)
    try:
        attach_mount(fd, target)
    finally:
        os.close(fd)
