"""A tool's child with no cage around it (``--sandbox none``) dies with the process that started it.

Without a sandbox no PID namespace ends the agent's processes when the worker dies: the Python
executor (running the agent's cell) and the bash session are the worker's children. ``repl``'s
child and bash start under ``setpriv --pdeathsig KILL``
(:func:`rollcage.tools._executor.uncaged_leash`), so a worker killed outright (its supervisor
SIGKILLed, say) takes them with it instead of leaving the agent's code running; in a cage the
cage's PID namespace does it. ``jupyter``'s kernel needs no leash: ipykernel's parent poller ends
it when its parent is gone (the test holds it to that too).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.tools._executor import uncaged_leash
from tests.helpers.waiting import alive, wait_for

pytestmark = pytest.mark.timeout(60)

OWNER = r"""
import asyncio, sys
from pathlib import Path
from rollcage.protocol import ExecutorSettings
from rollcage.tools import ShellSession, make_executor

async def main() -> None:
    workspace = Path(sys.argv[1])
    executor = make_executor(ExecutorSettings(backend=sys.argv[2]), cwd=workspace)
    shell = ShellSession(cwd=workspace)
    await executor.start()
    await shell.run("true", 30)
    print(executor.pid, shell.pid, flush=True)
    # The agent's cell runs on (the worker waits on it); the owner is killed meanwhile.
    await asyncio.gather(executor.run("import time\ntime.sleep(3600)", 3600), shell.run("sleep 3600", 3600))

asyncio.run(main())
"""


def test_the_leash_is_setpriv_with_a_parent_death_signal() -> None:
    leash = uncaged_leash()
    assert leash and Path(leash[0]).name == "setpriv" and leash[1:] == ("--pdeathsig", "KILL", "--")


@pytest.mark.parametrize("backend", ["repl", "jupyter"])
def test_an_uncaged_executor_and_bash_session_die_with_their_owner(tmp_path: Path, backend: str) -> None:
    with subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), backend], stdout=subprocess.PIPE, text=True
    ) as owner:
        try:
            assert owner.stdout is not None
            line = owner.stdout.readline()
            executor, shell = (int(word) for word in line.split())
            assert alive(executor) and alive(shell)
        finally:
            os.kill(owner.pid, signal.SIGKILL)
            owner.wait(timeout=10)
    try:
        wait_for(
            lambda: not alive(executor) and not alive(shell),
            timeout=10,
            what="the executor and the bash session to die with their owner",
        )
    finally:
        for pid in (executor, shell):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        # What the agent's code starts is not leashed (a parent-death signal is not inherited): the
        # session's `sleep`, left in its process group, is this test's to end.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell, signal.SIGKILL)
