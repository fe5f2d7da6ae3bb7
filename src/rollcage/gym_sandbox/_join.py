"""Run one command in a sandbox's cage by joining its holder (run by path: ``python -I -S _join.py SPEC``).

``SPEC`` is JSON: ``holder`` (the host PID of the cage's init), ``uid``/``gid`` (ids in the cage),
``cwd``, ``env`` and ``argv``. This process joins all the holder's namespaces at once (as root: it
holds every capability over the cage's user namespace until it drops them), forks so the child is
born in the cage's PID namespace, and the child gives up every capability and the uid (as a warm
worker does, :func:`rollcage.cage.drop_privileges`) before it executes the command. Its exit status
is this process's (``128 + N`` for a signal; ``125`` when the cage could not be entered, with a line
on stderr). Only the standard library and :mod:`rollcage.cage._enter` (loaded by path: no
site-packages, no rollcage package) are loaded, so a command starts in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

_ENTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cage", "_enter.py")


def main() -> int:
    """Join, fork, drop, execute; the command's exit status (see the module docstring)."""
    spec = json.loads(sys.argv[1])
    loader = importlib.util.spec_from_file_location("rollcage_enter", _ENTER)
    assert loader is not None and loader.loader is not None
    enter = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(enter)
    try:
        holder = os.pidfd_open(spec["holder"])
        enter.setns(holder, enter.JOIN)
        os.close(holder)
    except OSError as exc:
        sys.stderr.write(f"rollcage sandbox: cannot enter the sandbox's cage: {exc}\n")
        return 125
    pid = os.fork()
    if pid == 0:
        try:
            enter.drop_privileges(spec["uid"], spec["gid"])
            os.chdir(spec["cwd"])
            os.execve(spec["argv"][0], spec["argv"], spec["env"])
        except OSError as exc:
            sys.stderr.write(f"rollcage sandbox: cannot start the command in the cage: {exc}\n")
        os._exit(125)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
