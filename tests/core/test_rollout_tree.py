"""Finding one rollout's processes without reading every process on the machine."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from rollcage.procs import (
    ChildProcess,
    PidfdChild,
    descendants,
    ensure_subreaper,
    read_proc,
    scan_processes,
    tree_of,
)
from rollcage.procs import _table as procs_table
from rollcage.supervisor.config import TOKEN_ENV
from tests.helpers.waiting import wait_for


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as file:
            return file.read().strip()
    except OSError:
        return None


def test_tree_of_is_the_full_scans_tree_with_its_reparented_orphans() -> None:
    ensure_subreaper()
    token = "tok-" + os.urandom(6).hex()
    # A child with a child of its own, and a daemon that leaves (setsid, parent gone) and is
    # reparented to this process, the subreaper: only its token says whose it is.
    script = "(setsid sleep 60 > /dev/null 2>&1 &); sleep 60 & echo started; wait"
    child = ChildProcess.spawn(
        ["/bin/sh", "-c", script],
        env={"PATH": "/usr/bin:/bin", TOKEN_ENV: token},
        cwd="/",
        stdout=os.open(os.devnull, os.O_WRONLY),
    )
    found: list[int] = []
    try:

        def settled() -> list[int] | None:
            # Settled once both others are the sleeps themselves: before that, the subshell and setsid
            # come and go (a tree caught then is gone by the next scan).
            tree = descendants(scan_processes(), [child.pid], marked=f"{TOKEN_ENV}={token}")
            orphans = [info.pid for info in tree if info.ppid == os.getpid() and info.pid != child.pid]
            others = [info for info in tree if info.pid != child.pid]
            sleeping = all(info.alive and _comm(info.pid) == "sleep" for info in others)
            return [info.pid for info in tree] if len(tree) == 3 and orphans and sleeping else None

        expected = wait_for(settled, timeout=60, what="the child, its child and the reparented daemon")
        found = [info.pid for info in tree_of([child.pid], marked=f"{TOKEN_ENV}={token}")]
        assert sorted(found) == sorted(expected)
        # Someone else's process with another token is not taken.
        assert [info.pid for info in tree_of([], marked=f"{TOKEN_ENV}=another")] == []
    finally:
        for pid in {*found, child.pid}:
            info = read_proc(pid)
            if info is not None and info.alive:
                os.kill(pid, signal.SIGKILL)
        for pid in found:
            if pid != child.pid:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
        child.signal_group(signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        child.release()


def test_a_child_held_by_its_pidfd_is_no_orphan_to_look_for(monkeypatch: pytest.MonkeyPatch) -> None:
    # A warm worker is this process's child (the template forks it so) and is held by its pidfd: whose
    # it is is known, so no rollout's walk reads its environment (at C=64, every walk read 63 of them).
    read: list[int] = []
    real = procs_table.environ_has

    def counting(pid: int, marked: str) -> bool:
        read.append(pid)
        return real(pid, marked)

    monkeypatch.setattr(procs_table, "environ_has", counting)
    stranger = subprocess.Popen(["sleep", "60"])
    held = PidfdChild.of_child(stranger.pid)
    assert held is not None
    try:
        tree_of([], marked=f"{TOKEN_ENV}=another")
        assert stranger.pid not in read
        held.kill()
        wait_for(lambda: held.reap() is not None or held.reaped, what="the held child to be reaped")
        assert stranger.pid not in procs_table.started_children
    finally:
        held.kill()
        held.reap()
        stranger.returncode = -signal.SIGKILL  # reaped through the pidfd, not by Popen
