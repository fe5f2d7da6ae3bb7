"""What the gym sandbox tests share: a state directory the sandbox's uid can reach, and a small image."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.supervisor.imageroot import release_image_root
from tests.helpers.task_images import TaskImage, make_task_image


@pytest.fixture
def state() -> Iterator[Path]:
    """A state directory the sandbox's uid can pass through (pytest's own are 0700)."""
    directory = Path(tempfile.mkdtemp(prefix="rollcage-gym-test-", dir="/tmp"))
    os.chmod(directory, 0o711)
    try:
        yield directory
    finally:
        # Whatever a failed test left mounted is released before the directory goes.
        for sandbox in directory.iterdir():
            release_image_root(sandbox)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def image(tmp_path: Path) -> TaskImage:
    """A small task image (busybox's applets and the host's bash, no python3)."""
    return make_task_image(tmp_path / "image", python=False)
