"""The joiner, which forks a sandbox's commands: outside the cage, and gone with its provider.

Real images, real bubblewrap, real cgroups, as tests/gym_sandbox/test_cage.py (which runs every
command through the joiner too); root only.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollcage.gym_sandbox._cage import CagedSandbox, SandboxBudgets, open_sandbox, release_abandoned
from rollcage.images import ImageStore
from rollcage.procs import PidHandle, read_proc, signal_group, wait_readable
from tests.helpers.task_images import TaskImage

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the rollcage sandbox needs root")


@pytest.fixture
async def sandbox(image: TaskImage, state: Path, tmp_path: Path) -> AsyncIterator[CagedSandbox]:
    box = await open_sandbox(
        image.ref, state_dir=state, store=ImageStore(tmp_path / "store"), budgets=SandboxBudgets()
    )
    try:
        yield box
    finally:
        await box.close()


def _caps(status: bytes) -> dict[str, int]:
    pairs = (line.split(b":", 1) for line in status.splitlines() if line.startswith(b"Cap"))
    return {name.decode(): int(value, 16) for name, value in pairs}


async def test_a_command_cannot_see_or_signal_the_joiner_that_forked_it(sandbox: CagedSandbox) -> None:
    first = await sandbox.run("echo $$", timeout_s=60)
    assert sandbox.joiner is not None
    joiner = sandbox.joiner.pid
    assert first.exit_code == 0 and joiner is not None  # forked by the joiner, not a helper interpreter
    info = read_proc(joiner)
    assert info is not None
    # The joiner is outside the cage: no such process there to look at, nor to signal (as any uid).
    probe = await sandbox.run(
        f"test -e /proc/{joiner}/status && echo seen; kill -KILL {joiner} 2>/dev/null && echo killed; "
        "echo done",
        timeout_s=60,
    )
    assert probe.stdout.endswith(b"done\n") and b"seen" not in probe.stdout and b"killed" not in probe.stdout
    after = read_proc(joiner)
    assert after is not None and after.alive and after.starttime == info.starttime
    # And it keeps serving: the next command is forked by the same joiner.
    again = await sandbox.run("cat /proc/self/status", timeout_s=60)
    assert sandbox.joiner.pid == joiner and again.exit_code == 0
    # What it forked kept no capability and runs as the image's user.
    assert set(_caps(again.stdout).values()) == {0}
    assert (await sandbox.run("id -u", timeout_s=60)).stdout == f"{sandbox.image.uid}\n".encode()


async def test_a_command_the_joiner_forks_counts_in_the_sandboxs_cgroups(sandbox: CagedSandbox) -> None:
    started = await sandbox.run("setsid sleep 4545 </dev/null >/dev/null 2>&1 & echo started", timeout_s=60)
    assert started.stdout == b"started\n" and sandbox.joiner is not None and sandbox.joiner.pid
    groups = {str(Path(path).parent) for path in sandbox.procs_files}
    assert groups
    found = _processes(b"4545")
    assert len(found) == 1
    # "N:controllers:/path" (cgroup v1) or "0::/path" (v2), paths as the host sees them.
    lines = (found[0] / "cgroup").read_bytes().decode().splitlines()
    members = {line.split(":", 2)[2] for line in lines} - {"/"}
    assert all(any(group.endswith(member) for member in members) for group in groups)


def _processes(seconds: bytes) -> list[Path]:
    """The ``/proc`` entries of every ``sleep SECONDS``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes() == b"sleep\0" + seconds + b"\0":
                found.append(entry)
        except OSError:
            continue
    return found


