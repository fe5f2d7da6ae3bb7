"""The ``bash`` tool's session: a real bash, beside the test and in a real nested bubblewrap cage.

Bounds here are generous (the machine may be busy): a command that would hang is caught by its
own timeout, and the assertion is on how it ended (``ok``, not ``timeout``), never on wall time.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from rollcage.cage import NestedCage
from rollcage.tools import ShellSession
from rollcage.tools._shell import bash_quote
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import processes_mentioning, wait_for_async

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")

LONG_S = 60.0
"""A command's timeout where the test expects it to end by itself: a hang shows as ``timeout``."""

MakeShell = Callable[..., Awaitable[ShellSession]]


@pytest.fixture(params=["beside", pytest.param("caged", marks=[pytest.mark.bwrap, requires_bwrap()])])
def where(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make(where: str, tmp_path: Path) -> AsyncIterator[MakeShell]:
    """Build sessions in ``tmp_path/ws`` (caged: with ``tmp_path/private`` hidden); all closed after."""
    sessions: list[ShellSession] = []
    workspace = tmp_path / "ws"
    workspace.mkdir()
    private = tmp_path / "private"
    private.mkdir()
    (private / "secret.txt").write_text("worker only")

    async def factory(**options: object) -> ShellSession:
        prefix: list[str] = []
        if where == "caged":
            bwrap = shutil.which("bwrap")
            assert bwrap is not None
            cage = NestedCage(bwrap=bwrap, workspace=str(workspace), hide=(str(private),))
            prefix = cage.prefix(ignore_sigint=False, new_session=True)
        session = ShellSession(cwd=workspace, prefix=prefix, **options)  # type: ignore[arg-type]
        sessions.append(session)
        return session

    try:
        yield factory
    finally:
        for session in sessions:
            await session.aclose()


async def test_working_directory_and_exported_variables_persist(make: MakeShell) -> None:
    shell = await make()
    first = await shell.run("mkdir -p sub/dir && cd sub/dir && export GREETING=hello && LOCAL=kept", LONG_S)
    assert first.status == "ok" and first.exit_code == 0
    second = await shell.run('basename "$PWD"; echo "$GREETING $LOCAL"; sh -c \'echo "$GREETING"\'', LONG_S)
    assert second.output == "dir\nhello kept\nhello\n"


async def test_the_exit_status_is_returned(make: MakeShell) -> None:
    shell = await make()
    failed = await shell.run("echo out; echo err >&2; exit_with() { return $1; }; exit_with 7", LONG_S)
    assert failed.status == "error" and failed.exit_code == 7
    assert failed.text == "out\nerr\n[exit status: 7]"
    ok = await shell.run("true", LONG_S)
    assert ok.status == "ok" and ok.exit_code == 0 and ok.text == ""


async def test_a_syntax_error_is_that_commands_own_and_the_next_one_runs(make: MakeShell) -> None:
    shell = await make()
    broken = await shell.run("echo 'unbalanced", LONG_S)
    assert broken.status == "error" and "unexpected EOF" in broken.output
    assert (await shell.run("echo fine", LONG_S)).output == "fine\n"


async def test_a_command_past_its_timeout_is_interrupted_and_the_session_goes_on(make: MakeShell) -> None:
    shell = await make(interrupt_grace_s=30.0)
    await shell.run("cd /tmp && export KEPT=yes", LONG_S)
    late = await shell.run("echo started; sleep 600; echo never", 1.0)
    assert late.status == "timeout"
    assert late.output == "started\n"
    assert late.note is not None and "interrupted" in late.note and "1 s timeout" in late.note
    after = await shell.run('echo "$PWD $KEPT"', LONG_S)
    assert after.status == "ok" and after.output == "/tmp yes\n"
    assert shell.restarts == 0


async def test_a_command_that_ignores_the_interrupt_costs_the_session_and_the_model_is_told(
    make: MakeShell,
) -> None:
    shell = await make(interrupt_grace_s=0.5)
    await shell.run("export LOST=1", LONG_S)
    stuck = await shell.run("trap '' INT; sleep 600", 1.0)
    assert stuck.status == "restarted" and stuck.exit_code is None
    assert stuck.note is not None and "state" in stuck.note and "lost" in stuck.note
    fresh = await shell.run('echo "[${LOST:-unset}]"', LONG_S)
    assert fresh.status == "ok" and fresh.output == "[unset]\n"
    assert shell.restarts == 1


async def test_exit_ends_the_session_and_the_next_command_gets_a_fresh_one(make: MakeShell) -> None:
    shell = await make()
    await shell.run("export LOST=1", LONG_S)
    gone = await shell.run("echo bye; exit 3", LONG_S)
    assert gone.status == "restarted"
    assert gone.note is not None and "exit code 3" in gone.note and "lost" in gone.note
    assert (await shell.run('echo "[${LOST:-unset}]"', LONG_S)).output == "[unset]\n"


async def test_restart_starts_a_fresh_session(make: MakeShell) -> None:
    shell = await make()
    await shell.run("export LOST=1", LONG_S)
    await shell.restart()
    assert (await shell.run('echo "[${LOST:-unset}]"', LONG_S)).output == "[unset]\n"


async def test_output_is_bounded_in_the_middle(make: MakeShell) -> None:
    shell = await make(output_limit=1000)
    result = await shell.run("head -c 200000 /dev/zero | tr '\\0' a; echo; echo THE-END", LONG_S)
    assert result.status == "ok" and result.truncated
    assert len(result.text) <= 1000
    assert "truncated" in result.text
    # The next command's output is its own: nothing of the flood is left over.
    assert (await shell.run("echo next", LONG_S)).output == "next\n"


@pytest.fixture
def silent_stdin() -> Iterator[None]:
    """This process's stdin is a pipe that never ends: a shell that inherited it would wait forever."""
    read_end, write_end = os.pipe()
    saved = os.dup(0)
    os.dup2(read_end, 0)
    try:
        yield
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read_end, write_end):
            os.close(fd)


