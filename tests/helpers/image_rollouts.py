"""Image rollouts made by hand, as the controller leaves them: ``image.json`` and ``changes/``.

An image here is a ``dir:`` root holding busybox-static (its shell and applets) and, where asked,
a git repository made with the host's git at the image's working directory. An "agent session"
runs a shell script as the agent would, in a real copy-on-write root of that image
(``rollcage.images.cow_root`` and bubblewrap); its overlay upper becomes the rollout's
``changes/`` (so whiteouts and opaque directories are the kernel's own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollcage.images import ImageStore, PreparedImage, cow_root

WORKDIR = "/testbed"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting an overlay needs root")


def busybox() -> str:
    path = shutil.which("busybox")
    if path is None:
        pytest.skip("busybox is not installed (scripts/system-deps test installs busybox-static)")
    return path


def bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        pytest.skip("bubblewrap is not installed")
    return path


def make_image(root: Path, files: dict[str, str | bytes], *, git: bool = False) -> PreparedImage:
    """A ``dir:`` image: busybox as /bin/sh, ``files`` under the working directory, a repo if ``git``."""
    (root / "usr/bin").mkdir(parents=True)
    shutil.copy2(busybox(), root / "usr/bin/busybox")
    os.symlink("busybox", root / "usr/bin/sh")
    os.symlink("usr/bin", root / "bin")
    for name in ("etc", "tmp", "proc", "dev"):
        (root / name).mkdir()
    (root / "tmp").chmod(0o1777)
    (root / "etc/hostname").write_text("image\n")
    work = root / WORKDIR.lstrip("/")
    work.mkdir()
    for name, content in files.items():
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    if git:
        if shutil.which("git") is None:
            pytest.skip("git is not installed")
        ident = ["-c", "user.name=t", "-c", "user.email=t@t.invalid", "-c", "init.defaultBranch=main"]
        for argv in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the task's commit"]):
            subprocess.run(["git", *ident, *argv], cwd=work, check=True, capture_output=True, timeout=60)
    return ImageStore(root.parent / "store").prepare(f"dir:{root}")


@dataclass
class LiveRoot:
    """An agent's root still mounted, with a process perhaps still running in it."""

    path: Path
    process: subprocess.Popen[bytes] | None = None


def _in_root(root: Path, script: str) -> list[str]:
    return [
        bwrap(),
        "--bind",
        str(root),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--unshare-all",
        "--die-with-parent",
        "--chdir",
        WORKDIR,
        "/bin/sh",
        "-c",
        script,
    ]


def write_image_json(rollout_dir: Path, image: PreparedImage, user: str | None = None) -> None:
    """``image.json`` as the controller writes it (the contract between i1 and i2)."""
    info = {
        "ref": image.ref,
        "digest": image.manifest_digest,
        "root": str(image.root),
        "working_dir": WORKDIR,
        "env": ["PATH=/usr/bin:/bin", "TASK_ENV=from-the-image"],
        "user": user,
    }
    (rollout_dir / "image.json").write_text(json.dumps(info))


@contextmanager
def agent_session(
    image: PreparedImage,
    rollout_dir: Path,
    script: str,
    *,
    linger: str | None = None,
    user: str | None = None,
) -> Iterator[LiveRoot]:
    """Run ``script`` as the agent in a copy-on-write root of ``image``; its upper is ``changes/``.

    ``linger``: a command left running in the agent's root while the block runs (stopped after).
    """
    rollout_dir.mkdir(parents=True, exist_ok=True)
    write_image_json(rollout_dir, image, user)
    root = cow_root(image, rollout_dir / "overlay", rollout_dir / "root")
    process = None
    try:
        done = subprocess.run(_in_root(root.path, script), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        # The upper becomes changes/ while still mounted: a lingering process writes on into it.
        os.rename(root.upper, rollout_dir / "changes")
        if linger is not None:
            process = subprocess.Popen(_in_root(root.path, linger), stdout=subprocess.PIPE)
        yield LiveRoot(root.path, process)
    finally:
        if process is not None:
            process.kill()
            process.communicate()
        root.remove()
