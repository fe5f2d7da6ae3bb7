"""A fresh root from an image and a rollout's changes, and the bounded cage a command runs in there."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rollcage.cage import ContainedRun, RunLimits
from rollcage.controller._fresh_root import FRESH_UID, ChangesError, fresh_root, run_in_root
from rollcage.errors import SandboxError
from tests.helpers.image_rollouts import make_image, needs_root

pytestmark = needs_root


def _run(root: Path, command: str, **limits: int) -> ContainedRun:
    return asyncio.run(
        run_in_root(
            root,
            command,
            cwd="/testbed",
            env={"PATH": "/usr/bin:/bin", "ONLY": "this"},
            timeout_s=60,
            limits=RunLimits(**limits) if limits else None,
        )
    )


def test_the_command_runs_as_the_image_says_with_no_network_and_no_host(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", {"a.txt": "from the image\n"})
    (tmp_path / "changes").mkdir()
    with fresh_root(image.root, tmp_path / "changes", tmp_path / "scratch", size_bytes=64 << 20) as root:
        run = _run(root.path, "pwd; env | sort; cat a.txt; cat /proc/net/dev; ls /home /work 2>&1; id -u")
    out = run.stdout.decode()
    assert out.startswith("/testbed\n")
    assert "ONLY=this" in out and "HOME=" not in out
    assert "from the image" in out
    assert "lo:" in out and "eth" not in out  # a network namespace of its own: loopback only
    assert "No such file or directory" in out  # nothing of the host beyond the image
    assert out.rstrip().endswith(str(FRESH_UID))


def test_processes_and_output_are_bounded(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", {})
    (tmp_path / "changes").mkdir()
    with fresh_root(image.root, tmp_path / "changes", tmp_path / "scratch", size_bytes=64 << 20) as root:
        forks = _run(root.path, "for i in $(seq 40); do sleep 30 & done; wait", max_processes=12)
        flood = _run(root.path, "yes | head -c 3000000", output_limit=100_000)
    assert forks.exit_code != 0 or b"can't fork" in forks.stderr
    assert b"fork" in forks.stderr.lower()
    assert flood.truncated and len(flood.stdout) == 100_000


def test_an_image_without_a_shell_is_a_sandbox_error_not_a_failed_command(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", {})
    os.unlink(image.root / "usr/bin/sh")
    (tmp_path / "changes").mkdir()
    with (
        fresh_root(image.root, tmp_path / "changes", tmp_path / "scratch", size_bytes=64 << 20) as root,
        pytest.raises(SandboxError, match="could not be made"),
    ):
        _run(root.path, "true")


def test_unusable_changes_are_refused(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", {})
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "changes").symlink_to(tmp_path / "elsewhere")
    with (
        pytest.raises(ChangesError, match="cannot be read"),
        fresh_root(image.root, tmp_path / "changes", tmp_path / "scratch", size_bytes=64 << 20),
    ):
        pass
    (tmp_path / "big").mkdir()
    (tmp_path / "big/blob").write_bytes(os.urandom(2 << 20))
    with (
        pytest.raises(ChangesError, match="do not fit"),
        fresh_root(image.root, tmp_path / "big", tmp_path / "scratch2", size_bytes=1 << 20),
    ):
        pass
    assert not (tmp_path / "scratch").exists() and not (tmp_path / "scratch2").exists()
