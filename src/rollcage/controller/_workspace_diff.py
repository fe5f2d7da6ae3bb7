"""``workspace.diff``: what a rollout changed, kept in its rollout directory as evidence.

Made by the controller after the supervisor's receipt, whatever the outcome:

* a rollout run in an image whose ``WorkingDir`` is a git repository in the image: git's own
  diff of the working directory against the image's ``HEAD``, new untracked files included (not
  those ``.gitignore`` ignores). git runs on the untrusted tree only inside a contained cage
  (:func:`rollcage.cage.run_contained`, the host's git, no network) over a fresh read-only root
  made from the image and a copy of ``changes/``, with a git directory of its own in the cage's
  scratch: the repository's own config, hooks, attributes' filters and textconv are never
  read, and ``-c`` options disable hooks, fsmonitor and external diff besides;
* any other image rollout (or when git fails): a file-level unified diff computed here from
  ``changes/`` against the image (a whiteout is a deletion, an opaque directory deletes what the
  image had under it);
* either way, for an image rollout: a line naming what changed outside a repository's working
  directory, and the rollout's ``workspace/`` (bound at ``/rollout/workspace`` in its root)
  against the empty one it started from, when it holds anything;
* a rollout without an image: the final ``workspace/`` against the empty workspace each rollout
  starts from (every file is new).

Everything the agent wrote is read without following links, bounded in size. Binary files
are named (``Binary files a/x and b/x differ``), never inlined; a file over
:data:`FILE_LIMIT` is named as too large; the whole diff stops at :data:`DIFF_LIMIT` bytes with a
line saying so. A diff that cannot be made is logged and leaves a one-line note in the file; it
never changes the rollout's outcome or grade.

The file is derived (it can be made again from the rollout directory), so it is published without
a sync of its own (``publish_bytes(sync=False)``): renamed into place whole, so a killed controller
never leaves it torn, but a machine crash may. Its seal (:class:`rollcage.protocol.FileSeal`:
size and CRC-32) goes into the rollout's record, whose append to ``rollouts.jsonl`` is synced;
readers (``rollcage show``, the report, the ATIF export) check the file against it and never read
one that does not match. Two syncs a rollout fewer, on the path every rollout takes.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from rollcage.controller._image_grade import ImageInfo, read_image_info
from rollcage.durable import publish_bytes
from rollcage.errors import RollcageError
from rollcage.procs import shielded
from rollcage.protocol import FileSeal

__all__ = [
    "DIFF_LIMIT",
    "FILE_LIMIT",
    "WORKSPACE_DIFF",
    "DiffWritten",
    "file_level_diff",
    "make_workspace_diff",
    "write_workspace_diff",
]

logger = logging.getLogger("rollcage.controller")

WORKSPACE_DIFF: Final = "workspace.diff"
DIFF_LIMIT: Final = 4 << 20
"""The largest ``workspace.diff`` (bytes); the rest is cut with a note."""
FILE_LIMIT: Final = 1 << 20
"""Files larger than this (either side) are named, not diffed."""
_MAX_ENTRIES: Final = 200_000
_LISTED_OUTSIDE: Final = 50
_GIT_TIMEOUT_S: Final = 300.0
_SCRATCH_BYTES: Final = 4 << 30
_GIT_SCRIPT: Final = r"""
set -e
W=$1
I=$2
export HOME=/work GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_TERMINAL_PROMPT=0 GIT_OPTIONAL_LOCKS=0
g() {
    git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c core.untrackedCache=false \
        -c diff.external= -c core.attributesFile=/dev/null -c 'safe.directory=*' \
        -c core.quotePath=false -c diff.noprefix=false -c diff.mnemonicPrefix=false "$@"
}
base=$(g --git-dir="$I/.git" rev-parse --verify -q 'HEAD^{commit}')
mkdir -p /work/git/objects/info /work/git/refs
printf '%s\n' "$I/.git/objects" > /work/git/objects/info/alternates
printf 'ref: refs/heads/rollcage\n' > /work/git/HEAD
export GIT_DIR=/work/git GIT_WORK_TREE="$W"
cd "$W"
g add -A -- .
printf '# git diff of %s against the image'"'"'s HEAD %s\n' "$3" "$base"
g diff --cached --no-ext-diff --no-textconv --no-color "$base" --
"""


def _read_limited(fd: int, limit: int) -> bytes:
    chunks, size = [], 0
    while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            break
    return b"".join(chunks)


@dataclass
class _Entry:
    """One side of a path: what kind of thing it is, its mode, and its content (bounded)."""

    kind: str  # "file", "link", "dir", "other"
    mode: int = 0o644
    size: int = 0
    data: bytes | None = None  # None: over FILE_LIMIT


def _entry_at(dir_fd: int, name: str) -> _Entry | None:
    try:
        info = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        return _Entry("link", 0o120000, info.st_size, os.fsencode(os.readlink(name, dir_fd=dir_fd)))
    if stat.S_ISDIR(info.st_mode):
        return _Entry("dir", mode)
    if not stat.S_ISREG(info.st_mode):
        return _Entry("other", mode, 0, b"")
    if info.st_size > FILE_LIMIT:
        return _Entry("file", mode, info.st_size, None)
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        data = _read_limited(fd, FILE_LIMIT)
    finally:
        os.close(fd)
    return _Entry("file", mode, len(data), data if len(data) <= FILE_LIMIT else None)


def _open_dir(path: Path | None, parts: list[str]) -> int | None:
    """``path/parts...`` as a directory descriptor, no component followed if a link; ``None`` if none."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    for part in parts:
        try:
            next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = next_fd
    return fd


