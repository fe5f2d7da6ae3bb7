"""What a prepared image means for a rollout: its user's ids and the sandbox record the worker gets."""

from __future__ import annotations

import os
import stat
from typing import Final

from rollcage.errors import ImageRefusedError
from rollcage.images._paths import resolve_in_root
from rollcage.images._store import PreparedImage
from rollcage.protocol import ImageSandbox

__all__ = ["image_sandbox", "read_in_root", "resolve_user"]

_MAX_DB: Final = 4 << 20


def read_in_root(root: str, path: str) -> str | None:
    """The text of the image's file ``path`` (links followed inside the image only); ``None`` if absent."""
    inside = resolve_in_root(root, path)
    if inside is None:
        return None
    host = os.path.join(root, inside.lstrip("/"))
    try:
        fd = os.open(host, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, _MAX_DB).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _lookup(root: str, database: str, name: str, field: int) -> int | None:
    text = read_in_root(root, database) or ""
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) > field and parts[0] == name and parts[field].isdigit():
            return int(parts[field])
    return None


def resolve_user(root: str, user: str | None, ref: str) -> tuple[int, int]:
    """``(uid, gid)`` of an image's ``User`` (``name``, ``uid``, ``name:group``, ``uid:gid``; none: root).

    A name is looked up in the image's own ``/etc/passwd`` and ``/etc/group``.

    Raises:
        ImageRefusedError: A name the image does not define.
    """
    if not user:
        return 0, 0
    name, _, group = user.partition(":")
    if name.isdigit():
        uid = int(name)
        gid = None  # the primary group of whichever user has that uid, if one has
        for line in (read_in_root(root, "/etc/passwd") or "").splitlines():
            parts = line.split(":")
            if len(parts) > 3 and parts[2] == name and parts[3].isdigit():
                gid = int(parts[3])
                break
    else:
        found = _lookup(root, "/etc/passwd", name, 2)
        if found is None:
            raise ImageRefusedError(f"{ref}: its User {user!r} names a user its /etc/passwd does not have")
        uid = found
        gid = _lookup(root, "/etc/passwd", name, 3)
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            gid = _lookup(root, "/etc/group", group, 2)
            if gid is None:
                raise ImageRefusedError(
                    f"{ref}: its User {user!r} names a group its /etc/group does not have"
                )
    if uid >= 1 << 31 or (gid is not None and gid >= 1 << 31):
        raise ImageRefusedError(f"{ref}: its User {user!r} is out of range")
    return uid, gid if gid is not None else uid


def image_sandbox(image: PreparedImage) -> ImageSandbox:
    """The record a rollout in ``image`` carries (``WorkerInput.image``).

    Raises:
        ImageRefusedError: The image's ``User`` cannot be resolved, or its ``WorkingDir`` is not absolute.
    """
    config = image.config
    root = str(image.root)
    uid, gid = resolve_user(root, config.user, image.ref)
    working_dir = config.working_dir or "/"
    if not working_dir.startswith("/"):
        raise ImageRefusedError(f"{image.ref}: its WorkingDir {working_dir!r} is not an absolute path")
    return ImageSandbox(
        ref=image.ref,
        digest=image.digest,
        manifest_digest=image.manifest_digest,
        root=root,
        working_dir=working_dir,
        env=list(config.env),
        user=config.user,
        uid=uid,
        gid=gid,
    )
