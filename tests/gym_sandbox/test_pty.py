"""PTY and pipe sessions of the ``rollcage`` provider, driven through NeMo Gym's own ``AsyncSandbox.pty``.

The scenario runs once in the side environment ``nemo-gym-rollcage`` (NeMo Gym 0.7.0 next to rollcage,
scripts/upstream-envs) against a real sandbox of a busybox image; each test below checks one promise
of NeMo Gym's ``SandboxPtySession`` on what it reported: an interactive shell on a real terminal
(``tty``, its size, a resize, a controlling terminal), a command's exit status, signals to its
process group, pipe mode's separate stderr, detached runs, and a session left open when the sandbox
closes (ended: no process left, its reads refused, journaled).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.supervisor.imageroot import release_image_root
from tests.helpers.task_images import make_task_image
from tests.helpers.upstream import run_upstream

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the rollcage provider needs root"),
    # One worker runs the scenario once: a second copy beside it would be waste.
    pytest.mark.xdist_group("gym-pty"),
]

SCENARIO = r"""
import asyncio, json, os, random, sys
from nemo_gym.sandbox import AsyncSandbox, SandboxSpec
from nemo_gym.sandbox.providers.base import SandboxPtyError, SandboxPtySession, SupportsSandboxPty

image, state, store = sys.argv[1], sys.argv[2], sys.argv[3]

async def until(session, needle, limit=60):
    # Reads up to ``needle``; the commands echo it split (EN''D), so the terminal's echo never matches.
    buffer = b""
    async with asyncio.timeout(limit):
        while needle not in buffer:
            chunk = await session.read()
            if not chunk:
                break
            buffer += chunk
    return buffer.decode(errors="replace")

async def drain(read):
    buffer = b""
    async with asyncio.timeout(60):
        while chunk := await read():
            buffer += chunk
    return buffer.decode(errors="replace")

def sleepers(mark):
    # Host processes whose command line is ``sleep MARK`` (the sandbox's, seen from outside).
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                if file.read() == b"sleep\0" + mark.encode() + b"\0":
                    found.append(int(pid))
        except OSError:
            pass
    return found

async def main():
    report = {}
    spec = SandboxSpec(image=image, workdir="/work/task")
    box = await AsyncSandbox({"rollcage": {"state_dir": state, "image_store": store}}, spec).start()
    async with box:
        report["capable"] = isinstance(box._provider, SupportsSandboxPty)
        # An interactive shell: the image's, on the sandbox's own terminal.
        shell = await box.pty.create(rows=33, cols=101)
        report["shell_protocol"] = isinstance(shell, SandboxPtySession)
        report["shell_mode"] = shell.mode
        await shell.write(b"tty; stty size; ( : </dev/tty ) 2>/dev/null && echo has-ctty; echo EN''D1\n")
        report["tty"] = await until(shell, b"END1")
        await shell.resize(40, 120)
        await shell.write(b"stty size; echo EN''D2\n")
        report["resized"] = await until(shell, b"END2")
        # NeMo Gym's own marker discipline over the shell it keeps as the default session.
        r = await box.pty.exec("echo via-pty; false")
        report["pty_exec"] = [r.stdout, r.return_code]
        await shell.close()
        await shell.close()  # idempotent
        report["shell_closed"] = shell.closed
        # A command session: its exit status, then the end of its output.
        command = await box.pty.create("echo hello; exit 7")
        report["command_exit"] = await command.wait_exit(timeout_s=60)
        report["command_output"] = await drain(command.read)
        report["command_stderr"] = (await command.read_stderr(timeout_s=60)).decode()
        await command.close()
        # Signals reach the command's process group.
        report["signals"] = {}
        for name in ("SIGINT", "SIGTERM"):
            async with await box.pty.create("echo EN''D; exec sleep 9301") as sleeper:
                await until(sleeper, b"END")
                await sleeper.send_signal(name)
                report["signals"][name] = await sleeper.wait_exit(timeout_s=60)
        # Pipe mode: no terminal, stderr apart; through a session and through pty.exec.
        piped = await box.pty.create(
            "test -t 0 || echo no-tty; echo to-out; echo to-err >&2; exit 5", pty=False
        )
        report["pipe"] = [
            piped.mode,
            await piped.wait_exit(timeout_s=60),
            await drain(piped.read),
            await drain(piped.read_stderr),
        ]
        await piped.close()
        r = await box.pty.exec("echo o; echo e >&2; exit 6", pty=False)
        report["pipe_exec"] = [r.stdout, r.stderr, r.return_code]
        # A detached run (the session's run_detached): output and exit status.
        r = await box.pty.exec("echo detached; (exit 3)", detach=True, poll_interval_s=0.1)
        report["detached"] = [r.stdout, r.return_code]
        # Another user than the image's cannot be honoured.
        try:
            await box.pty.create("id", user="nobody")
            report["user"] = "started"
        except ValueError as exc:
            report["user"] = str(exc)
        # A session left open while the sandbox closes, with a child in its group and one outside it.
        # Its sleeps are told apart from any other run's by their length (the scan is machine-wide).
        inside, outside = (str(random.randrange(10**8, 10**9)) for _ in range(2))
        left = await box.pty.create(
            f"setsid sleep {inside} & sleep {outside} & "
            "until [ \"$(pidof sleep | wc -w)\" -ge 2 ]; do :; done; echo EN''D; wait"
        )
        await until(left, b"END")
        report["left_before"] = [len(sleepers(inside)), len(sleepers(outside))]
    report["left_closed"] = left.closed
    try:
        await left.read(timeout_s=5)
        report["left_read"] = "read"
    except SandboxPtyError as exc:
        report["left_read"] = "SandboxPtyError"
    report["left_after"] = [sleepers(inside), sleepers(outside), os.path.exists(f"/proc/{left.pid}")]
    print(json.dumps(report))

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def scenario() -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """What the scenario reported, and its sandbox's journal."""
    scratch = Path(tempfile.mkdtemp(prefix="rollcage-pty-test-"))
    state = Path(tempfile.mkdtemp(prefix="rollcage-gym-test-", dir="/tmp"))
    os.chmod(state, 0o711)  # the sandbox's uid passes through it
    try:
        image = make_task_image(scratch / "image", python=False)
        out = run_upstream(
            "nemo-gym-rollcage", SCENARIO, image.ref, str(state), str(scratch / "store"), timeout=600
        )
        (directory,) = [d for d in state.iterdir() if (d / "execs.jsonl").exists()]
        journal = [json.loads(line) for line in (directory / "execs.jsonl").read_text().splitlines()]
        yield out, journal
    finally:
        for sandbox in state.iterdir():
            release_image_root(sandbox)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def test_an_interactive_shell_runs_on_the_sandboxs_own_sized_terminal(scenario: Any) -> None:
    out, _ = scenario
    assert out["capable"] and out["shell_protocol"] and out["shell_mode"] == "pty"
    # tty names the cage's terminal; its size is the spec's; it is the shell's controlling terminal.
    assert "/dev/pts/0\r\n33 101\r\nhas-ctty\r\nEND1" in out["tty"], out["tty"]
    assert "40 120\r\nEND2" in out["resized"], out["resized"]
    assert out["pty_exec"] == ["via-pty\r\n", 1]
    assert out["shell_closed"] is True


