"""Where a rollout's files are made: its artifacts on the rollout directory's disk, the rest off it.

A rollout under bubblewrap stages the worker's view (the rewritten ``input.json``, the
``/rollout`` directory and the mount points bubblewrap makes in it) and the proxy socket
in the supervisor's private directory, on a memory file system where there is one with
room (``budgets.private_parent``). The rollout directory gets its artifacts and, while it
runs, only ``.sandbox/token`` and ``.sandbox/budgets.json``: what a later run needs after
a killed supervisor. Files made and removed there per rollout are work for its disk (on
ext4 without a journal, each freed inode slows every later creation near it for a minute).
And few: a prepared workspace is copied into its bounded file system once, from under the
mount, and back at the end into the same directory, writing only what the agent changed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.budgets import _rollout as budgets
from rollcage.budgets import copy_tree
from rollcage.policy import PolicyServer
from rollcage.runfiles import RolloutLayout
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import config, fake, gone_mount_source, make_rollout, requires_bwrap
from tests.helpers.waiting import wait_for_async

ARTIFACTS = {
    "input.json",
    "checkpoint.jsonl",
    "model_capture.jsonl",
    "worker.log",
    "result.json",
    "receipt.json",
}
"""What a rollout leaves in its directory besides ``workspace/`` (DESIGN.md's names)."""


@pytest.fixture
def memory_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment asks for no temporary directory: the private directories' default place applies."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        monkeypatch.delenv(name, raising=False)


def _on_memory_fs() -> bool:
    return budgets.private_parent() == budgets.MEMORY_DIR


@requires_bwrap()
@pytest.mark.bwrap
@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["warm", "cold"])
async def test_the_workers_view_is_staged_off_the_rollout_directory(
    tmp_path: Path, memory_choice: None, start: str
) -> None:
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        root = make_rollout(tmp_path, model_url=server.base_url)
        stop = asyncio.Event()
        settings = SupervisorConfig(deadline_s=120, grace_s=10, sandbox=BwrapSandbox(worker_start=start))  # type: ignore[arg-type]
        task = asyncio.ensure_future(supervise(root, settings, stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            # While the worker runs: in R, only the crash-recovery anchor besides the artifacts.
            assert sorted(os.listdir(root / ".sandbox")) == ["budgets.json", "token"]
            private = Path(json.loads((root / ".sandbox" / "budgets.json").read_text())["private_dir"])
            assert private.parent == Path(budgets.private_parent())
            assert {"input.json", "root", "proxy.sock"} <= set(os.listdir(private))
            # bubblewrap's mount points for /rollout's files are made in the staged view, not in R.
            assert {"input.json", "checkpoint.jsonl", "workspace"} <= set(os.listdir(private / "root"))
            if _on_memory_fs():
                assert os.stat(private).st_dev != os.stat(root).st_dev
        finally:
            stop.set()
            receipt = await task
    assert receipt.outcome == "cancelled" and receipt.result_valid, receipt.outcome_reason
    # The result was copied out of the staged view; the view and the private directory are gone.
    assert json.loads((root / "result.json").read_text())["error"]["kind"] == "cancelled"
    assert set(os.listdir(root)) == ARTIFACTS | {"workspace"}
    assert private.name not in os.listdir(private.parent)


@requires_bwrap()
@pytest.mark.bwrap
@pytest.mark.timeout(60)
async def test_the_prepared_workspace_is_what_the_worker_finds_under_its_bounded_file_system(
    tmp_path: Path,
) -> None:
    root = make_rollout(tmp_path)
    (root / "workspace" / "task.txt").write_text("the task")
    (root / "workspace" / "sub").mkdir()
    (root / "workspace" / "sub" / "data.csv").write_text("a,b\n")
    (root / "workspace" / "host-file").symlink_to("/etc/hostname")
    inodes = {name: os.stat(root / "workspace" / name).st_ino for name in ("task.txt", "sub/data.csv")}
    receipt = await supervise(root, config("bwrap", *fake("inventory")))
    assert receipt.outcome == "completed", receipt.outcome_reason
    seen = json.loads((root / "workspace" / "inventory.json").read_text())
    # Copied in (a link stays a link, never the host file it names), nothing else beside it.
    assert seen == {
        "host-file": "link:/etc/hostname",
        "sub": "dir",
        "sub/data.csv": "file:a,b\n",
        "task.txt": "file:the task",
    }
    mechanism = {use.budget: use.mechanism for use in receipt.budgets}["workspace_bytes"]
    assert mechanism == ("tmpfs" if os.geteuid() == 0 else "poll")
    # And back on the disk at the end, with what the worker wrote; what it left alone is the file
    # the controller prepared, not a copy of it.
    assert (root / "workspace" / "task.txt").read_text() == "the task"
    assert os.readlink(root / "workspace" / "host-file") == "/etc/hostname"
    if mechanism == "tmpfs":
        assert {name: os.stat(root / "workspace" / name).st_ino for name in inodes} == inodes


def _tree(top: Path) -> dict[str, str]:
    """Each entry under ``top``: kind, mode bits and content (links as links)."""
    found = {}
    for path in sorted(top.rglob("*")):
        rel, info = str(path.relative_to(top)), path.lstat()
        if path.is_symlink():
            found[rel] = "link " + os.readlink(path)
        elif path.is_dir():
            found[rel] = f"dir {info.st_mode & 0o7777:o}"
        else:
            found[rel] = f"file {info.st_mode & 0o7777:o} {path.read_text()}"
    return found


def test_a_tree_copied_back_over_its_original_writes_only_what_changed(tmp_path: Path) -> None:
    original, source, fresh = tmp_path / "original", tmp_path / "source", tmp_path / "fresh"
    for top in (original, source, fresh):
        top.mkdir()
    outside = tmp_path / "outside.txt"
    outside.write_text("shared")
    for name, text in [("same.txt", "a"), ("changed.txt", "old"), ("gone.txt", "x"), ("kind", "file")]:
        (original / name).write_text(text)
    (original / "gone-dir").mkdir()
    (original / "gone-dir" / "f").write_text("f")
    (original / "link").symlink_to("/etc/passwd")
    os.link(outside, original / "shared.txt")  # another name of a file outside: never written through
    # What the agent left: one file as it was, others changed, added, replaced by another kind.
    (source / "same.txt").write_text("a")
    (source / "changed.txt").write_text("new, longer")
    (source / "kind").mkdir()
    (source / "kind" / "inner").write_text("i")
    (source / "link").symlink_to("/etc/hostname")
    (source / "shared.txt").write_text("mine")
    (source / "suid").write_text("s")
    (source / "suid").chmod(0o4755)
    (source / "h1").write_text("h")
    os.link(source / "h1", source / "h2")
    os.mkfifo(source / "fifo")
    kept, rewritten = (os.stat(original / name).st_ino for name in ("same.txt", "changed.txt"))
    into = os.open(original, os.O_RDONLY | os.O_DIRECTORY)
    try:
        report = copy_tree(source, into, max_bytes=1 << 20, max_inodes=100)
    finally:
        os.close(into)
    copy_tree(source, fresh, max_bytes=1 << 20, max_inodes=100)
    # The same tree as a copy into an empty directory...
    assert _tree(original) == _tree(fresh)
    assert any("fifo" in skipped for skipped in report.skipped)
    # ...made with what was there: the unchanged file kept, the changed one rewritten in place.
    assert os.stat(original / "same.txt").st_ino == kept
    assert os.stat(original / "changed.txt").st_ino == rewritten
    assert outside.read_text() == "shared" and (original / "shared.txt").read_text() == "mine"
    assert os.stat(original / "h1").st_ino == os.stat(original / "h2").st_ino


def test_a_tree_copied_back_keeps_to_its_bounds_and_leaves_nothing_stale(tmp_path: Path) -> None:
    original, source = tmp_path / "original", tmp_path / "source"
    original.mkdir()
    source.mkdir()
    (original / "big.bin").write_bytes(b"x" * 10)
    (source / "big.bin").write_bytes(b"y" * 5000)  # grew past the bound: not kept in its old form either
    (source / "small.txt").write_text("s")
    report = copy_tree(source, original, max_bytes=4096, max_inodes=100)
    assert sorted(os.listdir(original)) == ["small.txt"]
    assert any(skipped.startswith("big.bin") for skipped in report.skipped)
    (source / "more").mkdir()
    report = copy_tree(source, original, max_bytes=1 << 20, max_inodes=2)
    assert len(os.listdir(original)) == 2 and any("entries" in skipped for skipped in report.skipped)


@pytest.fixture
def mount_point() -> Iterator[Path]:
    """An empty directory to mount a tmpfs on (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="rc-mem-"))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], stderr=subprocess.DEVNULL, check=False)
        where.rmdir()


def test_private_directories_go_to_a_roomy_memory_fs_unless_the_user_chose(
    mount_point: Path, memory_choice: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets, "MEMORY_DIR", str(mount_point))
    temp = tempfile.gettempdir()
    # Not a memory file system (a directory on the disk): the temporary directory.
    assert budgets.private_parent() == temp
    # A tmpfs with too little room (a container's /dev/shm): the temporary directory.
    monkeypatch.setattr(budgets, "_tmpfs_seen", {})
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "rc-small", str(mount_point)], check=True)
    assert budgets.private_parent() == temp
    # Room enough (a tmpfs's size is a bound, nothing is taken): there.
    subprocess.run(["mount", "-o", "remount,size=2g", str(mount_point)], check=True)
    assert budgets.private_parent() == str(mount_point)
    # A temporary directory asked for in the environment wins.
    monkeypatch.setenv("TMPDIR", temp)
    assert budgets.private_parent() == temp


def test_a_gone_supervisors_private_directory_on_the_memory_fs_is_swept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets, "MEMORY_DIR", str(tmp_path))
    private = tmp_path / "rollcage-r1-1.999999999-abc123"
    (private / "root" / "workspace").mkdir(parents=True)
    (private / "root" / "result.json").write_text("{}")
    (private / "input.json").write_text("{}")
    (private / "rollout.json").write_text(json.dumps({"private_dir": str(private)}))
    monkeypatch.setattr(budgets, "_swept", False)  # once per process: this test's sweep is a new one
    budgets.sweep_orphans()
    assert not private.exists()


def test_a_copy_back_cut_short_is_redone_from_the_mount_by_the_next_run(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = make_rollout(tmp_path)
    workspace = root / "workspace"
    for name in ("kept.txt", "changed.txt", "deleted.txt"):
        (workspace / name).write_text("prepared")
    under = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    # Named as a supervisor that is gone names its mounts: only such a mount is released.
    source = gone_mount_source()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", source, str(workspace)], check=True)
    try:
        # What the agent left in its bounded workspace.
        (workspace / "kept.txt").write_text("prepared")
        (workspace / "changed.txt").write_text("the agent's")
        (workspace / "new.txt").write_text("the agent's")
        # The supervisor was killed one entry into copying it back into the prepared workspace.
        copy_tree(workspace, under, max_bytes=1 << 20, max_inodes=1)
        (root / ".sandbox").mkdir()
        record = {"mounts": [str(workspace)], "workspace_bounds": [1 << 20, 100], "owner": None}
        (root / ".sandbox" / "budgets.json").write_text(json.dumps(record))
        budgets.release_leftovers(RolloutLayout(root))
        released = not os.path.ismount(workspace)
    finally:
        os.close(under)
        subprocess.run(["umount", "-l", str(workspace)], stderr=subprocess.DEVNULL, check=False)
    assert released, "the mount was left"
    assert {path.name: path.read_text() for path in workspace.iterdir()} == {
        "changed.txt": "the agent's",
        "kept.txt": "prepared",
        "new.txt": "the agent's",
    }


def _tree(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): p.read_text() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "state",
    [
        "copies of an earlier try",
        "complete copy, mount gone",
        "workspace set aside",
        "replaced one left",
        "done",
    ],
)
def test_a_settle_killed_at_any_step_is_carried_on_by_the_next_one(tmp_path: Path, state: str) -> None:
    """Whatever step a killed sweeper reached, the next one ends with the agent's files in place."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    from rollcage.budgets import settle_workspace

    root = make_rollout(tmp_path)
    workspace, staging = root / "workspace", root / ".sandbox"
    (workspace / "prepared.txt").write_text("prepared")
    agent = {"prepared.txt": "changed by the agent", "sub/new.txt": "the agent's"}
    staging.mkdir()

    def lay(directory: Path, files: dict[str, str]) -> None:
        for name, text in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text)

    if state == "copies of an earlier try":
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", gone_mount_source(), str(workspace)], check=True
        )
        lay(workspace, agent)
        lay(staging / "workspace-partial-abc", {"prepared.txt": "torn"})
        lay(staging / "workspace-settled", {"stale.txt": "an older copy"})
    elif state == "complete copy, mount gone":
        lay(staging / "workspace-settled", agent)
    elif state == "workspace set aside":
        workspace.rename(staging / "workspace-replaced")
        lay(staging / "workspace-settled", agent)
    else:
        lay(
            staging / "workspace-replaced", {"prepared.txt": "prepared"}
        ) if state == "replaced one left" else None
        (workspace / "prepared.txt").unlink()
        lay(workspace, agent)
    try:
        settle_workspace(root, wait=True)
        assert settle_workspace(root, wait=True) == "nothing"  # a second sweeper finds it done
    finally:
        subprocess.run(["umount", "-l", str(workspace)], stderr=subprocess.DEVNULL, check=False)
    assert not os.path.ismount(workspace)
    assert _tree(workspace) == agent
    assert not [p.name for p in staging.iterdir()]
