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


_NO_SKIPS_ENV = "ROLLCAGE_TEST_NO_SKIPS"
_OPTIONAL = "optional:"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under ``make test`` (which installs every system package the suite needs), a skip is a failure.

    A test that skips because bubblewrap or chromium is missing would otherwise turn a broken set-up
    into a green run. Skips whose reason starts with ``optional:`` (a capability this machine kind
    may lack by design) are allowed.
    """
    import os

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get(_NO_SKIPS_ENV) != "1" or reporter is None:
        return
    unexpected = []
    for report in reporter.stats.get("skipped", []):
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if not reason.startswith(_OPTIONAL):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        reporter.write_sep("=", f"{len(unexpected)} unexpected skip(s) ({_NO_SKIPS_ENV}=1)", red=True)
        for line in unexpected[:50]:
            reporter.write_line(line)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


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
