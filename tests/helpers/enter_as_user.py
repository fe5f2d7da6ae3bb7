"""Root's last steps before a command runs as the test user (stdlib only; run with ``python -I``).

``enter_as_user.py [--cgroup PROCS]... [--expose PATH]... -- COMMAND...``

* ``--cgroup``: join this ``cgroup.procs`` (a delegated subtree: :mod:`tests.helpers.unprivileged`);
* ``--expose``: make PATH reachable for other users, where a directory above it is not searchable
  (a checkout or an interpreter under ``/root``, 0700): in a mount namespace of the command's own,
  that directory is covered by an empty world-searchable tmpfs and PATH bound back at its place.
  Nothing changes on the host; what the user could not read before stays out of its reach.

Then COMMAND is executed (``setpriv`` dropping to the user).
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile

_CLONE_NEWNS = 0x00020000
_MS_BIND = 0x1000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MNT_DETACH = 2

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {source} on {target}",
    )


def _blocked(path: str) -> str | None:
    """The outermost directory above ``path`` that other users cannot search, if any."""
    here = "/"
    for part in path.strip("/").split("/")[:-1]:
        here = os.path.join(here, part)
        if not os.stat(here).st_mode & 0o001:
            return here
    return None


def expose(paths: list[str]) -> None:
    """Make each of ``paths`` reachable by other users, in a new private mount namespace."""
    covered: dict[str, list[str]] = {}
    for path in paths:
        path = os.path.realpath(path)
        blocked = _blocked(path)
        if blocked is not None:
            covered.setdefault(blocked, []).append(path)
    if not covered:
        return
    _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE, None)
    for blocked, inside in covered.items():
        stage = tempfile.mkdtemp(prefix="rollcage-test-stage-")
        _mount(blocked, stage, None, _MS_BIND | _MS_REC, None)
        _mount("tmpfs", blocked, "tmpfs", 0, "mode=755")
        for path in inside:
            os.makedirs(path, mode=0o755, exist_ok=True)
            _mount(os.path.join(stage, os.path.relpath(path, blocked)), path, None, _MS_BIND | _MS_REC, None)
        _check(_libc.umount2(stage.encode(), _MNT_DETACH), f"umount {stage}")
        os.rmdir(stage)


def main(argv: list[str]) -> None:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    cgroups = [options[i + 1] for i, word in enumerate(options) if word == "--cgroup"]
    exposed = [options[i + 1] for i, word in enumerate(options) if word == "--expose"]
    for procs in cgroups:
        with open(procs, "w") as file:
            file.write(str(os.getpid()))
    expose(exposed)
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
