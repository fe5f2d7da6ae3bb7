"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import warnings
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


_CANCEL_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _fresh_cancel_signals() -> list[str]:
    """Put SIGINT and SIGTERM back as a fresh interpreter has them; what was otherwise, in words."""
    changed = []
    blocked = signal.pthread_sigmask(signal.SIG_UNBLOCK, _CANCEL_SIGNALS)
    for signum in _CANCEL_SIGNALS:
        if signum in blocked:
            changed.append(f"{signum.name} blocked")
        if signal.getsignal(signum) is signal.SIG_IGN:
            changed.append(f"{signum.name} ignored")
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    return changed


@pytest.fixture(autouse=True)
def _cancel_signals_as_fresh(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts with SIGINT and SIGTERM deliverable, and one that leaves them otherwise is named.

    Every process a test starts inherits this one's ignored signals and blocked mask (``exec``
    keeps both). The suite started as a background job of a non-interactive shell (``make test
    &`` in a script) has SIGINT ignored from the start, and so would every shell a test
    interrupts and every sandboxed process it stops by SIGINT: those tests would fail for the
    way the suite was launched. A test, or code it runs in this process, that leaves them so
    would do the same to every later test on its xdist worker. Put back before and after each
    test; a warning says when, and after which test.
    """
    before = _fresh_cancel_signals()
    if before:
        warnings.warn(f"before {request.node.nodeid}: {', '.join(before)} (put back)", stacklevel=1)
    yield
    after = _fresh_cancel_signals()
    if after:
        warnings.warn(f"{request.node.nodeid} left {', '.join(after)} (put back)", stacklevel=1)


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
