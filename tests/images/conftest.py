"""Fixtures of the image-store tests: one real local registry for the session, a fresh store per test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.images import ImageStore
from tests.helpers.oci import Registry


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """Debian's docker-registry on a loopback port, stopped at the end of the session."""
    if shutil.which("docker-registry") is None:
        pytest.skip("docker-registry is not installed (scripts/system-deps test installs it)")
    server = Registry(tmp_path_factory.mktemp("registry"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")