_CREATOR = r"""
import asyncio, json, sys
from pathlib import Path
from rollcage.gym_sandbox._cage import open_sandbox
from rollcage.gym_sandbox._joiner import Joiner
from rollcage.images import ImageStore

async def main():
    joiner = Joiner()
    box = await open_sandbox(sys.argv[1], state_dir=Path(sys.argv[2]), store=ImageStore(Path(sys.argv[3])),
                             joiner=joiner)
    result = await box.run("setsid sleep 4646 </dev/null >/dev/null 2>&1 & echo up", timeout_s=60)
    assert result.stdout == b"up\n", result
    print(json.dumps({"directory": str(box.directory), "joiner": joiner.pid}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_killed_provider_leaves_no_joiner_and_its_sandbox_is_released(
    image: TaskImage, state: Path, tmp_path: Path
) -> None:
    creator = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _CREATOR,
        image.ref,
        str(state),
        str(tmp_path / "store"),
        stdout=asyncio.subprocess.PIPE,
    )
    joiner: PidHandle | None = None
    try:
        assert creator.stdout is not None
        line = await asyncio.wait_for(creator.stdout.readline(), 120)
        said = json.loads(line)
        info = read_proc(int(said["joiner"]))
        assert info is not None and info.ppid == creator.pid
        joiner = PidHandle.open(info)
        assert joiner is not None
    finally:
        creator.kill()  # no close: as a crash leaves it
        await creator.wait()
    # The joiner goes with its provider (its control socket's end of file, and the parent-death signal).
    await asyncio.wait_for(wait_readable(joiner.fd), 60)
    joiner.close()
    directory = Path(said["directory"])
    holder = json.loads((directory / "attach.json").read_text())["holder"]
    holder_info = read_proc(holder["pid"])
    if holder_info is not None and holder_info.starttime == holder["starttime"]:
        handle = PidHandle.open(holder_info)
        if handle is not None:
            await asyncio.wait_for(wait_readable(handle.fd), 60)
            handle.close()
    assert await asyncio.to_thread(release_abandoned, state) == [directory.name]
    assert not _processes(b"4646")


async def test_without_a_joiner_commands_take_the_slow_path_with_the_same_promises(
    sandbox: CagedSandbox,
) -> None:
    assert sandbox.joiner is not None
    await sandbox.joiner.close()  # as a joiner that cannot be reached
    result = await sandbox.run("id -u; echo ok", timeout_s=60)
    assert result.stdout == f"{sandbox.image.uid}\nok\n".encode() and sandbox.joiner.pid is None
    failed = await sandbox.run("echo ran", cwd="/no/such/dir", timeout_s=60)
    assert failed.cage_failed and failed.exit_code == 125 and b"/no/such/dir" in failed.stderr


async def test_a_joiner_that_died_is_started_again_on_the_next_command(sandbox: CagedSandbox) -> None:
    assert (await sandbox.run("true", timeout_s=60)).exit_code == 0
    assert sandbox.joiner is not None and sandbox.joiner.pid is not None
    first = sandbox.joiner.pid
    info = read_proc(first)
    assert info is not None
    handle = PidHandle.open(info)
    assert handle is not None
    try:
        assert signal_group(first, signal.SIGKILL)  # it leads its own session and group
        await asyncio.wait_for(wait_readable(handle.fd), 60)
    finally:
        handle.close()
    result = await sandbox.run("echo again", timeout_s=60)
    assert result.stdout == b"again\n" and sandbox.joiner.pid not in (None, first)


async def test_commands_find_sigint_and_sigquit_at_their_defaults_under_a_provider_that_ignores_them(
    image: TaskImage, state: Path, tmp_path: Path
) -> None:
    # A provider started as a shell's background job (``cmd &``) has SIGINT and SIGQUIT ignored; a
    # command, joined or by the slow path, must not inherit that (^C, send_signal("SIGINT")).
    numbers = (signal.SIGINT, signal.SIGQUIT)
    before = {number: signal.signal(number, signal.SIG_IGN) for number in numbers}
    try:
        box = await open_sandbox(
            image.ref, state_dir=state, store=ImageStore(tmp_path / "store"), budgets=SandboxBudgets()
        )
        try:
            joined = await box.run("grep SigIgn /proc/self/status", timeout_s=60)
            assert box.joiner is not None and box.joiner.pid is not None
            await box.joiner.close()
            slow = await box.run("grep SigIgn /proc/self/status", timeout_s=60)
            assert box.joiner.pid is None
        finally:
            await box.close()
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)
    # SIGINT's bit only: the image's shell ignores SIGQUIT of its own accord.
    for result in (joined, slow):
        assert result.exit_code == 0, result
        assert int(result.stdout.split()[1], 16) & 1 << (signal.SIGINT - 1) == 0, result.stdout
