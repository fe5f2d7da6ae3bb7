"""A rollout's processes as the host sees them, for the tests that hold a warm (forked) process to a cold one.

What differs between any two rollouts (PIDs, mount ids, inode numbers, the token's value, the
rollout's paths on the host) is left out, so that two descriptions compare field by field; and the
non-root tests' marker (:func:`not_root`), which keeps them from being collected as root.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rollcage.procs import read_proc

__all__ = [
    "NAMESPACES",
    "REFUSE_SETNS",
    "ROOT",
    "SETNS_NUMBERS",
    "STATUS_FIELDS",
    "TOKEN",
    "comm",
    "describe",
    "namespaces",
    "not_root",
    "pass_as_the_test_user",
    "rollout_processes",
]

ROOT = os.geteuid() == 0
TOKEN = "ROLLCAGE_SUPERVISION_TOKEN"
NAMESPACES = ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup")
STATUS_FIELDS = (
    "Uid",
    "Gid",
    "Groups",
    "CapInh",
    "CapPrm",
    "CapEff",
    "CapBnd",
    "CapAmb",
    "NoNewPrivs",
    "Seccomp",
    "Seccomp_filters",
    "Umask",
    "SigBlk",
    "SigIgn",
)
_F = TypeVar("_F", bound=Callable[..., Any])


def not_root(test: _F) -> _F:
    """A test of a non-root supervisor's path: collected only where this session is not root (the file's
    last test runs it again as rollcage-test). Not a skip: a skip under ``make test`` is a failure."""
    test.__test__ = not ROOT  # type: ignore[attr-defined]
    return test


def pass_as_the_test_user(*files: str) -> None:
    """Run these test files again as the unprivileged test user, in a session of their own; all must
    pass but the one test that does this (which skips where it is not root). Skips where the suite
    already runs unprivileged."""
    import sys

    from tests.helpers.unprivileged import make_test_user, run_as, user_dir

    user = make_test_user()
    with user_dir(user) as home:
        argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
        argv += ["--basetemp", str(home / "pytest"), *files]
        done = run_as(user, argv, home=home, timeout_s=540)
    assert done.returncode == 0, f"as {user.name} (uid {user.uid}):\n{done.stdout[-12000:]}"
    assert " passed, 1 skipped" in done.stdout, done.stdout[-3000:]


def rollout_processes(root: Path) -> dict[int, list[bytes]]:
    """The rollout's live processes (by the token in their environment): PID -> command line's words."""
    try:
        token = (root / ".sandbox" / "token").read_text().splitlines()[0]
    except (FileNotFoundError, IndexError):
        return {}  # not written yet: nothing of the rollout runs
    marked = f"{TOKEN}={token}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as file:
                if marked not in file.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as file:
                found[int(name)] = file.read().split(b"\0")
        except OSError:
            continue
    return found


def comm(pid: int) -> str:
    """The process's command name (``""``: gone)."""
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return ""


def _mounts(pid: int) -> list[tuple[str, str, str, str]]:
    """The mount table as the process sees it: (mount point, options, type, super options), in order,
    without what names the rollout (mount ids, the host paths bound)."""
    seen = []
    with open(f"/proc/{pid}/mountinfo") as file:
        for line in file:
            before, after = line.split(" - ")
            fields, rest = before.split(), after.split()
            options = ",".join(sorted(fields[5].split(",")))
            seen.append((fields[4], options, rest[0], ",".join(sorted(rest[2].split(",")))))
    return seen


def _fd_kind(pid: int, fd: int) -> str:
    """What a descriptor is, without what differs between rollouts (inode numbers, the rollout's path)."""
    target = os.readlink(f"/proc/{pid}/fd/{fd}")
    return target.split(":")[0] if ":[" in target else os.path.basename(target)


def namespaces(pid: int) -> dict[str, str]:
    """The process's namespaces, by name (their ids: equal where two processes share one)."""
    return {name: os.readlink(f"/proc/{pid}/ns/{name}") for name in NAMESPACES}


def describe(pid: int, *, token: str) -> dict[str, Any]:
    """What a process is, from the host, with what differs between any two rollouts left out.

    ``words`` is its command line; ``ppid``, ``leads_its_group`` and ``leads_its_session`` say where it
    stands; the rest (status, limits, cgroups, environment, working directory, root, descriptors,
    mounts) is what a forked process must have as a started one has it.
    """
    with open(f"/proc/{pid}/status") as file:
        status = dict(line.split(":", 1) for line in file.read().splitlines() if ":" in line)
    with open(f"/proc/{pid}/environ", "rb") as file:
        env = dict(
            entry.decode().split("=", 1) for entry in file.read().split(b"\0") if entry and b"=" in entry
        )
    env[TOKEN] = "<token>" if env.get(TOKEN) == token else f"wrong: {env.get(TOKEN)}"
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        words = file.read().split(b"\0")
    with open(f"/proc/{pid}/limits") as file:
        limits = file.read()
    with open(f"/proc/{pid}/cgroup") as file:
        confined = sorted(line.split(":")[1] for line in file.read().splitlines() if "rollcage-" in line)
    info = read_proc(pid)
    assert info is not None
    here = status["NSpid"].split()[-1]
    return {
        "status": {name: status[name].strip() for name in STATUS_FIELDS},
        "pid_depth": len(status["NSpid"].split()),
        "leads_its_group": status["NSpgid"].split()[-1] == here,
        "leads_its_session": status["NSsid"].split()[-1] == here,
        "environ": env,
        "words": [word.decode() for word in words],
        "limits": limits,
        "cgroups": confined,
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "root_is_host": os.stat(f"/proc/{pid}/root/").st_ino == os.stat("/").st_ino
        and os.stat(f"/proc/{pid}/root/").st_dev == os.stat("/").st_dev,
        "fds": {fd: _fd_kind(pid, fd) for fd in sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd"))},
        "mounts": _mounts(pid),
        "ppid": info.ppid,
    }


SETNS_NUMBERS = {"x86_64": 308, "aarch64": 268}
"""``setns``'s system call number, by machine (``platform.machine()``)."""

REFUSE_SETNS = """
import ctypes, struct, sys
# A seccomp filter that refuses setns (EPERM), as a container runtime's default profile may: the
# processes started after it inherit it; bubblewrap (which makes namespaces, never joins one) runs as ever.
nr = int(sys.argv[1])
code = [(0x20, 0, 0, 0), (0x15, 0, 1, nr), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)]
program = b"".join(struct.pack("HBBI", *insn) for insn in code)
buffer = ctypes.create_string_buffer(program)
fprog = struct.pack("HxxxxxxQ", len(code), ctypes.addressof(buffer))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.c_char_p(fprog), 0, 0) == 0, ctypes.get_errno()
"""
"""Python source that installs a filter refusing ``setns`` in the running interpreter (``sys.argv[1]``:
its number, :data:`SETNS_NUMBERS`); a program's source goes after it."""
