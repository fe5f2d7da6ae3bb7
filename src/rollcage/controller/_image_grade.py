"""The ``tests`` grader: the task's own tests, in a fresh root made from the image and the agent's changes.

Never in the agent's live cage: the rollout directory's ``image.json`` names the image's unpacked
root, its ``WorkingDir`` and ``Env``; ``changes/`` is what the rollout wrote. Grading copies
``changes/`` and mounts a new overlay (the copy over the image, a scratch upper on a bounded
tmpfs) and runs ``command`` there with ``/bin/sh -c`` in a cage of its own
(``run_in_root`` (``rollcage.controller._fresh_root``), which is ``rollcage.cage.run_contained`` over
that root): no network, an unprivileged uid leased for this grade alone (so its process budget is
its own, ``lease_uid``), bounds on time, CPU, memory, processes, file size and output. Everything
is unmounted and removed afterwards.

The reward: with no ``junit_xml``, 1.0 when the command exits 0, else 0.0. With ``junit_xml``,
the file is read from the root after the command (never following a link) and parsed safely
(``rollcage.controller._junit``); with ``fail_to_pass``/``pass_to_pass`` the reward is 1.0 exactly
when every listed test passed, and the detail names those that failed and those the file does not
hold; without lists, 1.0 when the command exited 0 and no test in the file failed. A command that
runs past its timeout or out of memory failed the tests (0.0): the agent's changes made them so.

A grade that cannot be given (no ``image.json``, the image gone from the store, ``changes/``
unusable, no cage, a JUnit file that is a link, too large, or not plain JUnit XML) is
``reward=None`` with an ``error``: the rollout's ``grader_error``, never the policy's failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rollcage.cage import RunLimits
from rollcage.controller._fresh_root import FRESH_UID
from rollcage.controller._graders import GradeResult, TestsGrader
from rollcage.controller._junit import JUNIT_LIMIT, PASSING, JunitError, parse_junit
from rollcage.errors import RollcageError
from rollcage.procs import shielded

__all__ = ["GRADE_LIMITS", "ImageInfo", "grade_tests", "read_image_info", "safe_read"]

GRADE_LIMITS: Final = RunLimits(
    cpu_seconds=24 * 3600,  # the wall-clock timeout_s is the bound that matters
    memory_bytes=8 << 30,
    max_processes=512,
    file_size_bytes=4 << 30,
    open_files=4096,
    output_limit=1 << 20,
)
"""Bounds of a test command in a fresh root (its wall-clock bound is the grader's ``timeout_s``)."""
SCRATCH_BYTES: Final = 4 << 30
"""The tmpfs holding the copy of ``changes/`` and everything the test command writes."""
_IMAGE_JSON_LIMIT: Final = 1 << 20
_TAIL: Final = 4000
_LISTED: Final = 50


@dataclass(frozen=True)
class ImageInfo:
    """A rollout's ``image.json``: what its root was made from."""

    ref: str
    root: Path
    working_dir: str
    env: dict[str, str]
    user: str | None = None
    """The image's ``User`` (``name``, ``uid``, ``uid:gid``); ``None``: root."""

    def owner(self) -> int:
        """The uid of the image's user: what it owns in the image the grading command may change."""
        name = (self.user or "").partition(":")[0]
        if not name or name == "root":
            return 0
        if name.isdigit():
            return int(name) if int(name) < FRESH_UID else 0
        try:
            passwd = safe_read(self.root, "etc/passwd", _IMAGE_JSON_LIMIT) or b""
        except (OSError, ValueError):
            return 0
        for line in passwd.decode("utf-8", "replace").splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[0] == name and fields[2].isdigit() and int(fields[2]) < FRESH_UID:
                return int(fields[2])
        return 0


def read_image_info(rollout_dir: Path) -> ImageInfo | None:
    """The rollout's ``image.json``; ``None`` when it has none (it did not run in an image).

    Raises:
        ValueError: The file is there but unusable (not a regular file, too large, not the contract's shape).
    """
    data = safe_read(rollout_dir, "image.json", _IMAGE_JSON_LIMIT)
    if data is None:
        return None
    try:
        info = json.loads(data)
        root = Path(str(info["root"]))
        raw_env = info.get("env") or []
        pairs = (
            raw_env.items() if isinstance(raw_env, dict) else (str(e).partition("=")[::2] for e in raw_env)
        )
        env = {str(k): str(v) for k, v in pairs if k}
        working_dir = str(info.get("working_dir") or "/")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"image.json of {rollout_dir} is not the expected shape: {exc}") from exc
    if not root.is_absolute() or not working_dir.startswith("/"):
        raise ValueError(f"image.json of {rollout_dir}: root and working_dir must be absolute paths")
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    user = info.get("user")
    return ImageInfo(str(info.get("ref", "")), root, working_dir, env, str(user) if user else None)


