"""Forked executors under a supervisor that is not root: the forked one is what a started one is.

A non-root supervisor's warm worker asks the executor template for its ``python`` executors as a
root one does; the template, not root, may not join the executor's PID namespace itself, so a
go-between it forks joins every namespace of the nested cage's holder at once (user namespace
included), takes its root and forks the executor there, the template's child
(:mod:`rollcage.tools._executor_template`, :func:`rollcage.cage.fork_into`). These tests run real
rollouts of the real worker, as the unprivileged user, and hold a forked executor to a started one
(a cold start's) from the host: credentials, capabilities, ``no_new_privs``, seccomp, limits,
namespaces, mounts, cgroups, environment, command line, working directory, descriptors; then a stop,
an executor killed in the middle of a cell, a SIGKILLed worker and the deadline leave nothing
behind, and an entry the kernel refuses starts that executor and the worker's later ones.

As root the supervisor takes its root path (tests/supervisor/test_forked_executor.py): these
tests are not collected there, and the last one runs this file again as ``rollcage-test``.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rollcage.forkserver import ExecutorClient, ExecutorStart, ExecutorStarted, Refused, receive_now, send
from rollcage.policy import PolicyServer
from rollcage.procs import PidfdChild, read_proc
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from rollcage.tools import _forked
from tests.helpers.host_view import (
    NAMESPACES,
    REFUSE_SETNS,
    SETNS_NUMBERS,
    comm,
    describe,
    namespaces,
    not_root,
    pass_as_the_test_user,
    rollout_processes,
)
from tests.helpers.supervisor_env import processes_with_token, requires_bwrap
from tests.helpers.waiting import alive, wait_for, wait_for_async
from tests.helpers.worker_env import worker_input

pytestmark = [requires_bwrap(), pytest.mark.bwrap]

READY = 'open("ready", "w").write("x")\nimport time\ntime.sleep(600)\n'
"""A cell that says it runs (a file in the workspace), then waits to be stopped."""
FACTS = "import os\nprint('FACTS', os.getppid(), os.getpid())\n"
SLEEPER = """
import subprocess, time
child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
open("sleeper.pid", "w").write(str(child.pid))
open("ready", "w").write("x")
time.sleep(600)
"""


@pytest.fixture(autouse=True)
def _no_strays() -> Iterator[None]:
    """Every test must leave no supervised process behind."""
    yield
    assert processes_with_token() == [], "a supervised process outlived its test"


def _python(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "python", "arguments": {"code": code}}]}


def _prepare(root: Path, model_url: str, *, tool_timeout_s: float = 120) -> None:
    root.mkdir()
    (root / "workspace").mkdir()
    data = worker_input(model_url=model_url, task_id="t", tool_timeout_s=tool_timeout_s)
    data["executor"] = {"interrupt_grace_s": 0.5}
    data["model"]["timeout_s"] = 600  # a hanging model call outlasts any deadline here
    (root / "input.json").write_text(json.dumps(data))


def _config(mode: str, **fields: Any) -> SupervisorConfig:
    return SupervisorConfig(sandbox=BwrapSandbox(worker_start=mode), **fields)


def _token(root: Path) -> str | None:
    try:
        return (root / ".sandbox" / "token").read_text().splitlines()[0]
    except (FileNotFoundError, IndexError):
        return None


def _executor_of(root: Path) -> int | None:
    """The rollout's executor: the interpreter running ``-c`` that is not the worker (a started one's
    bubblewrap carries its command line too, but is not an interpreter)."""
    for pid, words in rollout_processes(root).items():
        if b"-c" in words and b"worker" not in words and comm(pid).startswith("python"):
            return pid
    return None


def _describe(pid: int, *, token: str) -> dict[str, Any]:
    """What an executor is, from the host (:func:`tests.helpers.host_view.describe`): its arguments (the
    boot program's first words, its whole is long), its parent's name and its namespaces."""
    seen = describe(pid, token=token)
    seen["argv"] = [word[:40] for word in seen.pop("words")[1:]]
    seen["parent"] = comm(seen.pop("ppid"))
    seen["namespaces"] = namespaces(pid)
    return seen


async def _running_executor(mode: str, root: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A rollout in ``mode``, stopped while its executor runs a cell: executor, worker, receipt."""
    with PolicyServer({"tasks": {"t": [_python(READY), {"text": "never"}]}}, port=0) as server:
        _prepare(root, server.base_url)
        stop = asyncio.Event()
        task = asyncio.ensure_future(supervise(root, _config(mode, deadline_s=120, grace_s=10), stop=stop))
        try:
            ready = root / "workspace" / "ready"
            await wait_for_async(lambda: task.done() or ready.exists(), what=f"the {mode} executor's cell")
            assert not task.done(), f"the rollout ended before its cell ran: {task.result()!r}"
            pid = await wait_for_async(lambda: _executor_of(root), what=f"the {mode} executor's process")
            token = _token(root)
            assert token is not None
            seen = _describe(pid, token=token)
            worker = next(
                p for p, words in rollout_processes(root).items() if b"worker" in words and p != pid
            )
            worker_seen = {"namespaces": namespaces(worker)}
            left = list(rollout_processes(root))
        finally:
            stop.set()
            receipt = await task
    assert not any(alive(other) for other in left), "a process of the rollout outlived its stop"
    return seen, worker_seen, receipt.model_dump()


@not_root
@pytest.mark.timeout(240)
async def test_a_forked_executor_without_root_is_what_a_started_one_is(tmp_path: Path) -> None:
    started, started_worker, started_receipt = await _running_executor("cold", tmp_path / "cold")
    forked, forked_worker, forked_receipt = await _running_executor("warm", tmp_path / "warm")

    # Forked: its parent is the executor template (outside the cage), it leads its own session (the
    # worker interrupts its group); started: bubblewrap's, in its monitor's session.
    assert forked.pop("parent").startswith("python"), forked
    assert started.pop("parent") == "bwrap", started
    assert (forked.pop("leads_its_session"), started.pop("leads_its_session")) == (True, False)
    assert (forked.pop("leads_its_group"), started.pop("leads_its_group")) == (True, False)
    for receipt in (started_receipt, forked_receipt):
        assert receipt["outcome"] == "cancelled", receipt
        assert receipt["result_valid"] and receipt["cleanup_confirmed"], receipt

    # In its own cage's namespaces (none of the worker's but the ones the nested cage shares with it).
    shared = {
        name for name in NAMESPACES if started["namespaces"][name] == started_worker["namespaces"][name]
    }
    assert shared == {
        name for name in NAMESPACES if forked["namespaces"][name] == forked_worker["namespaces"][name]
    }
    assert not {"user", "mnt", "pid"} & shared, shared
    mine = namespaces(os.getpid())
    for name in NAMESPACES:
        assert forked["namespaces"][name] != mine[name], name
    forked.pop("namespaces")
    started.pop("namespaces")

    # Its control socket at the number its command line names, as a started one inherits it: the
    # worker's number for it, one more in a warm worker (which holds its socket to the executor
    # template besides), so named apart from the rest.
    for seen in (forked, started):
        number = int(seen["argv"][-2])
        assert seen["fds"].pop(number) == "socket", seen["fds"]
        seen["argv"][-2] = "<control>"

    differ = {key: (forked[key], started[key]) for key in started if forked[key] != started[key]}
    assert not differ, json.dumps(differ, indent=1)
    assert forked["status"]["CapEff"] == forked["status"]["CapBnd"] == "0000000000000000"
    assert forked["status"]["NoNewPrivs"] == "1"
    assert not forked["root_is_host"] and forked["cgroups"] == started["cgroups"]


@not_root
@pytest.mark.timeout(240)
async def test_an_executor_killed_in_a_cell_is_forked_again(tmp_path: Path) -> None:
    root = tmp_path / "r"
    script = {"tasks": {"t": [_python(READY), _python(FACTS), {"text": "done"}]}}
    with PolicyServer(script, port=0, keep_bodies=True) as server:
        _prepare(root, server.base_url)
        task = asyncio.ensure_future(supervise(root, _config("warm", deadline_s=120)))
        try:
            ready = root / "workspace" / "ready"
            await wait_for_async(lambda: task.done() or ready.exists(), what="the cell to run")
            executor = await wait_for_async(lambda: _executor_of(root), what="the executor")
            info = read_proc(executor)
            assert info is not None and comm(info.ppid).startswith("python"), "not a forked executor"
            os.kill(executor, signal.SIGKILL)
        finally:
            receipt = await task
        outputs = [str((entry.body or {})["messages"][-1]["content"]) for entry in server.request_log[1:]]
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert "killed" in outputs[0] or "restarted" in outputs[0], outputs[0]
    # The next cell's executor is forked again: its parent is outside its PID namespace (0 there).
    assert outputs[1].split("FACTS", 1)[1].split()[0] == "0", outputs[1]
    assert not alive(executor)


@not_root
@pytest.mark.timeout(240)
async def test_a_sigkilled_worker_leaves_nothing_of_its_forked_executor(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with PolicyServer({"tasks": {"t": [_python(SLEEPER), {"text": "never"}]}}, port=0) as server:
        _prepare(root, server.base_url)
        task = asyncio.ensure_future(supervise(root, _config("warm", deadline_s=120)))
        try:
            ready = root / "workspace" / "ready"
            await wait_for_async(lambda: task.done() or ready.exists(), what="the agent's sleeper")
            executor = await wait_for_async(lambda: _executor_of(root), what="the executor")
            info = read_proc(executor)
            assert info is not None and comm(info.ppid).startswith("python"), "not a forked executor"
            processes = rollout_processes(root)
            worker = next(pid for pid, words in processes.items() if b"worker" in words and pid != executor)
            sleeper = int((root / "workspace" / "sleeper.pid").read_text())
            left = list(processes)
            os.kill(worker, signal.SIGKILL)
        finally:
            receipt = await task
    assert receipt.cleanup_confirmed, receipt.outcome_reason
    # The executor's cage ends with its holder (whose stdin was the worker's): the executor, its sleeper.
    await wait_for_async(lambda: not any(alive(pid) for pid in left), within_s=20, what="the rollout to die")
    assert not alive(executor)
    del sleeper  # a PID in the cage's namespace, not the host's: gone with the rest of ``left``


@not_root
@pytest.mark.timeout(240)
async def test_the_deadline_reaps_a_forked_executors_tree(tmp_path: Path) -> None:
    root = tmp_path / "r"
    with PolicyServer({"tasks": {"t": [_python(SLEEPER), {"text": "never"}]}}, port=0) as server:
        _prepare(root, server.base_url)
        task = asyncio.ensure_future(supervise(root, _config("warm", deadline_s=40, grace_s=1)))
        try:
            ready = root / "workspace" / "ready"
            await wait_for_async(lambda: task.done() or ready.exists(), what="the agent's sleeper")
            assert not task.done(), f"the rollout ended before its cell ran: {task.result()!r}"
            executor = await wait_for_async(lambda: _executor_of(root), what="the executor")
            info = read_proc(executor)
            assert info is not None and comm(info.ppid).startswith("python"), "not a forked executor"
            left = list(rollout_processes(root))
        finally:
            receipt = await task
    assert receipt.outcome == "timeout", receipt.outcome_reason
    assert receipt.deadline_fired and receipt.cleanup_confirmed
    assert not any(alive(pid) for pid in left), "a process of the rollout outlived its deadline"


_REFUSING = (
    REFUSE_SETNS
    + """
import os
# The template's environment as given: not the LC_CTYPE this interpreter added to it in the C locale.
env = {name: value for name, value in os.environ.items() if name != "LC_CTYPE"}
os.execve(sys.executable, [sys.executable, *sys.argv[2:]], env)
"""
)


def _executor_template(*, refusing: bool) -> tuple[socket.socket, PidfdChild]:
    """A live executor template, as the warm template starts it (under a filter that refuses ``setns``)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs.set_inheritable(True)
    argv = [sys.executable, "-I", "-u", str(_forked.PROGRAM), str(theirs.fileno()), str(os.getpid())]
    if refusing:
        nr = SETNS_NUMBERS[platform.machine()]
        argv = [sys.executable, "-I", "-c", _REFUSING, str(nr), *argv[1:]]
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "TZ": "UTC"}
    pid = os.posix_spawn(sys.executable, argv, env)
    theirs.close()
    child = PidfdChild.of_child(pid)
    assert child is not None
    return ours, child


def _answer_in_a_nested_cage(refusing: bool, tmp_path: Path) -> Any:
    """One executor start, as a non-root worker asks for it, against a nested cage's holder: the answer."""
    control, template = _executor_template(refusing=refusing)
    holder = None
    try:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        client = ExecutorClient(
            uid=os.getuid(), gid=os.getgid(), umask=0o022, limits=[], cgroups=0, userns=True
        )
        send(control, client, [theirs.fileno()])
        theirs.close()
        mine.settimeout(10)
        holder = subprocess.Popen(
            [
                # Every namespace of the cage its own, as the nested cage's are (rollcage.cage._nested).
                *("bwrap", "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-ipc"),
                *("--unshare-uts", "--unshare-net", "--unshare-cgroup-try", "--die-with-parent"),
                *("--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"),
                *("--as-pid-1", "/bin/sh", "-c", "printf r; read _"),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert holder.stdout is not None and holder.stdout.read(1) == b"r"
        inner = wait_for(lambda: _child_named(holder.pid, "sh"), what="the holder in its cage")
        pidfd = os.pidfd_open(inner)
        out_r, out_w = os.pipe()
        control_end, executor_end = socket.socketpair()
        boot = "import os\nos.write(1, b'in the cage')\n"
        request = ExecutorStart(cwd=str(tmp_path), env={"TZ": "UTC"}, boot=boot, argv=["python", "3"])
        try:
            send(mine, request, [pidfd, executor_end.fileno(), out_w, out_w])
        finally:
            for fd in (pidfd, out_w):
                os.close(fd)
            executor_end.close()
        answer = receive_now(mine, [ExecutorStarted, Refused])
        for fd in answer.fds:
            os.close(fd)
        if isinstance(answer.message, ExecutorStarted):
            with os.fdopen(out_r, "rb") as output:
                assert output.read() == b"in the cage"
        else:
            os.close(out_r)
        control_end.close()
        mine.close()
        return answer.message
    finally:
        if holder is not None:
            holder.kill()
            holder.communicate(timeout=10)
        control.close()
        template.kill()
        template.reap()


def _child_named(parent: int, command: str) -> int | None:
    for name in os.listdir("/proc"):
        info = read_proc(int(name)) if name.isdigit() else None
        if info is not None and info.ppid == parent and comm(info.pid) == command:
            return info.pid
    return None


@not_root
@pytest.mark.timeout(60)
def test_an_entry_the_kernel_refuses_says_so_for_good(tmp_path: Path) -> None:
    """The executor template's go-between, refused ``setns`` by the kernel, answers that every later start
    would be refused too (the worker then starts this executor and its later ones itself); allowed, it
    forks the executor into the nested cage."""
    if platform.machine() not in SETNS_NUMBERS:
        pytest.skip(f"optional: setns's number on {platform.machine()} is not known to this test")
    allowed = _answer_in_a_nested_cage(False, tmp_path)
    assert isinstance(allowed, ExecutorStarted), allowed
    refused = _answer_in_a_nested_cage(True, tmp_path)
    assert isinstance(refused, Refused), refused
    assert refused.final, refused
    assert "cannot join the executor's cage's namespaces" in refused.reason, refused.reason
    assert "Operation not permitted" in refused.reason, refused.reason


@pytest.mark.timeout(600)
def test_this_suite_and_the_forked_executor_suite_pass_as_an_unprivileged_user() -> None:
    """Non-root forked executors, for real: this file again as a plain user, and the root path's suite
    (tests/supervisor/test_forked_executor.py, unmodified: a forked executor from inside against a
    started one, refusals, a dead or hung executor template, interrupts, orphans) on the non-root path."""
    pass_as_the_test_user(__file__, str(Path(__file__).with_name("test_forked_executor.py")))
