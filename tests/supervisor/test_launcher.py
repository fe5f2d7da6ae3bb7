"""Cages start from a mount namespace without the other rollouts' mounts (``rollcage.cage._launch``).

As root, each rollout's bounded workspace is a tmpfs mounted on the host. A launch
made in the host's namespace copies all of them and reads them once per bind; the
launcher's launches see the host's mounts, less rollcage's tmpfs, plus their own,
bound at the same paths from detached copies. These tests hold each part of that: a
launch sees its own mount (the same file system as the host's) and not the others',
the host's later mounts reach later launches, a kernel that refuses the bind sends
launches the plain way, and a rollout's real bubblewrap is started so.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rollcage.budgets import mount_tmpfs, mount_tmpfs_with_copy, owner_tag, unmount
from rollcage.cage import PYTHON, Launcher, run_contained
from rollcage.cage import _launch as launch_module
from rollcage.policy import PolicyServer
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import wait_for, wait_for_async
from tests.helpers.worker_env import worker_input

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root mounts on the host and makes namespaces")

MIB = 1 << 20


Mounter = Callable[[Path, str], "int | None"]


@pytest.fixture
def mounts() -> Iterator[Mounter]:
    """Mount a small tmpfs at a path with a source (``rollcage-...``: a detached copy is returned)."""
    made: list[tuple[Path, int | None]] = []

    def mount(path: Path, source: str) -> int | None:
        path.mkdir(parents=True, exist_ok=True)
        if source.startswith("rollcage-"):
            copy: int | None = mount_tmpfs_with_copy(path, size=MIB, inodes=64, uid=0, gid=0, source=source)
        else:
            copy = None
            mount_tmpfs(path, size=MIB, inodes=64, uid=0, gid=0, source=source)
        made.append((path, copy))
        return copy

    try:
        yield mount
    finally:
        for path, copy in reversed(made):
            if copy is not None:
                os.close(copy)
            with contextlib.suppress(OSError):
                unmount(path)


@pytest.fixture
def make_launcher() -> Iterator[Callable[[], Launcher]]:
    """New launchers (not the process's own), each closed at the end."""
    made: list[Launcher] = []

    def make() -> Launcher:
        made.append(Launcher())
        return made[-1]

    try:
        yield make
    finally:
        for launcher in made:
            launcher.close()


def _launch(launcher: Launcher, script: str, binds: list[tuple[int, str]] | None) -> str:
    """Run ``sh -c script`` through the launcher; its standard output."""

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(["sh", "-c", script], stdout=subprocess.PIPE, text=True, cwd="/")

    proc = launcher.run(start, binds, timeout_s=60, late=lambda late: late.kill())
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return out


def _points(mountinfo: str) -> set[str]:
    """The mount points of the ``mountinfo`` lines in a text."""
    return {line.split()[4] for line in mountinfo.splitlines() if " - " in line}


def test_a_launch_sees_its_own_mount_and_none_of_the_other_rollouts(
    tmp_path: Path, mounts: Mounter, make_launcher: Callable[[], Launcher]
) -> None:
    # Other rollouts' workspaces in flight (mountinfo escapes the odd characters of one's path).
    other, odd, mine = tmp_path / "other", tmp_path / "odd \\ path\tx", tmp_path / "mine"
    mounts(other, f"rollcage-{owner_tag()}")
    mounts(odd, f"rollcage-{owner_tag()}")
    copy = mounts(mine, "rollcage-1.3")
    assert copy is not None
    (mine / "hello").write_text("from the host")
    launcher = make_launcher()
    script = f"cat /proc/self/mountinfo; cat {mine}/hello; echo back > {mine}/back"
    out = _launch(launcher, script, [(copy, str(mine))])
    assert launcher.plain_reason is None, launcher.plain_reason
    seen = _points(out)
    assert str(mine) in seen and str(other) not in seen
    escaped = str(tmp_path / "odd\\040\\134\\040path\\011x")
    assert escaped not in seen, seen
    assert out.endswith("from the host")
    # The same file system as the host's mount: what the launch writes is on the host.
    assert (mine / "back").read_text() == "back\n"
    # And the host's own table is as it was.
    with open("/proc/self/mountinfo", encoding="utf-8") as file:
        assert {str(other), escaped, str(mine)} <= _points(file.read())


def test_the_host_s_later_mounts_reach_later_launches(
    tmp_path: Path, mounts: Mounter, make_launcher: Callable[[], Launcher]
) -> None:
    launcher = make_launcher()
    later = tmp_path / "later"
    assert str(later) not in _points(_launch(launcher, "cat /proc/self/mountinfo", []))
    mounts(later, "elsewhere")  # a mount of someone else's, made while launches go on
    assert str(later) in _points(_launch(launcher, "cat /proc/self/mountinfo", []))
    unmount(later)
    assert str(later) not in _points(_launch(launcher, "cat /proc/self/mountinfo", []))
    assert launcher.plain_reason is None, launcher.plain_reason


@pytest.mark.parametrize(
    "refusal",
    [OSError(errno.EINVAL, "bind: Invalid argument"), RuntimeError("anything else: Invalid argument")],
)
def test_a_kernel_that_refuses_the_bind_sends_launches_the_plain_way(
    tmp_path: Path,
    mounts: Mounter,
    make_launcher: Callable[[], Launcher],
    monkeypatch: pytest.MonkeyPatch,
    refusal: Exception,
) -> None:
    def refused(copy: int, path: str) -> None:
        raise refusal

    monkeypatch.setattr(launch_module, "bind_copy", refused)
    other, mine = tmp_path / "other", tmp_path / "mine"
    mounts(other, f"rollcage-{owner_tag()}")
    copy = mounts(mine, "rollcage-1.3")
    assert copy is not None
    launcher = make_launcher()
    for _ in range(2):
        # Started all the same, in the host's namespace: the host's mounts, its own among them.
        seen = _points(_launch(launcher, "cat /proc/self/mountinfo", [(copy, str(mine))]))
        assert {str(other), str(mine)} <= seen
    assert launcher.plain_reason is not None and "Invalid argument" in launcher.plain_reason


def test_a_launch_needing_the_host_s_own_mounts_is_started_in_the_host_s_namespace(
    tmp_path: Path,
    mounts: Mounter,
    make_launcher: Callable[[], Launcher],
) -> None:
    plain = tmp_path / "plain"
    mounts(plain, "rollcage-1.4")
    assert str(plain) in _points(_launch(make_launcher(), "cat /proc/self/mountinfo", None))


def test_what_starts_after_the_wait_gave_up_is_handed_over_to_be_killed(
    make_launcher: Callable[[], Launcher],
) -> None:
    launcher = make_launcher()
    go, handed = threading.Event(), threading.Event()
    late: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        assert go.wait(60)
        return subprocess.Popen(["sleep", "600"])

    def kill(proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        late.append(proc)
        handed.set()

    with pytest.raises(TimeoutError, match="started nothing"):
        launcher.run(start, [], timeout_s=0.05, late=kill)
    go.set()
    assert handed.wait(60)
    assert late[0].wait(timeout=60) == -signal.SIGKILL


@requires_bwrap()
@pytest.mark.bwrap
async def test_a_rollout_s_bubblewrap_starts_without_the_other_rollouts_mounts(
    tmp_path: Path, mounts
) -> None:  # type: ignore[no-untyped-def]
    other = tmp_path / "other"
    mounts(other, f"rollcage-{owner_tag()}")
    root = tmp_path / "r"
    root.mkdir()
    (root / "workspace").mkdir()
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        (root / "input.json").write_text(json.dumps(worker_input(model_url=server.base_url, task_id="t")))
        stop = asyncio.Event()
        config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start="warm"))
        task = asyncio.ensure_future(supervise(root, config, stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            seen = await wait_for_async(lambda: _outer_bwrap_mounts(root), what="the rollout's bubblewrap")
        finally:
            stop.set()
            receipt = await task
    assert receipt.outcome == "cancelled", receipt.outcome_reason
    assert str(root / "workspace") in seen, "the rollout's own workspace was not bound for its launch"
    assert str(other) not in seen, "the launch copied another rollout's workspace mount"


def _outer_bwrap_mounts(root: Path) -> set[str] | None:
    """The mount points seen by this process's child running bubblewrap for the rollout at ``root``."""
    return _bwrap_child_mounts(str(root).encode())


def _bwrap_child_mounts(word: bytes) -> set[str] | None:
    """The mount points seen by this process's child running bubblewrap with ``word`` in its arguments."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8") as file:
                ppid = int(file.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        ours = any(word in each for each in words)
        if ppid == os.getpid() and words[0].endswith(b"bwrap") and ours:
            with contextlib.suppress(OSError):
                return _points(Path(f"/proc/{name}/mountinfo").read_text())
    return None


@requires_bwrap()
@pytest.mark.bwrap
async def test_a_graders_cage_starts_without_the_rollouts_mounts(tmp_path: Path, mounts: Mounter) -> None:
    other = tmp_path / "other"
    mounts(other, f"rollcage-{owner_tag()}")
    grading = asyncio.ensure_future(
        run_contained([PYTHON, "-I", "-S", "-c", "import time; time.sleep(600)"], timeout_s=600)
    )
    try:
        seen = await wait_for_async(lambda: _bwrap_child_mounts(b"rollcage-cage"), what="the grader's cage")
    finally:
        grading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await grading
    assert str(other) not in seen, "the grader's cage was started with a rollout's workspace mount"
    assert _bwrap_child_mounts(b"rollcage-cage") is None, "the cancelled grader's cage is still there"


def test_a_closed_launcher_leaves_no_thread_or_descriptor_and_starts_the_plain_way(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    others = set(threading.enumerate())
    launcher = Launcher()
    _launch(launcher, "true", [])
    (thread,) = set(threading.enumerate()) - others
    launcher.close()
    assert not thread.is_alive()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert _launch(launcher, "echo started", []) == "started\n"


def test_a_released_launcher_holds_nothing_and_what_it_started_keeps_its_parent(
    make_launcher: Callable[[], Launcher],
) -> None:
    before = set(os.listdir("/proc/self/fd"))
    launcher = make_launcher()
    # A child that dies with the thread that started it (as bubblewrap's --die-with-parent asks), echoing.
    echo = (
        "import ctypes, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
        "for line in sys.stdin: print(line.strip(), flush=True)"
    )

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-c", echo], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    child = launcher.run(start, [], timeout_s=60, late=lambda late: late.kill())
    assert child.stdin is not None and child.stdout is not None
    try:
        launcher.release()
        pipes = {str(child.stdin.fileno()), str(child.stdout.fileno())}
        assert set(os.listdir("/proc/self/fd")) - pipes <= before, "the launcher kept a descriptor"
        # The next launch makes the base again; the thread that started the child is still there.
        assert _launch(launcher, "echo again", []) == "again\n" and launcher.plain_reason is None
        child.stdin.write("still here\n")
        child.stdin.flush()
        assert child.stdout.readline() == "still here\n"
    finally:
        child.stdin.close()
        assert child.wait(timeout=60) == 0


def test_what_goes_wrong_in_a_start_is_the_caller_s_and_the_launcher_goes_on(
    make_launcher: Callable[[], Launcher],
) -> None:
    launcher = make_launcher()

    def broken() -> subprocess.Popen[str]:
        raise ValueError("not a program")

    with pytest.raises(ValueError, match="not a program"):
        launcher.run(broken, [], timeout_s=60, late=lambda late: late.kill())
    assert _launch(launcher, "echo on", []) == "on\n" and launcher.plain_reason is None


def test_an_idle_launcher_lets_go_of_its_namespaces_by_itself() -> None:
    # Its copy of the host's mounts would keep busy a file system the host has unmounted since.
    before = set(os.listdir("/proc/self/fd"))
    launcher = Launcher(idle_s=0.05)
    try:
        _launch(launcher, "true", [])
        wait_for(lambda: set(os.listdir("/proc/self/fd")) <= before, what="the idle launcher to let go")
        assert _launch(launcher, "echo again", []) == "again\n" and launcher.plain_reason is None
    finally:
        launcher.close()