def test_a_command_sessions_exit_status_comes_from_wait_exit(scenario: Any) -> None:
    out, _ = scenario
    assert out["command_exit"] == 7
    assert out["command_output"] == "hello\r\n"
    assert out["command_stderr"] == ""


def test_signals_reach_the_sessions_process_group(scenario: Any) -> None:
    out, _ = scenario
    assert out["signals"] == {"SIGINT": 128 + 2, "SIGTERM": 128 + 15}


def test_pipe_mode_has_no_terminal_and_keeps_stderr_apart(scenario: Any) -> None:
    out, _ = scenario
    assert out["pipe"] == ["pipe", 5, "no-tty\nto-out\n", "to-err\n"]
    assert out["pipe_exec"] == ["o\n", "e\n", 6]


def test_a_detached_run_returns_its_output_and_status(scenario: Any) -> None:
    out, _ = scenario
    assert out["detached"] == ["detached\r\n", 3]


def test_a_user_other_than_the_images_is_refused(scenario: Any) -> None:
    out, _ = scenario
    assert "image's user" in out["user"] and "nobody" in out["user"]


def test_a_session_left_open_ends_with_its_sandbox(scenario: Any) -> None:
    out, journal = scenario
    assert out["left_before"] == [1, 1]
    assert out["left_closed"] is True and out["left_read"] == "SandboxPtyError"
    assert out["left_after"] == [[], [], False]
    last = journal[-1]
    assert last["mode"] == "pty" and last["ended_by_close"] and last["command"].startswith("setsid sleep")


def test_every_session_is_journaled_like_an_exec(scenario: Any) -> None:
    _, journal = scenario
    assert [line["seq"] for line in journal] == list(range(1, len(journal) + 1))
    sessions = [line for line in journal if line.get("session")]
    modes = [(line["command"], line["mode"], line["exit_code"]) for line in sessions]
    assert ("echo hello; exit 7", "pty", 7) in modes
    assert ("/bin/sh -i", "pty", 137) in modes  # the shell, ended by its close
    hello = next(line for line in sessions if line["command"] == "echo hello; exit 7")
    assert hello["stdout_bytes"] == len("hello\r\n") and len(hello["stdout_sha256"]) == 64
    piped = next(line for line in sessions if line["command"].startswith("test -t 0"))
    assert piped["mode"] == "pipe" and piped["stderr_bytes"] == len("to-err\n")
