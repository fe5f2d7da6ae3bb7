"""A disk that fills up while the workspace is copied back: the infrastructure's fault, the files kept.

The agent's workspace lives in a bounded tmpfs mounted on ``R/workspace`` while the
rollout runs, and is copied back onto the disk at its end. When the disk cannot take
it, the receipt says so (``infra_failure``, never the worker's protocol violation), and
the mount, which holds the only whole copy of the agent's files, stays mounted and
recorded, for the first rollcage process after this supervisor to copy back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.protocol import SupervisorReceipt
from tests.helpers.supervisor_env import HELPERS, fake, make_rollout, requires_bwrap

pytestmark = [requires_bwrap(), pytest.mark.bwrap]

SWEEP = "from rollcage.budgets import sweep_orphans; sweep_orphans()"


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 3 MiB file system (a tmpfs) for the rollout directory: 6 MiB of agent's files do not fit."""
    if os.geteuid() != 0:
        pytest.skip("only root mounts bounded workspaces (and a small disk for the test)")
    where = Path(tempfile.mkdtemp(prefix="rc-disk-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "rc-small-disk", str(where)], check=True)
    try:
        yield where
    finally:
        for point in (where / "r1" / "workspace", where):
            subprocess.run(["umount", "-l", str(point)], stderr=subprocess.DEVNULL, check=False)
        where.rmdir()


@pytest.mark.timeout(120)
def test_a_disk_full_during_the_copy_back_is_infrastructure_and_keeps_the_mount(small_disk: Path) -> None:
    root = make_rollout(small_disk)
    worker = " ".join(fake("fill", "/rollout/workspace/fill.bin", "6"))
    argv = [sys.executable, "-m", "rollcage", "supervise", str(root), "--worker-command", worker]
    argv += ["--ro-path", str(HELPERS), "--workspace-budget", "16M"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=90, check=False)
    receipt = SupervisorReceipt.model_validate_json((root / "receipt.json").read_bytes())
    assert done.returncode == 1 and receipt.outcome == "infra_failure", done.stdout + done.stderr
    assert "disk is full" in receipt.outcome_reason and "copied back" in receipt.outcome_reason
    assert "protocol violation" not in receipt.outcome_reason
    # The agent's files are in the mount, still mounted, and recorded for a later sweep.
    assert os.path.ismount(root / "workspace")
    assert (root / "workspace" / "fill.bin").stat().st_size == 6 << 20
    assert (root / ".sandbox" / "budgets.json").is_file()
    # Room again: the next rollcage process copies the workspace back, whole.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    subprocess.run([sys.executable, "-c", SWEEP], check=True, timeout=60)
    assert not os.path.ismount(root / "workspace")
    assert (root / "workspace" / "fill.bin").read_bytes() == b"x" * (6 << 20)
    assert not (root / ".sandbox" / "budgets.json").exists()