@dataclass
class _Writer:
    """The diff text, bounded."""

    limit: int = DIFF_LIMIT
    parts: list[bytes] = field(default_factory=list)
    size: int = 0
    cut: bool = False
    entries: int = 0

    def add(self, text: bytes) -> None:
        if self.cut:
            return
        if self.size + len(text) > self.limit:
            self.cut = True
            return
        self.parts.append(text)
        self.size += len(text)

    def text(self) -> bytes:
        out = b"".join(self.parts)
        if self.cut:
            out += f"# workspace.diff cut here: it is over {self.limit} bytes\n".encode()
        return out


def _is_text(data: bytes) -> bool:
    if b"\0" in data[:8192]:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _git_mode(entry: _Entry) -> str:
    if entry.kind == "link":
        return "120000"
    return "100755" if entry.mode & 0o111 else "100644"


def _diff_one(out: _Writer, path: str, old: _Entry | None, new: _Entry | None) -> None:
    """One file's diff: ``old``/``new`` ``None`` for added/deleted (directories never come here)."""
    if old is not None and new is not None and old.kind == new.kind and old.data == new.data:
        if old.data is not None and _git_mode(old) == _git_mode(new):
            return  # copied up for its metadata only
    header = [f"diff --git a/{path} b/{path}\n"]
    if old is None and new is not None:
        header.append(f"new file mode {_git_mode(new)}\n")
    elif new is None and old is not None:
        header.append(f"deleted file mode {_git_mode(old)}\n")
    elif old is not None and new is not None and _git_mode(old) != _git_mode(new):
        header += [f"old mode {_git_mode(old)}\n", f"new mode {_git_mode(new)}\n"]
    out.add("".join(header).encode())
    sides = [e for e in (old, new) if e is not None]
    if any(e.kind == "other" for e in sides):
        out.add(f"# {path}: not a regular file or link (a FIFO or socket); content not shown\n".encode())
        return
    if any(e.data is None for e in sides):
        sizes = " and ".join(str(e.size) for e in sides)
        out.add(f"# {path}: over {FILE_LIMIT} bytes ({sizes}); content not shown\n".encode())
        return
    old_data = old.data if old is not None and old.data is not None else b""
    new_data = new.data if new is not None and new.data is not None else b""
    if old_data == new_data:
        return
    a = f"a/{path}" if old is not None else "/dev/null"
    b = f"b/{path}" if new is not None else "/dev/null"
    if not (_is_text(old_data) and _is_text(new_data)):
        out.add(f"Binary files {a} and {b} differ\n".encode())
        return
    lines = difflib.unified_diff(
        old_data.decode().splitlines(keepends=True),
        new_data.decode().splitlines(keepends=True),
        fromfile=a,
        tofile=b,
        n=3,
    )
    for line in lines:
        if not line.endswith("\n"):
            line += "\n\\ No newline at end of file\n"
        out.add(line.encode())
        if out.cut:
            return


