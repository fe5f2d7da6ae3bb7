"""The sandbox under the NeMo Gym provider, on rollcage's own pieces: budgets, reaping, refusals, evidence.

These run in rollcage's own environment (no NeMo Gym): real images in a real store, real bubblewrap,
real cgroups and mounts. Root is the supported case; a user who is not root is refused at create.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollcage.errors import SandboxError
from rollcage.gym_sandbox._cage import CagedSandbox, SandboxBudgets, open_sandbox, release_abandoned
from rollcage.images import ImageStore
from rollcage.procs import PidHandle, read_proc, wait_readable
from tests.helpers.task_images import TaskImage, make_task_image

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the rollcage sandbox needs root")


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture
async def sandbox(image: TaskImage, state: Path, store: ImageStore) -> AsyncIterator[CagedSandbox]:
    box = await open_sandbox(
        image.ref, state_dir=state, store=store, budgets=SandboxBudgets(output_bytes=4096)
    )
    try:
        yield box
    finally:
        await box.close()


def _processes_with(word: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if word.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


async def test_a_background_service_lives_until_close(sandbox: CagedSandbox) -> None:
    started = await sandbox.run("setsid sleep 4141 </dev/null >/dev/null 2>&1 & echo started", timeout_s=60)
    assert started.exit_code == 0 and started.stdout == b"started\n"
    # A later command sees it: the same cage, not a fresh one per command.
    seen = await sandbox.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '", timeout_s=60)
    assert b"sleep 4141" in seen.stdout
    assert _processes_with("4141")
    await sandbox.close()
    assert not _processes_with("4141")


async def test_the_time_bound_kills_the_command_and_its_children(sandbox: CagedSandbox) -> None:
    result = await sandbox.run("sleep 4242 & sleep 4242; echo never", timeout_s=1)
    assert result.timed_out and result.exit_code == 125 and b"never" not in result.stdout
    assert not _processes_with("4242")
    # The sandbox goes on.
    after = await sandbox.run("echo alive", timeout_s=60)
    assert after.stdout == b"alive\n"


async def test_a_commands_kill_of_every_process_leaves_the_sandbox_working(sandbox: CagedSandbox) -> None:
    service = await sandbox.run("setsid sleep 4343 </dev/null >/dev/null 2>&1 & echo started", timeout_s=60)
    assert service.stdout == b"started\n"
    # kill -KILL -1 reaches every process of the cage it may signal but its init: the holder is it.
    killed = await sandbox.run("kill -KILL -1; echo survived", timeout_s=60)
    assert killed.stdout == b"survived\n" and not _processes_with("4343")
    assert sandbox.is_running()
    after = await sandbox.run("setsid sleep 4344 </dev/null >/dev/null 2>&1 & echo alive", timeout_s=60)
    assert after.exit_code == 0 and after.stdout == b"alive\n"
    assert _processes_with("4344")
    holder = sandbox.holder
    await sandbox.close()
    assert holder is not None and holder.returncode is not None
    assert not _processes_with("4344")


async def test_what_a_command_leaves_orphaned_is_reaped_in_the_cage(sandbox: CagedSandbox) -> None:
    # A child that outlives its parent is the cage init's; once it ends it is a zombie until reaped.
    left = await sandbox.run(
        "sh -c 'sleep 0.05 & echo $!' >orphan.pid; p=$(cat orphan.pid); "
        "until [ ! -e /proc/$p ] || grep -q '^State:.*Z' /proc/$p/status; do :; done; echo $p",
        timeout_s=60,
    )
    pid = int(left.stdout)
    # The init reaps it (the command's end told it to): no zombie is left to count against the budget.
    gone = await sandbox.run(f"while [ -e /proc/{pid} ]; do :; done; echo reaped", timeout_s=30)
    assert gone.stdout == b"reaped\n", gone


async def test_a_sessions_unread_output_stays_bounded_and_nothing_is_lost(sandbox: CagedSandbox) -> None:
    session = await sandbox.open_session("head -c 1000000 /dev/zero; echo done >&2", pty=False)
    stream = session._out
    async with asyncio.timeout(60):
        while stream.held < stream.limit:  # nobody reads: it fills up to the bound (4096), then stops
            stream._changed.clear()
            await stream._changed.wait()
    # No longer read: the command waits on its full pipe rather than the provider holding its output.
    assert not stream._reading and stream.held < stream.limit + 65536
    got = 0
    while chunk := await session.read(timeout_s=60):
        got += len(chunk)
        assert stream.held < stream.limit + 65536
    assert got == 1000000 and await session.read_stderr(timeout_s=60) == b"done\n"
    assert await session.wait_exit(timeout_s=60) == 0
    await session.close()
    line = json.loads(sandbox.journal_path.read_text().splitlines()[-1])
    assert line["mode"] == "pipe" and line["stdout_bytes"] == 1000000 and line["exit_code"] == 0


async def test_output_is_kept_up_to_the_bound(sandbox: CagedSandbox) -> None:
    result = await sandbox.run("head -c 1000000 /dev/zero | tr '\\0' x; echo done >&2", timeout_s=60)
    assert result.exit_code == 0 and result.truncated
    assert result.stdout == b"x" * 4096 and result.stderr == b"done\n"


async def test_the_disk_budget_bounds_what_the_sandbox_writes(
    image: TaskImage, state: Path, store: ImageStore
) -> None:
    box = await open_sandbox(
        image.ref, state_dir=state, store=store, budgets=SandboxBudgets(disk_bytes=1 << 20)
    )
    try:
        result = await box.run("head -c 4000000 /dev/zero > /work/big", timeout_s=60)
        assert result.exit_code != 0 and b"error" in result.stderr
        size = await box.run("wc -c < /work/big", timeout_s=60)
        assert int(size.stdout) <= 1 << 20
    finally:
        await box.close()


async def test_the_memory_budget_holds(tmp_path: Path, state: Path, store: ImageStore) -> None:
    image = make_task_image(tmp_path / "python-image", python=True)
    box = await open_sandbox(
        image.ref, state_dir=state, store=store, budgets=SandboxBudgets(memory_bytes=96 << 20)
    )
    try:
        if box.cgroups is None or box.cgroups.memory is None:
            pytest.skip("no memory cgroup on this machine")
        result = await box.run("python3 -c 'b = bytearray(400 << 20); print(len(b))'", timeout_s=120)
        assert result.exit_code != 0 and b"419430400" not in result.stdout
        assert box.cgroups.oom_kills() > 0
    finally:
        await box.close()


async def test_close_reaps_and_releases_and_keeps_the_evidence(sandbox: CagedSandbox) -> None:
    await sandbox.upload(b"kept\n", "notes.txt")
    await sandbox.run("exit 3", timeout_s=60)
    cgroups = list(sandbox.cgroups.procs_files()) if sandbox.cgroups is not None else []
    await sandbox.close()
    await sandbox.close()  # idempotent
    assert sandbox.holder.returncode is not None
    assert not await asyncio.to_thread(os.path.ismount, sandbox.root.merged)
    assert not any(path.parent.exists() for path in cgroups)
    assert (sandbox.directory / "changes" / "work" / "notes.txt").read_bytes() == b"kept\n"
    record = json.loads((sandbox.directory / "sandbox.json").read_text())
    assert record["closed_at"] >= record["created_at"] and record["network"] == "none"
    lines = [json.loads(line) for line in sandbox.journal_path.read_text().splitlines()]
    assert [(line["seq"], line["exit_code"]) for line in lines] == [(1, 0), (2, 3)]
    with pytest.raises(SandboxError, match="is closed"):
        await sandbox.run("true", timeout_s=60)


async def test_files_are_confined_to_the_sandbox_root(sandbox: CagedSandbox) -> None:
    await sandbox.upload(b"x", "../../../../../../etc/escaped-from-test")
    assert not await asyncio.to_thread(os.path.exists, "/etc/escaped-from-test")
    assert await sandbox.download("/etc/escaped-from-test") == b"x"
    with pytest.raises(FileNotFoundError):
        await sandbox.download("/proc/1/root/etc/shadow-not-there")


async def test_a_cage_that_cannot_be_entered_is_not_the_command_failing(sandbox: CagedSandbox) -> None:
    result = await sandbox.run("echo ran", cwd="/no/such/dir", timeout_s=60)
    assert result.cage_failed and result.exit_code == 125 and b"/no/such/dir" in result.stderr
    assert result.stdout == b""


async def test_a_user_other_than_the_images_is_refused(sandbox: CagedSandbox) -> None:
    assert (await sandbox.run("id -u", timeout_s=60, user="root")).stdout == b"0\n"
    with pytest.raises(ValueError, match="image's user"):
        await sandbox.run("id -u", timeout_s=60, user=1234)


async def test_a_state_directory_the_sandbox_cannot_reach_is_refused(
    tmp_path: Path, image: TaskImage, store: ImageStore
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SandboxError, match=f"under {private}.*cannot pass through"):
        await open_sandbox(image.ref, state_dir=private / "state", store=store)


async def test_a_user_who_is_not_root_is_refused(
    monkeypatch: pytest.MonkeyPatch, image: TaskImage, state: Path, store: ImageStore
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxError, match="must run as root"):
        await open_sandbox(image.ref, state_dir=state, store=store)


async def test_rollcage_show_reads_a_sandboxs_journal(sandbox: CagedSandbox) -> None:
    await sandbox.run("echo shown-command", timeout_s=60)
    await sandbox.run("sleep 30", timeout_s=1)
    await sandbox.open_session("echo shown-session; exec sleep 4545")  # ended by the close
    await sandbox.close()
    # A crash mid-write leaves a last line cut short: shown as such, the rest still read.
    with sandbox.journal_path.open("ab") as journal:
        journal.write(b'{"seq": 3, "comm')
    rollcage = Path(sys.executable).with_name("rollcage")
    done = await asyncio.to_thread(
        subprocess.run,
        [str(rollcage), "show", str(sandbox.directory)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert done.returncode == 0, done.stderr
    assert sandbox.sandbox_id in done.stdout and sandbox.image.ref in done.stdout
    assert "echo shown-command" in done.stdout and "timed_out" in done.stdout
    assert "cut short" in done.stdout
    assert "pty-session,ended_by_close" in done.stdout and "exec sleep 4545" in done.stdout


_CREATOR = """
import asyncio, sys
from pathlib import Path
from rollcage.gym_sandbox._cage import open_sandbox
from rollcage.images import ImageStore

