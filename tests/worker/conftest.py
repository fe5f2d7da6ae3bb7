"""Fixtures shared by the worker's test modules."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.worker_env import RolloutDir


@pytest.fixture
def rollout(tmp_path: Path) -> Iterator[RolloutDir]:
    """A rollout directory for one worker; its worker, if still running, is killed at teardown."""
    rd = RolloutDir(tmp_path / "rollout")
    try:
        yield rd
    finally:
        rd.kill()