def _image_files(image_fd: int, prefix: str) -> Iterator[tuple[str, int, str]]:
    """Every non-directory under the image directory ``image_fd``: ``(path, parent fd, name)``."""
    stack = [(os.dup(image_fd), prefix)]
    try:
        while stack:
            fd, base = stack.pop()
            try:
                for name in sorted(os.listdir(fd)):
                    info = os.lstat(name, dir_fd=fd)
                    if stat.S_ISDIR(info.st_mode):
                        child = os.open(
                            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                        )
                        stack.append((child, f"{base}{name}/"))
                    else:
                        yield f"{base}{name}", fd, name
            finally:
                os.close(fd)
    finally:
        for fd, _ in stack:
            os.close(fd)


def _deleted_tree(out: _Writer, image_fd: int | None, name: str, path: str) -> None:
    """Report the image's ``name`` (a file or a whole directory) as deleted."""
    if image_fd is None:
        return
    old = _entry_at(image_fd, name)
    if old is None:
        return
    if old.kind != "dir":
        _diff_one(out, path, old, None)
        return
    sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=image_fd)
    try:
        for file_path, fd, file_name in _image_files(sub, f"{path}/"):
            _diff_one(out, file_path, _entry_at(fd, file_name), None)
            if out.cut:
                return
    finally:
        os.close(sub)


def _is_whiteout(info: os.stat_result) -> bool:
    return stat.S_ISCHR(info.st_mode) and info.st_rdev == 0