async def main():
    box = await open_sandbox(sys.argv[1], state_dir=Path(sys.argv[2]), store=ImageStore(Path(sys.argv[3])))
    await box.run("setsid sleep 4343 </dev/null >/dev/null 2>&1 &", timeout_s=60)
    print(box.directory, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_dead_creators_sandbox_is_released_and_a_live_one_kept(
    sandbox: CagedSandbox, image: TaskImage, state: Path, tmp_path: Path
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
    try:
        assert creator.stdout is not None
        line = await asyncio.wait_for(creator.stdout.readline(), 120)
        directory = Path(line.decode().strip())
        assert await asyncio.to_thread(os.path.ismount, directory / ".image" / "root")
        holder = json.loads((directory / "attach.json").read_text())["holder"]
        info = read_proc(holder["pid"])
        assert info is not None and info.starttime == holder["starttime"]
        handle = PidHandle.open(info)
        assert handle is not None
    finally:
        creator.kill()  # no close: as a crash leaves it
        await creator.wait()
    # The cage dies with its creator (bubblewrap's --die-with-parent): await that, bounded.
    await asyncio.wait_for(wait_readable(handle.fd), 60)
    handle.close()
    released = await asyncio.to_thread(release_abandoned, state)
    assert released == [directory.name]  # the fixture's sandbox (alive) is not
    assert not await asyncio.to_thread(os.path.ismount, directory / ".image" / "root")
    record = json.loads((directory / "sandbox.json").read_text())
    assert record["abandoned"] and record["closed_at"]
    assert not _processes_with("4343")
    assert sandbox.is_running() and (await sandbox.run("echo ok", timeout_s=60)).stdout == b"ok\n"


def test_a_real_unprivileged_user_is_refused_and_leaves_nothing(image: TaskImage) -> None:
    # Not a patched geteuid: the test user, with no capability, asks for a sandbox.
    from tests.helpers.unprivileged import chown_tree, make_test_user, run_as, user_dir

    user = make_test_user()
    with user_dir(user) as home:
        state, ref = home / "state", image.ref
        chown_tree(home, user)
        script = (
            "import asyncio, sys\n"
            "from pathlib import Path\n"
            "from rollcage.errors import SandboxError\n"
            "from rollcage.gym_sandbox._cage import open_sandbox\n"
            "from rollcage.images import ImageStore\n"
            "try:\n"
            f"    asyncio.run(open_sandbox({ref!r}, state_dir=Path({str(state)!r}),"
            f" store=ImageStore(Path({str(home / 'store')!r}))))\n"
            "except SandboxError as exc:\n"
            "    print('refused:', exc); sys.exit(0)\n"
            "sys.exit(3)\n"
        )
        done = run_as(user, [sys.executable, "-c", script], home=home, timeout_s=120)
        assert done.returncode == 0, done.stdout
        assert "refused:" in done.stdout and "must run as root" in done.stdout
        assert not state.exists() or not any(state.iterdir())


async def test_neighbour_sandboxes_cannot_see_signal_or_starve_each_other(
    image: TaskImage, state: Path, store: ImageStore
) -> None:
    budgets = SandboxBudgets(output_bytes=4096, max_processes=64)
    a = await open_sandbox(image.ref, state_dir=state, store=store, budgets=budgets)
    b = await open_sandbox(image.ref, state_dir=state, store=store, budgets=budgets)
    try:
        service = await b.run("sleep 600 >/dev/null 2>&1 & echo $!", timeout_s=60)
        assert service.exit_code == 0, service.stderr
        wrote = await b.run("echo mine > b-secret && pwd", timeout_s=60)
        assert wrote.exit_code == 0, wrote.stderr
        secret = wrote.stdout.decode().strip() + "/b-secret"
        # A looks for B and tries to end everything it can reach, then forks until its budget stops it.
        seen = await a.run(f"cat {secret}; ls /proc | grep -c '^[0-9]'", timeout_s=60)
        assert b"mine" not in seen.stdout
        await a.run("kill -KILL -1", timeout_s=60)
        bomb = await a.run("i=0; while [ $i -lt 500 ]; do sleep 30 & i=$((i+1)); done; wait", timeout_s=5)
        assert bomb.timed_out or bomb.exit_code != 0
        # B is untouched: its service lives and it still runs commands.
        alive = await b.run(f"kill -0 {int(service.stdout)} && echo alive", timeout_s=60)
        assert alive.exit_code == 0 and alive.stdout.strip() == b"alive", alive
        assert (await b.run(f"cat {secret}", timeout_s=60)).stdout.strip() == b"mine"
    finally:
        await a.close()
        await b.close()