def safe_read(base: Path, relative: str, limit: int) -> bytes | None:
    """A regular file under ``base``, opened without following any link, at most ``limit`` bytes.

    Returns ``None`` when a component is missing.

    Raises:
        ValueError: A component is a link or no directory, the file is not a regular file, or it is
            over ``limit`` bytes.
    """
    parts = [part for part in relative.split("/") if part not in ("", ".")]
    if not parts or ".." in parts:
        raise ValueError(f"{relative!r} is no path inside {base}")
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        for part in parts[:-1]:
            try:
                next_fd = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ValueError(f"{relative}: {part!r} is a link or no directory ({exc.strerror})") from exc
            os.close(fd)
            fd = next_fd
        try:
            file_fd = os.open(
                parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd
            )
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ValueError(
                f"{relative} cannot be opened without following a link ({exc.strerror})"
            ) from exc
    finally:
        os.close(fd)
    try:
        info = os.fstat(file_fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{relative} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{relative} is {info.st_size} bytes, over the {limit} byte limit")
        chunks = []
        size = 0
        while chunk := os.read(file_fd, 1 << 20):
            size += len(chunk)
            if size > limit:
                raise ValueError(f"{relative} grew over the {limit} byte limit")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(file_fd)


async def grade_tests(
    spec: TestsGrader, rollout_dir: Path, *, scratch_parent: Path | None = None
) -> GradeResult:
    """Grade one finished rollout with ``spec`` (see the module docstring).

    Args:
        spec: The grader.
        rollout_dir: The rollout directory (``image.json``, ``changes/``).
        scratch_parent: Where the fresh root's scratch directory is made; default the system's temp dir.

    **Cancellation:** the cage is killed and reaped and the fresh root unmounted and removed before
    the cancellation propagates.
    """
    from rollcage.controller._fresh_root import fresh_root, lease_uid, run_in_root

    detail: dict[str, Any] = {"name": "tests"}
    try:
        info = await asyncio.to_thread(read_image_info, rollout_dir)
    except (OSError, ValueError) as exc:
        return GradeResult(None, detail, f"the rollout's image.json cannot be read: {exc}")
    if info is None:
        return GradeResult(
            None, detail, "the rollout has no image.json: the tests grader grades rollouts run in an image"
        )
    detail["image"] = info.ref
    changes = rollout_dir / "changes"
    if changes.is_symlink() or not changes.is_dir():
        return GradeResult(None, detail, f"the rollout's changes {changes} are missing or no directory")
    owner = await asyncio.to_thread(info.owner)
    parent = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="rollcage-grade-", dir=scratch_parent))
    stack = contextlib.ExitStack()
    try:
        try:
            # A uid of its own: its process budget is never another grade's (lease_uid says why).
            uid = await shielded(asyncio.to_thread(stack.enter_context, lease_uid()))
            # Shielded: a mount made after a cancellation would be left behind.
            made = fresh_root(
                info.root, changes, parent / "scratch", size_bytes=SCRATCH_BYTES, owner=owner, uid=uid
            )
            root = await shielded(asyncio.to_thread(stack.enter_context, made))
            run = await run_in_root(
                root.path,
                spec.command,
                cwd=info.working_dir,
                env=info.env,
                timeout_s=spec.timeout_s,
                limits=GRADE_LIMITS,
                uid=uid,
            )
        except RollcageError as exc:
            return GradeResult(None, detail, f"the tests could not be run in the image: {exc}")
        detail.update(
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            memory_exceeded=run.memory_exceeded,
            output_tail=_tail(run.stdout, run.stderr),
        )
        if run.signal is not None:
            detail["signal"] = run.signal
        if spec.junit_xml is None:
            return GradeResult(1.0 if run.exit_code == 0 else 0.0, detail)
        try:
            data = await asyncio.to_thread(safe_read, root.path, spec.junit_xml, JUNIT_LIMIT)
        except (OSError, ValueError) as exc:
            return GradeResult(None, detail, f"the JUnit XML cannot be read: {exc}")
    finally:
        await shielded(asyncio.to_thread(_close, stack, parent))
    return await asyncio.to_thread(_junit_grade, spec, run.exit_code, data, detail)


def _close(stack: contextlib.ExitStack, parent: Path) -> None:
    try:
        stack.close()
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _junit_grade(
    spec: TestsGrader, exit_code: int | None, data: bytes | None, detail: dict[str, Any]
) -> GradeResult:
    listed = [*spec.fail_to_pass, *spec.pass_to_pass]
    if data is None:
        detail["junit"] = "not written"
        if listed:
            detail["missing"] = listed[:_LISTED]
            detail["missing_count"] = len(listed)
        return GradeResult(0.0, detail)
    try:
        report = parse_junit(data)
    except JunitError as exc:
        return GradeResult(None, detail, str(exc))
    if not listed:
        failed = [f"{cls}::{name}" for (cls, name), status in report.cases.items() if status == "failed"]
        detail.update(tests=len(report.cases), failed=failed[:_LISTED], failed_count=len(failed))
        return GradeResult(1.0 if exit_code == 0 and not failed else 0.0, detail)
    failed, missing = [], []
    for test in listed:
        status = report.status(test)
        if status is None:
            missing.append(test)
        elif status not in PASSING:
            failed.append(test)
    detail.update(
        fail_to_pass=len(spec.fail_to_pass),
        pass_to_pass=len(spec.pass_to_pass),
        failed=failed[:_LISTED],
        failed_count=len(failed),
        missing=missing[:_LISTED],
        missing_count=len(missing),
    )
    return GradeResult(0.0 if failed or missing else 1.0, detail)


def _tail(stdout: bytes, stderr: bytes) -> str:
    text = (stdout + b"\n" + stderr).decode("utf-8", "replace").strip()
    return text if len(text) <= _TAIL else "..." + text[-_TAIL:]