def _opaque(fd: int) -> bool:
    for key in (b"trusted.overlay.opaque", b"user.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(fd, key) == b"y":
                return True
    return False


def file_level_diff(
    changes: Path, image: Path | None, *, overlay: bool = True, limit: int = DIFF_LIMIT, prefix: str = ""
) -> bytes:
    """The unified diff of ``changes`` over ``image`` (``None``: over nothing), see the module docstring.

    ``overlay``: ``changes`` is an overlay upper (whiteouts and opaque directories mean deletions).
    Paths are relative to ``changes``, after ``prefix``. Blocking.

    Raises:
        OSError: ``changes`` cannot be read.
    """
    out = _Writer(limit)
    top = os.open(changes, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    stack: list[tuple[int, list[str]]] = [(top, [])]
    try:
        while stack and not out.cut:
            fd, parts = stack.pop()
            image_fd = _open_dir(image, parts)
            try:
                names = sorted(os.listdir(fd))
                if overlay and image_fd is not None and parts and _opaque(fd):
                    for name in sorted(set(os.listdir(image_fd)) - set(names)):
                        _deleted_tree(out, image_fd, name, prefix + "/".join([*parts, name]))
                subdirs = []
                for name in names:
                    out.entries += 1
                    if out.entries > _MAX_ENTRIES:
                        out.add(
                            f"# more than {_MAX_ENTRIES} changed entries; the rest is not shown\n".encode()
                        )
                        out.cut = True
                        break
                    path = prefix + "/".join([*parts, name])
                    info = os.lstat(name, dir_fd=fd)
                    if overlay and _is_whiteout(info):
                        _deleted_tree(out, image_fd, name, path)
                        continue
                    old = _entry_at(image_fd, name) if image_fd is not None else None
                    if stat.S_ISDIR(info.st_mode):
                        if old is not None and old.kind != "dir":
                            _diff_one(out, path, old, None)
                        subdirs.append(name)
                        continue
                    if old is not None and old.kind == "dir":
                        _deleted_tree(out, image_fd, name, path)
                        old = None
                    _diff_one(out, path, old, _entry_at(fd, name))
                for name in reversed(subdirs):
                    child = os.open(
                        name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                    )
                    stack.append((child, [*parts, name]))
            finally:
                os.close(fd)
                if image_fd is not None:
                    os.close(image_fd)
    finally:
        for fd, _ in stack:
            os.close(fd)
    return out.text()


def _outside(changes: Path, working_dir: str) -> bytes:
    """A note naming what the rollout changed outside the working directory (git's diff covers only it)."""
    inside = working_dir.strip("/")
    found: list[str] = []
    count = 0
    stack: list[tuple[Path, str]] = [(changes, "")]
    while stack and count <= _MAX_ENTRIES:
        directory, base = stack.pop()
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            path = f"{base}{entry.name}"
            if inside and (path == inside or path.startswith(inside + "/")):
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append((Path(entry.path), path + "/"))
                continue
            count += 1
            if len(found) < _LISTED_OUTSIDE:
                found.append("/" + path)
    if not count:
        return b""
    more = f" and {count - len(found)} more" if count > len(found) else ""
    return f"# also changed outside {working_dir} ({count}): {', '.join(found)}{more}\n".encode()


def _image_has_repo(info: ImageInfo) -> bool:
    parts = [p for p in info.working_dir.split("/") if p]
    fd = _open_dir(info.root, [*parts, ".git"])
    if fd is None:
        return False
    os.close(fd)
    return True


async def make_workspace_diff(rollout_dir: Path, *, scratch_parent: Path | None = None) -> bytes:
    """The content of the rollout's ``workspace.diff`` (see the module docstring).

    **Cancellation:** a cage running git is killed and the fresh root removed before the
    cancellation propagates; a file-level diff in a thread finishes on its own.
    """
    info = await asyncio.to_thread(read_image_info, rollout_dir)
    workspace = rollout_dir / "workspace"
    if info is None:
        return await asyncio.to_thread(_diff_without_image, workspace)
    changes = rollout_dir / "changes"
    if not await asyncio.to_thread(_plain_dir, changes):
        return f"# the rollout has no changes directory {changes}: nothing to diff\n".encode()
    diff: bytes | None = None
    note = b""
    if await asyncio.to_thread(_image_has_repo, info):
        try:
            diff = await _git_diff(info, changes, scratch_parent)
            diff += await asyncio.to_thread(_outside, changes, info.working_dir)
        except (RollcageError, OSError, ValueError) as exc:
            logger.warning("git diff of %s failed, writing a file-level diff instead: %s", rollout_dir, exc)
            note = f"# git diff failed ({exc}); file-level diff instead\n".encode()[:2000]
    if diff is None:
        head = f"# file-level diff of the rollout's changes against the image {info.ref}\n".encode()
        diff = head + note + await asyncio.to_thread(file_level_diff, changes, info.root)
    return diff + await asyncio.to_thread(_image_workspace, workspace, DIFF_LIMIT - len(diff))


def _plain_dir(path: Path) -> bool:
    return not path.is_symlink() and path.is_dir()


def _image_workspace(workspace: Path, room: int) -> bytes:
    """The workspace of an image rollout (bound at /rollout/workspace in its root), when it holds anything."""
    if not _plain_dir(workspace):
        return b""
    with os.scandir(workspace) as entries:
        if not any(entries):
            return b""
    head = b"# the rollout's workspace (/rollout/workspace) against the empty one it started from\n"
    return head + file_level_diff(
        workspace, None, overlay=False, limit=max(room - len(head), 1024), prefix="rollout/workspace/"
    )


async def _git_diff(info: ImageInfo, changes: Path, scratch_parent: Path | None) -> bytes:
    from rollcage.cage import RunLimits, run_contained
    from rollcage.controller._fresh_root import fresh_root

    parent = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="rollcage-diff-", dir=scratch_parent))
    stack = contextlib.ExitStack()
    try:
        # Shielded: a mount made after a cancellation would be left behind.
        root = await shielded(
            asyncio.to_thread(
                stack.enter_context,
                fresh_root(info.root, changes, parent / "scratch", size_bytes=_SCRATCH_BYTES, writable=False),
            )
        )
        work_tree = str(root.path / info.working_dir.lstrip("/"))
        image_tree = str(info.root / info.working_dir.lstrip("/"))
        run = await run_contained(
            ["/bin/sh", "-c", _GIT_SCRIPT, "rollcage-diff", work_tree, image_tree, info.working_dir],
            timeout_s=_GIT_TIMEOUT_S,
            limits=RunLimits(
                cpu_seconds=int(_GIT_TIMEOUT_S),
                memory_bytes=4 << 30,
                max_processes=64,
                file_size_bytes=1 << 30,
                scratch_bytes=1 << 30,
                output_limit=DIFF_LIMIT,
            ),
            ro_paths=[str(root.path), str(info.root)],
        )
    finally:
        await shielded(asyncio.to_thread(_close, stack, parent))
    if run.exit_code != 0:
        why = run.stderr.decode("utf-8", "replace").strip()[-500:]
        raise ValueError(f"git exited with {run.exit_code or run.signal}: {why}")
    if run.truncated:
        kept = run.stdout[: run.stdout.rfind(b"\n") + 1]
        return kept + f"# workspace.diff cut here: it is over {DIFF_LIMIT} bytes\n".encode()
    return run.stdout


