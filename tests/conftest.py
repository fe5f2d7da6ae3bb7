"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.policy import PolicyServer


@pytest.fixture
def serve_policy(request: pytest.FixtureRequest) -> Iterator[Callable[..., PolicyServer]]:
    """Start scripted policy servers on demand; every one is stopped at teardown, pass or fail.

    ``serve_policy(script, **options)`` takes a script (mapping, file or ``PolicyScript``);
    without one it plays the test module's ``SCRIPT``.
    """
    servers: list[PolicyServer] = []

    def start(script: Any = None, **options: Any) -> PolicyServer:
        server = PolicyServer(script if script is not None else request.module.SCRIPT, **options)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 16 KiB tmpfs mounted for the test (needs root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None:
        pytest.skip("mount/umount are not installed")
    directory = tmp_path / "tiny"
    directory.mkdir()
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run([umount, str(directory)], capture_output=True).returncode != 0:
            subprocess.run([umount, "-l", str(directory)], check=False)
