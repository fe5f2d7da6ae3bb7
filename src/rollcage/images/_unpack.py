"""Unpacking layers safely, and composing them into one image root.

Every file system operation here is relative to a directory file descriptor and never follows a
symbolic link (``O_NOFOLLOW`` on every component, ``follow_symlinks=False`` on every call): a layer
cannot make us write through a link it planted, whatever order its members come in. What a layer
may hold, and what becomes of it:

* regular files, directories, symbolic links, FIFOs: kept, with their mode (setuid, setgid
  cleared: the bits are made inert), owner (when we run as root) and modification time;
  extended attributes (file capabilities included) are not applied;
* symbolic links are kept as written, absolute ones included (``/bin -> usr/bin``): they resolve
  inside the image root at run time. A *relative* link whose ``..`` climbs above the image root
  is refused;
* hard links must name a member earlier in the same layer (the OCI spec's rule); one naming an
  absolute path, a ``..`` path or anything absent from the layer is refused;
* member names that are absolute or hold ``..``, or that reach below a symbolic link or a file
  of the same layer, are refused; so are device nodes and any type tar has beyond these;
* sizes are counted from the tar headers before a byte is written (a 10 GB sparse file is
  refused, not materialised) and the decompressed stream is counted as it is read (a gzip bomb
  stops at the cap); runs of zeros are written as holes;
* whiteouts (``.wh.NAME``) and opaque markers (``.wh..wh..opq``) are recorded in the layer's
  ``meta.json``, not written as files: they apply when layers are composed.

Composition flattens (:func:`flatten`): each image gets one root directory whose files are hard
links to the unpacked layers' files (a copy where the file system refuses the link), with each
layer's whiteouts applied before its entries, so an image costs its layers' bytes once and a
root per image costs only inodes. An overlay of N layer directories would need overlayfs
whiteouts (character devices 0/0: ``CAP_MKNOD``, or ``user.*`` xattrs and a recent kernel) and
N lower directories per rollout mount; one flat lower directory is simpler and works the same
for root and non-root callers.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import tarfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final, Protocol, cast

from rollcage.errors import ImageRefusedError

__all__ = ["Budget", "LayerMeta", "Limits", "flatten", "remove_tree", "tree_size", "unpack_layer"]

_CHUNK: Final = 1 << 20
_HOLE: Final = 1 << 16
_ZEROS: Final = bytes(_HOLE)
_ZERO_CHUNK: Final = bytes(_CHUNK)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WHITEOUT: Final = ".wh."
_OPAQUE: Final = ".wh..wh..opq"
_KEEP_MODE: Final = 0o1777  # permission bits and sticky; setuid/setgid (0o6000) are dropped


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what unpacking an image may cost; beyond them the image is refused."""

    max_image_bytes: int = 64 << 30
    """Uncompressed bytes, all layers of one image together (file sizes as the tar headers state
    them, and the decompressed tar stream as it is read)."""
    max_image_entries: int = 4_000_000
    """Tar members, all layers of one image together."""


