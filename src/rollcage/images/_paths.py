"""Paths inside an unpacked image: looked up as a chroot would, never leaving the image's root."""

from __future__ import annotations

import os
import stat
from typing import Final

__all__ = ["find_program", "resolve_in_root"]

_MAX_LINKS: Final = 40


def resolve_in_root(root: str, path: str) -> str | None:
    """The path, inside the image, of what ``path`` names there: symbolic links followed as in a chroot.

    ``..`` never climbs above the image's ``/``, an absolute link starts again at the image's ``/``:
    nothing outside ``root`` is ever looked at. ``None`` when a component is missing or there are
    more than 40 links on the way.
    """
    pending = [part for part in path.split("/") if part not in ("", ".")]
    done: list[str] = []
    links = 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        try:
            st = os.lstat(os.path.join(root, *done, part))
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_LINKS:
                return None
            target = os.readlink(os.path.join(root, *done, part))
            if target.startswith("/"):
                done = []
            pending = [p for p in target.split("/") if p not in ("", ".")] + pending
            continue
        done.append(part)
    return "/" + "/".join(done)


def find_program(root: str, name: str, search_path: str) -> str | None:
    """The image's ``name`` as ``PATH`` finds it there: its path inside the image, or ``None``.

    Only a regular file with an execute bit counts (looked at in ``root``, links followed in it).
    """
    for directory in search_path.split(":"):
        if not directory.startswith("/"):
            continue
        inside = resolve_in_root(root, f"{directory.rstrip('/')}/{name}")
        if inside is None:
            continue
        try:
            st = os.lstat(os.path.join(root, inside.lstrip("/")))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_mode & 0o111:
            return f"{directory.rstrip('/')}/{name}"
    return None