@pytest.mark.parametrize(
    "command",
    [
        "read line; echo read=$?",
        "cat; echo cat=$?",
        f"{sys.executable} -c 'input()'; echo input=$?",
        f"{sys.executable} -i -c 'x = 1'; echo repl=$?",
        "vim notes.txt; echo vim=$?",
        "vi notes.txt; echo vi=$?",
        "nano notes.txt; echo nano=$?",
        "echo text > f && less f; echo less=$?",
        "echo text > f && more f; echo more=$?",
        "git init -q repo && cd repo && echo a > a && git add a && "
        "git -c user.name=t -c user.email=t@t.invalid commit -q; echo commit=$?",
        "git init -q repo2 && cd repo2 && git log; git -P help -a >/dev/null; echo log=$?",
    ],
)
async def test_a_command_that_waits_for_a_terminal_is_answered_promptly(
    make: MakeShell, command: str, silent_stdin: None
) -> None:
    shell = await make()
    result = await shell.run(command, LONG_S)
    # Answered by the command itself (end of input, no editor, no pager): never the timeout.
    assert result.status == "ok", result.text
    assert "=" in result.output.splitlines()[-1]


async def test_background_processes_end_with_the_session(make: MakeShell, where: str) -> None:
    shell = await make()
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 10**6}"
    # One background job in the shell's group, one that left it (its own session).
    detached = "setsid sleep" if shutil.which("setsid") and where == "caged" else "sleep"
    started = await shell.run(f"sleep {marker}1 & {detached} {marker}2 & echo started", LONG_S)
    assert started.output == "started\n"
    await wait_for_async(lambda: len(processes_mentioning(marker)) == 2, what="both background sleeps")
    await shell.aclose()
    await wait_for_async(lambda: not processes_mentioning(marker), what="the background sleeps to end")


@pytest.mark.bwrap
@requires_bwrap()
@pytest.mark.parametrize("where", ["caged"], indirect=True)  # only a caged session has its own PID namespace
async def test_a_caged_session_writes_the_workspace_and_cannot_see_the_worker(
    make: MakeShell, tmp_path: Path
) -> None:
    shell = await make()
    result = await shell.run(f"test -e /proc/{os.getpid()}; echo seen=$?; echo made > mine.txt", LONG_S)
    assert result.output == "seen=1\n"
    assert (tmp_path / "ws" / "mine.txt").read_text() == "made\n"


def test_bash_quote_survives_every_character() -> None:
    text = "a'b\\c\"$HOME`x`\n\t\x01\x7fé€"
    assert bash_quote(text) == "$'a\\'b\\\\c\"$HOME`x`\\x0a\\x09\\x01\\x7fé€'"