@dataclass(slots=True)
class LayerMeta:
    """What ``meta.json`` beside an unpacked layer records."""

    diff_id: str
    """sha256 of the uncompressed tar stream (the config's ``rootfs.diff_ids`` entry)."""
    bytes: int = 0
    """Bytes of file content, as the tar headers state them."""
    entries: int = 0
    """Tar members, whiteouts included."""
    whiteouts: list[str] = field(default_factory=list)
    """Paths this layer deletes from the layers below."""
    opaque: list[str] = field(default_factory=list)
    """Directories whose lower contents this layer hides (``""`` is the root)."""
    implicit: list[str] = field(default_factory=list)
    """Directories made only as parents of members (their metadata is not the layer's word)."""

    def to_json(self) -> dict[str, Any]:
        """The record as a JSON object."""
        return {
            "diff_id": self.diff_id,
            "bytes": self.bytes,
            "entries": self.entries,
            "whiteouts": self.whiteouts,
            "opaque": self.opaque,
            "implicit": self.implicit,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LayerMeta:
        """Read a record written by :meth:`to_json`."""
        return cls(
            diff_id=str(data["diff_id"]),
            bytes=int(data["bytes"]),
            entries=int(data["entries"]),
            whiteouts=[str(p) for p in data["whiteouts"]],
            opaque=[str(p) for p in data["opaque"]],
            implicit=[str(p) for p in data["implicit"]],
        )


class Budget:
    """The bytes and entries an image may still use, shared by its layers."""

    def __init__(self, limits: Limits, *, used_bytes: int = 0, used_entries: int = 0) -> None:
        self.limits = limits
        self.bytes = used_bytes
        self.entries = used_entries

    def take_bytes(self, n: int, what: str) -> None:
        self.bytes += n
        if self.bytes > self.limits.max_image_bytes:
            raise ImageRefusedError(
                f"{what}: the image holds more than {self.limits.max_image_bytes} uncompressed bytes "
                "(the store's limit)"
            )

    def take_entry(self, what: str) -> None:
        self.entries += 1
        if self.entries > self.limits.max_image_entries:
            raise ImageRefusedError(
                f"{what}: the image holds more than {self.limits.max_image_entries} files (the store's limit)"
            )


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class _Reader:
    """A read-only stream that hashes what passes through it and, optionally, counts it against a budget."""

    def __init__(self, inner: _Readable, cap: int | None, what: str) -> None:
        self._inner = inner
        self._cap = cap
        self._what = what
        self.hash = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._inner.read(n)
        self.count += len(data)
        if self._cap is not None and self.count > self._cap:
            raise ImageRefusedError(
                f"{self._what}: the decompressed layer is over {self._cap} bytes (the store's limit)"
            )
        self.hash.update(data)
        return data

    def drain(self) -> None:
        while self.read(_CHUNK):
            pass

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()


def unpack_layer(
    source: IO[bytes],
    dest: Path,
    *,
    what: str,
    digest: str | None,
    diff_id: str,
    budget: Budget,
) -> LayerMeta:
    """Unpack one layer blob (gzip or plain tar) into the empty directory ``dest``; return its record.

    ``digest`` (the blob's, when known) and ``diff_id`` (the uncompressed stream's) are checked once the
    whole blob has been read; a mismatch, or anything the module docstring refuses, raises
    ``ImageRefusedError`` naming ``what`` and the member. ``dest`` is then left half-filled: the caller
    unpacks into a temporary name and removes it.
    """
    raw = _Reader(source, None, what)
    head = _peek(raw)
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        raise ImageRefusedError(f"{what}: zstd-compressed layers are not supported (gzip or plain tar only)")
    if head.startswith(b"\x1f\x8b"):
        plain: _Readable = gzip.GzipFile(fileobj=cast("IO[bytes]", _Prefixed(head, raw)), mode="rb")
    else:
        plain = _Prefixed(head, raw)
    # The tar stream (headers and padding too) may be at most twice the content limit: a gzip
    # bomb of zeros stops there, whatever the headers claim.
    stream = _Reader(plain, 2 * budget.limits.max_image_bytes, what)
    meta = LayerMeta(diff_id=diff_id)
    root_fd = os.open(dest, _DIR_FLAGS)
    try:
        try:
            with tarfile.open(fileobj=cast("IO[bytes]", stream), mode="r|", errorlevel=2) as archive:
                dirs = _Unpacker(root_fd, archive, meta, budget, what).run()
            stream.drain()
            raw.drain()
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise ImageRefusedError(f"{what}: not a valid (gzip) tar stream: {exc}") from exc
        if digest is not None and raw.digest() != digest:
            raise ImageRefusedError(f"{what}: blob digest is {raw.digest()}, expected {digest}")
        if stream.digest() != diff_id:
            raise ImageRefusedError(
                f"{what}: uncompressed digest is {stream.digest()}, the config says {diff_id}"
            )
        _apply_dir_meta(root_fd, dirs)
    finally:
        os.close(root_fd)
    return meta


def _peek(raw: _Reader) -> bytes:
    return raw.read(4)


class _Prefixed:
    """``head`` followed by the rest of ``inner`` (what peeking took, given back)."""

    def __init__(self, head: bytes, inner: _Readable) -> None:
        self._head = head
        self._inner = inner

    def read(self, n: int = -1) -> bytes:
        if self._head:
            if n < 0:
                data, self._head = self._head + self._inner.read(), b""
                return data
            data, self._head = self._head[:n], self._head[n:]
            return data
        return self._inner.read(n)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False


@dataclass(slots=True)
class _DirMeta:
    mode: int
    uid: int
    gid: int
    mtime: float


class _Unpacker:
    def __init__(
        self, root_fd: int, archive: tarfile.TarFile, meta: LayerMeta, budget: Budget, what: str
    ) -> None:
        self.root_fd = root_fd
        self.archive = archive
        self.meta = meta
        self.budget = budget
        self.what = what
        self.dirs: dict[tuple[str, ...], _DirMeta] = {}
        self.implicit: set[tuple[str, ...]] = set()
        self.as_root = os.geteuid() == 0

    def refuse(self, member: tarfile.TarInfo, why: str) -> ImageRefusedError:
        return ImageRefusedError(f"{self.what}: member {member.name!r}: {why}")

    def run(self) -> dict[tuple[str, ...], _DirMeta]:
        for member in self.archive:
            self.budget.take_entry(self.what)
            self.meta.entries += 1
            self.member(member)
        self.meta.implicit = sorted("/".join(p) for p in self.implicit if p not in self.dirs)
        return self.dirs

    def member(self, member: tarfile.TarInfo) -> None:
        parts = _split(member.name, lambda why: self.refuse(member, why))
        if not parts:
            if member.isdir():
                return  # the layer's root itself: the image root's metadata is ours
            raise self.refuse(member, "names the root but is not a directory")
        name = parts[-1]
        if name.startswith(_WHITEOUT):
            self.whiteout(member, parts)
            return
        parent = self.parent(member, parts[:-1])
        try:
            self.create(member, parent, parts, name)
        finally:
            os.close(parent)

    def whiteout(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        name = parts[-1]
        if name == _OPAQUE:
            self.meta.opaque.append("/".join(parts[:-1]))
            return
        target = name[len(_WHITEOUT) :]
        if target in ("", ".", "..") or target.startswith(_WHITEOUT):
            raise self.refuse(member, "whiteout of an invalid name")
        self.meta.whiteouts.append("/".join((*parts[:-1], target)))

    def parent(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> int:
        fd = os.dup(self.root_fd)
        for depth, part in enumerate(parts):
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, 0o700, dir_fd=fd)
                os.chmod(part, 0o755, dir_fd=fd)  # what docker gives a parent the tar does not list
                self.implicit.add(parts[: depth + 1])
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except (NotADirectoryError, OSError) as exc:
                os.close(fd)
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self.refuse(
                        member,
                        f"its parent {'/'.join(parts[: depth + 1])!r} is a link or a file in this layer",
                    ) from exc
                raise
            os.close(fd)
            fd = nxt
        return fd

    def create(self, member: tarfile.TarInfo, parent: int, parts: tuple[str, ...], name: str) -> None:
        if member.isdir():
            self.make_dir(parent, parts, name, member)
            return
        _remove_entry(parent, name)
        if member.isreg():
            self.make_file(member, parent, name)
        elif member.issym():
            self.check_symlink(member, parts)
            os.symlink(member.linkname, name, dir_fd=parent)
        elif member.islnk():
            self.make_hardlink(member, parent, name)
            return  # a hard link shares its target's metadata
        elif member.isfifo():
            os.mkfifo(name, 0o600, dir_fd=parent)
        elif member.isdev():
            raise self.refuse(member, "device nodes are refused (an image needs none: the sandbox has /dev)")
        else:
            raise self.refuse(member, f"tar member type {member.type!r} is not supported")
        self.set_meta(parent, name, member, is_link=member.issym())

    def make_dir(self, parent: int, parts: tuple[str, ...], name: str, member: tarfile.TarInfo) -> None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            os.mkdir(name, 0o700, dir_fd=parent)
        else:
            if not stat.S_ISDIR(st.st_mode):
                _remove_entry(parent, name)
                os.mkdir(name, 0o700, dir_fd=parent)
        self.dirs[parts] = _DirMeta(member.mode & _KEEP_MODE, member.uid, member.gid, float(member.mtime))

    def make_file(self, member: tarfile.TarInfo, parent: int, name: str) -> None:
        self.budget.take_bytes(member.size, f"{self.what}: member {member.name!r}")
        self.meta.bytes += member.size
        source = self.archive.extractfile(member)
        if source is None:
            raise self.refuse(member, "has no content")
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent
        )
        try:
            _copy_sparse(source, fd)
            os.ftruncate(fd, member.size)
        finally:
            os.close(fd)

    def check_symlink(self, member: tarfile.TarInfo, parts: tuple[str, ...]) -> None:
        target = member.linkname
        if not target or "\0" in target:
            raise self.refuse(member, "a symbolic link with an empty target")
        if target.startswith("/"):
            return  # resolves inside the image root at run time; never followed here
        depth = len(parts) - 1
        for piece in target.split("/"):
            if piece == "..":
                depth -= 1
                if depth < 0:
                    raise self.refuse(member, f"symbolic link to {target!r} climbs out of the image root")
            elif piece not in ("", "."):
                depth += 1

    def make_hardlink(self, member: tarfile.TarInfo, parent: int, name: str) -> None:
        target = _split(member.linkname, lambda why: self.refuse(member, f"hard link target: {why}"))
        if not target:
            raise self.refuse(member, "hard link to the root")
        try:
            source_parent = self.existing_parent(target[:-1])
        except OSError as exc:
            raise self.refuse(
                member, f"hard link to {member.linkname!r}, which is not in this layer"
            ) from exc
        try:
            st = os.stat(target[-1], dir_fd=source_parent, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise self.refuse(member, f"hard link to the directory {member.linkname!r}")
            os.link(target[-1], name, src_dir_fd=source_parent, dst_dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError as exc:
            raise self.refuse(
                member, f"hard link to {member.linkname!r}, which is not in this layer"
            ) from exc
        finally:
            os.close(source_parent)

    def existing_parent(self, parts: tuple[str, ...]) -> int:
        fd = os.dup(self.root_fd)
        for part in parts:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            finally:
                os.close(fd)
            fd = nxt
        return fd

    def set_meta(self, parent: int, name: str, member: tarfile.TarInfo, *, is_link: bool) -> None:
        if self.as_root:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        if not is_link:
            os.chmod(name, member.mode & _KEEP_MODE, dir_fd=parent)
        os.utime(name, (member.mtime, member.mtime), dir_fd=parent, follow_symlinks=False)


def _split(name: str, refuse: Any) -> tuple[str, ...]:
    """A member name as path components; refuse absolute names and ``..``."""
    if "\0" in name:
        raise refuse("the name holds a NUL byte")
    if name.startswith("/"):
        raise refuse("absolute member names are refused")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise refuse("'..' in a member name is refused")
    return parts


def _copy_sparse(source: IO[bytes], fd: int) -> None:
    """Copy ``source`` into ``fd``, leaving holes where whole blocks are zero."""
    while chunk := source.read(_CHUNK):
        if chunk == _ZERO_CHUNK[: len(chunk)]:  # bytes compare with memcmp: the common sparse case, fast
            os.lseek(fd, len(chunk), os.SEEK_CUR)
            continue
        for start in range(0, len(chunk), _HOLE):
            block = chunk[start : start + _HOLE]
            if block == _ZEROS[: len(block)]:
                os.lseek(fd, len(block), os.SEEK_CUR)
            else:
                _write_all(fd, memoryview(block))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data) :]


def _remove_entry(parent: int, name: str) -> None:
    """Remove whatever ``parent/name`` is (a tree too), never following a link."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        _rmtree_at(parent, name)
    else:
        os.unlink(name, dir_fd=parent)


def _rmtree_at(parent: int, name: str) -> None:
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _rmtree_at(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def remove_tree(path: Path) -> None:
    """Remove a store tree (made read-only in places, possibly) without following links in it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        path.unlink()
        return
    parent = os.open(path.parent, _DIR_FLAGS)
    try:
        _rmtree_at(parent, path.name)
    finally:
        os.close(parent)


def _open_path(root_fd: int, parts: tuple[str, ...]) -> int:
    fd = os.dup(root_fd)
    for part in parts:
        try:
            nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _apply_dir_meta(root_fd: int, dirs: dict[tuple[str, ...], _DirMeta]) -> None:
    """Give directories their recorded metadata, deepest first (a 0o555 parent must come last)."""
    as_root = os.geteuid() == 0
    for parts in sorted(dirs, key=len, reverse=True):
        meta = dirs[parts]
        try:
            fd = _open_path(root_fd, parts)
        except OSError:
            continue  # replaced by a later member of the same layer
        try:
            if as_root:
                os.fchown(fd, meta.uid, meta.gid)
            os.fchmod(fd, meta.mode)
            os.utime(fd, (meta.mtime, meta.mtime))
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- composing layers


def flatten(layers: list[tuple[Path, LayerMeta]], dest: Path) -> None:
    """Compose unpacked layers, lowest first, into the empty directory ``dest`` (hard links to files)."""
    root_fd = os.open(dest, _DIR_FLAGS)
    dirs: dict[tuple[str, ...], _DirMeta] = {}
    try:
        for path, meta in layers:
            for opaque in meta.opaque:
                _clear_dir(root_fd, _parts(opaque))
            for gone in meta.whiteouts:
                parts = _parts(gone)
                try:
                    parent = _open_path(root_fd, parts[:-1])
                except OSError:
                    continue
                try:
                    _remove_entry(parent, parts[-1])
                finally:
                    os.close(parent)
            implicit = {_parts(p) for p in meta.implicit}
            src = os.open(path, _DIR_FLAGS)
            try:
                _merge(src, root_fd, (), implicit, dirs)
            finally:
                os.close(src)
        _apply_dir_meta(root_fd, dirs)
        os.fchmod(root_fd, 0o755)
    finally:
        os.close(root_fd)


def _parts(path: str) -> tuple[str, ...]:
    return tuple(p for p in path.split("/") if p)


def _clear_dir(root_fd: int, parts: tuple[str, ...]) -> None:
    try:
        fd = _open_path(root_fd, parts)
    except OSError:
        return
    try:
        for entry in list(os.scandir(fd)):
            _remove_entry(fd, entry.name)
    finally:
        os.close(fd)


def _merge(
    src: int,
    dst: int,
    at: tuple[str, ...],
    implicit: set[tuple[str, ...]],
    dirs: dict[tuple[str, ...], _DirMeta],
) -> None:
    for entry in _entries(src):
        parts = (*at, entry.name)
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            try:
                existing = os.stat(entry.name, dir_fd=dst, follow_symlinks=False)
                fresh = not stat.S_ISDIR(existing.st_mode)
            except FileNotFoundError:
                fresh = True
            if fresh:
                _remove_entry(dst, entry.name)
                os.mkdir(entry.name, 0o700, dir_fd=dst)
            if fresh or parts not in implicit:
                dirs[parts] = _DirMeta(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime)
            sub_src = os.open(entry.name, _DIR_FLAGS, dir_fd=src)
            try:
                sub_dst = os.open(entry.name, _DIR_FLAGS, dir_fd=dst)
                try:
                    _merge(sub_src, sub_dst, parts, implicit, dirs)
                finally:
                    os.close(sub_dst)
            finally:
                os.close(sub_src)
            continue
        _remove_entry(dst, entry.name)
        _link_or_copy(src, dst, entry.name, st)


def _entries(fd: int) -> Iterator[os.DirEntry[str]]:
    with os.scandir(fd) as it:
        yield from list(it)


def _link_or_copy(src: int, dst: int, name: str, st: os.stat_result) -> None:
    try:
        os.link(name, name, src_dir_fd=src, dst_dir_fd=dst, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno not in (errno.EMLINK, errno.EXDEV, errno.EPERM):
            raise
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(name, 0o600, dir_fd=dst)
    else:
        fin = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
        try:
            fout = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst
            )
            try:
                with os.fdopen(os.dup(fin), "rb") as reader:
                    _copy_sparse(reader, fout)
                os.ftruncate(fout, st.st_size)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
    if os.geteuid() == 0:
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)
    if not stat.S_ISLNK(st.st_mode):
        os.chmod(name, stat.S_IMODE(st.st_mode), dir_fd=dst)
    os.utime(name, ns=(st.st_mtime_ns, st.st_mtime_ns), dir_fd=dst, follow_symlinks=False)


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path`` (hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total
