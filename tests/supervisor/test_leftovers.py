"""Nothing of a rollout is left in the temporary directory: after its end, nor after its supervisor's death.

A supervisor makes a private directory per rollout (``rollcage-ROLLOUT-PID.START-*``:
the proxy socket, the mount points of bounded file systems, a record of what it made).
A finished rollout removes it; what a supervisor that is gone left is removed by the
next one's sweep, by the owner in the name, and only what is known to be there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.budgets import _rollout as budgets
from rollcage.policy import PolicyServer
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import make_rollout, requires_bwrap

GONE = "1.999999999"
"""An owner tag whose process is gone (PID 1 started long before that many ticks)."""


@pytest.fixture
def temp_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The temporary directory the code under test uses: this test's alone (short: a socket goes in it).

    Asked for in the environment, as a user would: the private directories go there, not to the
    memory file system (``test_staging`` covers that choice).
    """
    directory = Path(tempfile.mkdtemp(prefix="rc-"))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.setenv("TMPDIR", str(directory))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@requires_bwrap()
@pytest.mark.bwrap
@pytest.mark.parametrize("start", ["warm", "cold"])
async def test_a_finished_rollout_leaves_nothing_in_the_temporary_directory(
    tmp_path: Path, temp_dir: Path, start: str
) -> None:
    with PolicyServer({"tasks": {"t": [{"text": "done"}]}}, port=0) as server:
        root = make_rollout(tmp_path, model_url=server.base_url)
        config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start=start))  # type: ignore[arg-type]
        receipt = await supervise(root, config)
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.cleanup_confirmed
    assert sorted(os.listdir(temp_dir)) == []


def _left(temp_dir: Path, owner: str, name: str = "r1") -> Path:
    """A private directory as a supervisor killed mid-rollout leaves it."""
    private = temp_dir / f"rollcage-{name}-{owner}-abc123"
    (private / "fs" / "tmp").mkdir(parents=True)
    (private / "fs" / "shm").mkdir()
    (private / "rollout.json").write_text(json.dumps({"private_dir": str(private)}))
    (private / "workspace-initial").mkdir()
    (private / "workspace-initial" / "task.txt").write_text("a copy of the prepared workspace")
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(private / "proxy.sock"))
    return private


def test_what_a_gone_supervisor_left_in_the_temporary_directory_is_swept(
    temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gone = _left(temp_dir, GONE)
    unknown = _left(temp_dir, GONE, "r2")
    (unknown / "fs" / "tmp" / "evidence").write_text("not ours to judge")
    alive = _left(temp_dir, budgets.owner_tag(), "r3")
    stranger = temp_dir / f"rollcage-not-a-private-dir-{GONE}"
    stranger.write_text("a file, not a directory")
    monkeypatch.setattr(budgets, "_swept", False)  # once per process: this test's sweep is a new one
    budgets.sweep_orphans()
    assert not gone.exists()
    # Only what is known to be there goes: a file found in it keeps the directory and its path.
    assert (unknown / "fs" / "tmp" / "evidence").exists()
    assert not (unknown / "rollout.json").exists()
    kept = ["fs", "proxy.sock", "rollout.json", "workspace-initial"]
    assert sorted(p.name for p in alive.iterdir()) == kept
    assert stranger.read_text() == "a file, not a directory"


@requires_bwrap()
@pytest.mark.bwrap
@pytest.mark.parametrize("temp_length", [0, 40, 70, 120])
async def test_a_long_rollout_id_leaves_the_proxy_socket_path_short_enough(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, temp_length: int
) -> None:
    """The private directory's name carries the rollout id and the owner tag; the socket in it must bind.

    Under any temporary directory: a Ray node's is ``/tmp/ray-.../node/tmp``-long, and a user's may
    be longer than a socket's path can be (0: none asked for, the memory file system).
    """
    monkeypatch.delenv("TMPDIR", raising=False)  # the memory file system, where the machine has one
    top = Path(tempfile.mkdtemp(prefix="rc-"))
    try:
        if temp_length:
            deep = top / ("d" * max(1, temp_length - len(str(top)) - 1))
            deep.mkdir()
            monkeypatch.setenv("TMPDIR", str(deep))
            monkeypatch.setattr(tempfile, "tempdir", str(deep))
        await _supervise_a_long_rollout_id(tmp_path)
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def _supervise_a_long_rollout_id(tmp_path: Path) -> None:
    name = "t" * 90 + "-s0-t12"
    with PolicyServer({"tasks": {"t": [{"text": "done"}]}}, port=0) as server:
        root = make_rollout(tmp_path, name, model_url=server.base_url)
        receipt = await supervise(root, SupervisorConfig(deadline_s=120))
    assert receipt.outcome == "completed", receipt.outcome_reason