def _close(stack: contextlib.ExitStack, parent: Path) -> None:
    try:
        stack.close()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@dataclass(frozen=True)
class DiffWritten:
    """What :func:`write_workspace_diff` published."""

    seal: FileSeal | None
    """The seal of the file published, for the record; ``None``: none was."""
    problem: str | None
    """Why the diff could not be made or written, or ``None`` when all went well."""


_NOTHING: Final = DiffWritten(None, None)


async def write_workspace_diff(rollout_dir: Path) -> DiffWritten:
    """Make and publish ``rollout_dir/workspace.diff`` (unsynced: see the module docstring).

    Never raises for a diff that cannot be made: the file then says why in one line. A rollout
    directory that is not there (the controller failed before making it) gets none.

    **Cancellation:** as :func:`make_workspace_diff`; nothing is published.
    """
    # A rollout without an image (most of them) is diffed and published in one thread hop.
    done, written = await asyncio.to_thread(_write_without_image, rollout_dir)
    if done:
        return written
    problem: str | None = None
    try:
        data = await make_workspace_diff(rollout_dir)
    except (RollcageError, OSError, ValueError) as exc:
        problem = _not_made(rollout_dir, exc)
        data = f"# {problem}\n".encode()
    return await asyncio.to_thread(_publish, rollout_dir, data, problem)


def _write_without_image(rollout_dir: Path) -> tuple[bool, DiffWritten]:
    """Blocking: publish the diff of a rollout without an image; (whether it was one, what was published).

    ``(False, nothing)`` for an image rollout, left to :func:`make_workspace_diff` on the loop.
    """
    if not _plain_dir(rollout_dir):
        return True, _NOTHING
    problem: str | None = None
    try:
        if read_image_info(rollout_dir) is not None:
            return False, _NOTHING
        data = _diff_without_image(rollout_dir / "workspace")
    except (RollcageError, OSError, ValueError) as exc:
        problem = _not_made(rollout_dir, exc)
        data = f"# {problem}\n".encode()
    return True, _publish(rollout_dir, data, problem)


def _diff_without_image(workspace: Path) -> bytes:
    """The ``workspace.diff`` of a rollout without an image (blocking)."""
    if not _plain_dir(workspace):
        return b"# no workspace directory: nothing to diff\n"
    head = b"# the final workspace against the empty workspace the rollout started from\n"
    return head + file_level_diff(workspace, None, overlay=False)


def _not_made(rollout_dir: Path, exc: BaseException) -> str:
    problem = f"workspace.diff could not be made: {type(exc).__name__}: {exc}"[:2000]
    logger.warning("rollout %s: %s", rollout_dir.name, problem)
    return problem


def _publish(rollout_dir: Path, data: bytes, problem: str | None) -> DiffWritten:
    """Publish ``data`` as the rollout's ``workspace.diff``, unsynced (blocking); its seal and the problem."""
    try:
        # Unsynced: the record's synced append holds the seal that tells a torn file (module docstring).
        publish_bytes(rollout_dir / WORKSPACE_DIFF, data, mode=0o644, sync=False)
    except OSError as exc:
        problem = f"workspace.diff could not be written: {exc}"
        logger.warning("rollout %s: %s", rollout_dir.name, problem)
        return DiffWritten(None, problem)
    return DiffWritten(FileSeal.of(data), problem)
