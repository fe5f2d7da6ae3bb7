"""Run one command in a sandbox's cage by joining its holder (run by path: ``python -I -S _join.py SPEC``).

The slow path: a sandbox's commands are forked by its provider's joiner
(:mod:`rollcage.gym_sandbox._joinserver`), and this helper starts one only where no joiner can be
reached.

``SPEC`` is JSON: ``holder`` (an inherited pidfd on the cage's init, opened and checked by the
provider), ``uid``/``gid`` (ids in the cage), ``cwd``, ``env`` and ``argv``. This process joins all
the holder's namespaces at once (as root: it holds every capability over the cage's user namespace
until the command drops them), then starts the command, which is born in the cage's PID namespace
and gives up every capability and the uid (as a warm worker does, :func:`rollcage.cage.drop_privileges`)
before it executes. The command's exit status is this process's (``128 + N`` for a signal; ``125``
when the cage could not be entered, with a line on stderr). Only the standard library and
:mod:`rollcage.cage._enter` (loaded by path: no site-packages, no rollcage package) are loaded, so a
command starts in milliseconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import types

__all__ = ["main"]

_ENTER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cage", "_enter.py")


def _become(enter: types.ModuleType, uid: int, gid: int) -> None:
    """In the command's fork: every signal at its default (a provider started as a background job
    passes SIGINT and SIGQUIT on ignored), then the cage's uid and no capability."""
    for number in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(number, signal.SIG_DFL)
    enter.drop_privileges(uid, gid)


def main() -> int:
    """Join, start, wait (see the module docstring); the command's exit status."""
    spec = json.loads(sys.argv[1])
    loader = importlib.util.spec_from_file_location("rollcage_enter", _ENTER)
    assert loader is not None and loader.loader is not None
    enter = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(enter)
    try:
        enter.setns(spec["holder"], enter.JOIN)
        os.close(spec["holder"])
    except OSError as exc:
        sys.stderr.write(f"rollcage sandbox: cannot enter the sandbox's cage: {exc}\n")
        return 125
    uid, gid = spec["uid"], spec["gid"]
    try:
        command = subprocess.Popen(
            spec["argv"],
            cwd=spec["cwd"],
            env=spec["env"],
            close_fds=True,
            preexec_fn=lambda: _become(enter, uid, gid),  # this process has no threads
        )
    except (OSError, subprocess.SubprocessError) as exc:
        sys.stderr.write(f"rollcage sandbox: cannot start the command in the cage: {exc}\n")
        return 125
    code = command.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
