"""An unprivileged user for the tests, made by the tests (as they make chromium's profile).

The suite runs as root under ``make test``, where the supervisor takes its root
path (two-stage cages, bounded tmpfs mounts, cgroups). The non-root path
(one-stage cages, bubblewrap's tmpfs, polls, a delegated cgroup where one is
given) is only exercised when a supervisor really runs as another user: these
helpers make that user (``rollcage-test``, a system account without a home or a
shell), directories it owns, a delegated cgroup subtree as systemd gives a user's
session, and run commands as it (``setpriv``, nothing inherited but what is given).
Not root: the suite already runs unprivileged, and every helper skips, saying so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = [
    "TEST_USER",
    "UnprivilegedUser",
    "can_delegate",
    "chown_tree",
    "delegated_cgroups",
    "make_test_user",
    "run_as",
    "user_dir",
]

TEST_USER = "rollcage-test"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class UnprivilegedUser:
    """The unprivileged account the tests run supervisors as."""

    name: str
    uid: int
    gid: int


def make_test_user() -> UnprivilegedUser:
    """The test user, made if missing (root only; otherwise the test skips, saying why)."""
    if os.geteuid() != 0:
        pytest.skip("optional: not root, so the whole suite already runs as an unprivileged user")
    # One maker at a time: pytest-xdist workers ask together.
    with open(os.path.join(tempfile.gettempdir(), "rollcage-test-user.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(TEST_USER)
        except KeyError:
            useradd = shutil.which("useradd") or shutil.which("useradd", path="/usr/sbin:/sbin")
            if useradd is None:
                pytest.fail(
                    "useradd (passwd) is not installed: the tests cannot make their unprivileged user"
                )
            subprocess.run(
                [
                    useradd,
                    "--system",
                    "--no-create-home",
                    "--home-dir",
                    "/nonexistent",
                    "--shell",
                    "/usr/sbin/nologin",
                    TEST_USER,
                ],
                check=True,
                capture_output=True,
            )
            entry = pwd.getpwnam(TEST_USER)
    return UnprivilegedUser(TEST_USER, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def user_dir(user: UnprivilegedUser, prefix: str = "rollcage-test-") -> Iterator[Path]:
    """A fresh directory the user owns, in the temporary directory (pytest's own is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        os.chown(path, user.uid, user.gid)
        path.chmod(0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def chown_tree(path: Path, user: UnprivilegedUser) -> None:
    """Give ``path`` and everything under it to the user (never through a link)."""
    os.chown(path, user.uid, user.gid, follow_symlinks=False)
    for parent, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chown(os.path.join(parent, name), user.uid, user.gid, follow_symlinks=False)


_DELEGATED_FILES = ("cgroup.procs", "cgroup.subtree_control", "cgroup.threads", "tasks")
"""What systemd hands to the user with a delegated cgroup (``tasks``: cgroup v1's)."""


def can_delegate() -> bool:
    """Whether this machine gives root memory and pids cgroups to delegate (:func:`delegated_cgroups`)."""
    from rollcage.budgets import detect_cgroups

    support = detect_cgroups()
    return support.memory is not None and support.pids is not None


@contextlib.contextmanager
def delegated_cgroups(user: UnprivilegedUser) -> Iterator[list[str]]:
    """A cgroup subtree delegated to the user, as systemd delegates ``user@UID.service``.

    Yields the ``cgroup.procs`` files a process joins to start in it (:func:`run_as`). With cgroup
    v2, the subtree's top (owned by the user, ``memory`` and ``pids`` enabled for its children) holds
    a leaf the process starts in, so the cages go beside it; with v1, one owned cgroup per
    hierarchy. Everything in it is killed and removed at the end.
    """
    from rollcage.budgets import detect_cgroups, kill_cgroup, remove_cgroup

    if not can_delegate():
        pytest.skip("optional: this machine gives root no memory and pids cgroups to delegate")
    support = detect_cgroups()
    made: list[Path] = []
    procs: list[str] = []
    try:
        # Each hierarchy once (v2: one for all); v1's cpuacct too, where the cages' CPU time is counted.
        for kind, parent in dict.fromkeys(
            found for found in (support.memory, support.pids, support.cpu) if found
        ):
            top = parent / f"rollcage-test-delegated-{secrets.token_hex(4)}"
            top.mkdir()
            made.append(top)
            owned = [top]
            if kind == "cgroup2":
                wanted = {"memory", "pids"} & set((top / "cgroup.controllers").read_text().split())
                leaf = top / "session"
                leaf.mkdir()
                owned.append(leaf)
                (top / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
                procs.append(str(leaf / "cgroup.procs"))
            else:
                procs.append(str(top / "cgroup.procs"))
            for directory in owned:
                os.chown(directory, user.uid, user.gid)
                for name in _DELEGATED_FILES:
                    with contextlib.suppress(FileNotFoundError):
                        os.chown(directory / name, user.uid, user.gid)
        yield procs
    finally:
        for top in made:
            for below in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                kill_cgroup(below)
                remove_cgroup(below, wait_s=10)
            kill_cgroup(top)
            remove_cgroup(top, wait_s=10)


_ENTER = Path(__file__).resolve().parent / "enter_as_user.py"
"""Root's last steps before the user's command (joins cgroups, makes the checkout reachable)."""

EXPOSED = sorted({str(REPO), sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable))})
"""What the user's processes must reach: the checkout, the environment and the interpreter it comes from."""


def user_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for the user's processes: nothing of root's but the essentials."""
    return {
        "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(extra or {}),
    }


def run_as(
    user: UnprivilegedUser,
    argv: Sequence[str],
    *,
    home: Path,
    cgroups: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO,
    timeout_s: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the user (no supplementary groups, a clean environment) and wait for it.

    Args:
        user: Who.
        argv: The command.
        home: Its ``HOME`` (a directory of the user's: :func:`user_dir`).
        cgroups: ``cgroup.procs`` files it starts in (:func:`delegated_cgroups`).
        env: More environment variables.
        cwd: Its working directory (default: the checkout).
        timeout_s: Its bound; past it, its whole session is killed and the test fails.
    """
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    command = [setpriv, "--reuid", str(user.uid), "--regid", str(user.gid), "--clear-groups", "--", *argv]
    enter = [sys.executable, "-I", str(_ENTER)]
    for procs in cgroups:
        enter += ["--cgroup", procs]
    for path in EXPOSED:
        enter += ["--expose", path]
    command = [*enter, "--", *command]
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=user_env(home, env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, None)
