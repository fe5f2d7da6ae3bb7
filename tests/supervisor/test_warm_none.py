"""Warm worker starts without a sandbox (``--sandbox none``): the same worker a cold start runs.

With ``--sandbox none`` the supervisor's default is a warm start too: a holder
stands where the worker would, and the pre-imported template forks the worker
beside it, the supervisor's own child, uncaged. These tests run real rollouts of
the real worker both ways and hold the warm one to the cold one (credentials,
limits, environment, command line, working directory, descriptors, receipts,
results), then the guarantees a cold worker has: a stop is a cancellation, the
deadline kills the whole tree (a grandchild the agent's code left sleeping
included), a killed supervisor takes the worker with it, and a start the template
refuses runs the cold worker instead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import rollcage.supervisor.warm as warm_module
from rollcage.errors import SupervisorError
from rollcage.policy import PolicyServer
from rollcage.procs import ensure_subreaper, read_proc
from rollcage.protocol import WorkerResult
from rollcage.supervisor import NoSandbox, SupervisorConfig, supervise
from rollcage.supervisor.bytecode import worker_bytecode
from rollcage.supervisor.warm import template_for
from tests.helpers.supervisor_env import processes_with_token
from tests.helpers.waiting import alive, reaped, wait_for, wait_for_async
from tests.helpers.worker_env import worker_input

TOKEN = "ROLLCAGE_SUPERVISION_TOKEN"
STATUS_FIELDS = ("Uid", "Gid", "Groups", "CapEff", "CapBnd", "NoNewPrivs", "Seccomp", "Umask")
NEVER = {"tasks": {"t": [{"text": "never"}]}}


@pytest.fixture(autouse=True)
def _no_strays() -> Any:
    """Every test must leave no supervised process behind."""
    yield
    assert processes_with_token() == [], "a supervised process outlived its test"


def _prepare(root: Path, model_url: str, *, model_timeout_s: float | None = None) -> None:
    root.mkdir()
    (root / "workspace").mkdir()
    data = worker_input(model_url=model_url, task_id="t")
    if model_timeout_s is not None:
        data["model"]["timeout_s"] = model_timeout_s
    (root / "input.json").write_text(json.dumps(data))


def _rollout_processes(root: Path) -> dict[int, list[bytes]]:
    """The rollout's live processes: PID -> command line (a supervision token in the environment and
    the rollout's input on the command line: the worker, and a warm start's holder, whose arguments
    are the cold start's)."""
    marked = f"{TOKEN}=".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as file:
                if not any(entry.startswith(marked) for entry in file.read().split(b"\0")):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
        except OSError:
            continue
        if any(word.startswith(f"{root}/".encode()) for word in words):
            found[int(name)] = words
    return found


def _worker_of(root: Path) -> int | None:
    """The rollout's worker: the interpreter running ``rollcage worker`` on the rollout's input."""
    for pid, words in _rollout_processes(root).items():
        if b"worker" not in words:
            continue
        try:
            with open(f"/proc/{pid}/comm") as file:
                if file.read().startswith("python"):
                    return pid
        except OSError:
            continue
    return None


def _describe(pid: int) -> dict[str, Any]:
    """What a process is, from the outside, with what differs between any two rollouts left out."""
    with open(f"/proc/{pid}/status") as file:
        status = dict(line.split(":", 1) for line in file.read().splitlines() if ":" in line)
    with open(f"/proc/{pid}/environ", "rb") as file:
        env = dict(
            entry.decode().split("=", 1) for entry in file.read().split(b"\0") if entry and b"=" in entry
        )
    env[TOKEN] = "<token>" if len(env.get(TOKEN, "")) >= 32 else f"wrong: {env.get(TOKEN)}"
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        words = file.read().split(b"\0")
    with open(f"/proc/{pid}/limits") as file:
        limits = file.read()
    info = read_proc(pid)
    assert info is not None
    return {
        "status": {name: status[name].strip() for name in STATUS_FIELDS},
        "leads_its_group": info.pgid == pid,
        "environ": env,
        "args": [word.decode() for word in words[words.index(b"worker") + 1 :]],
        "limits": limits,
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "fds": {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (0, 1, 2)},
        "pdeathsig": _pdeathsig_parent(pid),
    }


def _pdeathsig_parent(pid: int) -> int | None:
    """The worker's parent, which must be this process (the supervisor) both ways."""
    info = read_proc(pid)
    return None if info is None else info.ppid


async def _running_worker(mode: str, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout in ``mode``, stopped while its worker waits on its first model call: worker, receipt."""
    with PolicyServer(NEVER, port=0, faults=["call=1:kind=hang"]) as server:
        _prepare(root, server.base_url)
        stop = asyncio.Event()
        config = SupervisorConfig(deadline_s=120, grace_s=10, sandbox=NoSandbox(worker_start=mode))
        task = asyncio.ensure_future(supervise(root, config, stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what=f"the {mode} worker's first model call")
            pid = await wait_for_async(lambda: _worker_of(root), what=f"the {mode} worker's process")
            seen = _describe(pid)
            seen["others"] = sorted(
                words[0].decode() for other, words in _rollout_processes(root).items() if other != pid
            )
        finally:
            stop.set()
            receipt = await task
    return seen, receipt.model_dump()


async def test_a_warm_worker_is_what_a_cold_start_runs_and_a_stop_cancels_it(tmp_path: Path) -> None:
    cold, cold_receipt = await _running_worker("cold", tmp_path / "cold")
    warm, warm_receipt = await _running_worker("warm", tmp_path / "warm")
    # The warm worker stands beside its holder, a shell that only relays its exit status; the cold one
    # is the supervisor's child alone.
    assert warm.pop("others") == ["/bin/sh"] and cold.pop("others") == []
    for receipt in (cold_receipt, warm_receipt):
        assert receipt["outcome"] == "cancelled", receipt["outcome_reason"]
        assert receipt["cleanup_confirmed"] and receipt["sandbox"] == "none"
    for key in ("outcome", "exit_code", "exit_signal", "result_present", "result_valid", "stop_requested"):
        assert warm_receipt[key] == cold_receipt[key], key
    assert warm_receipt["exit_signal"] is None and warm_receipt["result_present"]  # it ended itself
    assert [s["reason"] for s in warm_receipt["signals_sent"]] == ["stop"]
    for key in cold:
        if key in ("args", "cwd", "fds"):
            # The rollout directory's own paths: the same names under each rollout's root.
            assert json.loads(json.dumps(warm[key]).replace("/warm", "/R")) == json.loads(
                json.dumps(cold[key]).replace("/cold", "/R")
            ), key
        else:
            assert warm[key] == cold[key], key
    assert warm["pdeathsig"] == os.getpid()


def _python(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "python", "arguments": {"code": code}}]}


async def _complete(root: Path, mode: str) -> tuple[dict[str, Any], WorkerResult, list[str]]:
    script = {"tasks": {"t": [_python("print(6 * 7)"), {"text": "42"}]}}
    with PolicyServer(script, port=0) as server:
        _prepare(root, server.base_url)
        receipt = await supervise(
            root, SupervisorConfig(deadline_s=120, sandbox=NoSandbox(worker_start=mode))
        )
    result = WorkerResult.model_validate_json((root / "result.json").read_bytes())
    kinds = [
        json.loads(line).get("kind", "") for line in (root / "checkpoint.jsonl").read_text().splitlines()
    ]
    return receipt.model_dump(), result, kinds


async def test_a_warm_rollout_completes_with_the_result_and_checkpoint_of_a_cold_one(tmp_path: Path) -> None:
    cold_receipt, cold, cold_kinds = await _complete(tmp_path / "cold", "cold")
    warm_receipt, warm, warm_kinds = await _complete(tmp_path / "warm", "warm")
    for key in (
        "outcome",
        "exit_code",
        "exit_signal",
        "result_present",
        "result_valid",
        "last_checkpoint_seq",
    ):
        assert warm_receipt[key] == cold_receipt[key], key
    assert warm_receipt["outcome"] == "completed", warm_receipt["outcome_reason"]
    assert warm.termination_reason == cold.termination_reason == "completed"
    assert warm.response == cold.response
    assert len(warm.trajectory.model_calls) == len(cold.trajectory.model_calls) == 2
    assert warm_kinds == cold_kinds
    assert sorted(p.name for p in (tmp_path / "warm").iterdir()) == sorted(
        p.name for p in (tmp_path / "cold").iterdir()
    )
    # This thread's template forked the worker and lives on for the next (it has nothing to leave).
    template = template_for(worker_bytecode(), thread=threading.get_ident())
    first = template.pid
    assert first is not None
    again, _, _ = await _complete(tmp_path / "again", "warm")
    assert again["outcome"] == "completed" and template.pid == first


SLEEPER = """
import subprocess
child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
open("sleeper.pid", "w").write(str(child.pid))
print("started", child.pid)
"""


@pytest.mark.timeout(150)
async def test_the_deadline_kills_a_warm_worker_and_the_grandchild_its_agent_left(tmp_path: Path) -> None:
    script = {"tasks": {"t": [_python(SLEEPER), {"text": "never"}]}}
    root = tmp_path / "r"
    with PolicyServer(script, port=0, faults=["call=2:kind=hang"]) as server:
        # The hanging call outlasts the deadline: the worker's own model timeout must not end it first.
        _prepare(root, server.base_url, model_timeout_s=600)
        # Long enough for a fresh template's imports and the cell on a loaded machine (two cores shared
        # with other suites: 20 s was not, as this file ran as the test user beside another); the model
        # hangs on the next call.
        config = SupervisorConfig(deadline_s=45, grace_s=1, sandbox=NoSandbox(worker_start="warm"))
        task = asyncio.ensure_future(supervise(root, config))
        try:
            pid_file = root / "workspace" / "sleeper.pid"
            await wait_for_async(
                lambda: task.done() or (pid_file.exists() and pid_file.read_text()),
                what="the agent's sleeper",
            )
            assert not task.done(), f"the rollout ended before its cell ran: {task.result()!r}"
            sleeper = int(pid_file.read_text())
            assert alive(sleeper)
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            info = read_proc(worker)
            assert info is not None and info.ppid == os.getpid(), (
                "the warm worker is not the supervisor's child"
            )
        finally:
            receipt = await task
    assert receipt.outcome == "timeout", receipt.outcome_reason
    assert receipt.deadline_fired and receipt.cleanup_confirmed
    assert not alive(sleeper), "the sleeping grandchild outlived the deadline"
    assert not alive(worker)


BUSY = 'open("busy", "w").close()\nimport time\ntime.sleep(3600)\n'
"""A cell that keeps the worker waiting on its executor, not on the supervisor (whose proxy's end
would end a model call, and so the worker, by itself)."""


@pytest.mark.timeout(90)
def test_a_sigkilled_supervisor_takes_its_warm_worker_with_it(tmp_path: Path) -> None:
    # What the killed supervisor leaves is reparented to this process (a subreaper): the token search sees it.
    ensure_subreaper()
    root = tmp_path / "r"
    with PolicyServer({"tasks": {"t": [_python(BUSY), {"text": "never"}]}}, port=0) as server:
        _prepare(root, server.base_url)
        argv = [
            sys.executable,
            "-m",
            "rollcage",
            "supervise",
            str(root),
            "--sandbox",
            "none",
            "--deadline",
            "120",
        ]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            try:
                wait_for(lambda: (root / "workspace" / "busy").exists(), what="the agent's cell to run")
                worker = wait_for(lambda: _worker_of(root), what="the worker's process")
                info = read_proc(worker)
                assert info is not None and info.ppid == proc.pid, (
                    "not a warm worker (the supervisor's child)"
                )
                started = list(_rollout_processes(root))
                assert len(started) == 2, "no holder beside the worker: not a warm start"
                proc.kill()
                proc.wait(timeout=10)
            finally:
                proc.kill()
    wait_for(
        lambda: not any(alive(pid) for pid in started),
        timeout=10,
        what="the worker and holder to die with it",
    )
    # The executor, in its sleeping cell, is the worker's child: it dies with the worker (its
    # parent-death signal, tools' uncaged_leash), not at the cell's end an hour later.
    wait_for(lambda: not processes_with_token(), timeout=10, what="the executor to die with the worker")


@pytest.mark.timeout(90)
async def test_a_start_the_template_refuses_runs_the_cold_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(self: warm_module.Template, request: object, fds: object) -> int:
        raise SupervisorError("the warm worker template refused a start: (test)")

    monkeypatch.setattr(warm_module.Template, "send", refuse)
    script = {"tasks": {"t": [_python("print(6 * 7)"), {"text": "42"}]}}
    root = tmp_path / "r"
    with (
        caplog.at_level(logging.WARNING, logger="rollcage.supervisor"),
        PolicyServer(script, port=0) as server,
    ):
        _prepare(root, server.base_url)
        receipt = await supervise(root, SupervisorConfig(deadline_s=120, sandbox=NoSandbox()))
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert receipt.exit_code == 0 and receipt.cleanup_confirmed
    assert "refused a start: (test); the worker starts cold" in caplog.text
    assert "SANDBOX DISABLED" in caplog.text


@pytest.mark.timeout(90)
async def test_a_cold_fallback_worker_is_stopped_as_a_cold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder that became the cold worker takes the polite signals again (a shell ignores them)."""

    async def refuse(self: warm_module.Template, request: object, fds: object) -> int:
        raise SupervisorError("refused (test)")

    monkeypatch.setattr(warm_module.Template, "send", refuse)
    _, receipt = await _running_worker("warm", tmp_path / "r")
    assert receipt["outcome"] == "cancelled", receipt["outcome_reason"]
    assert receipt["cleanup_confirmed"] and receipt["result_present"]
    assert [s["reason"] for s in receipt["signals_sent"]] == ["stop"]


def test_worker_start_is_a_flag_of_sandbox_none_too() -> None:
    import typer

    from rollcage.commands._sandbox_options import ExecutorCageChoice, WorkerStartChoice, bwrap_fields

    assert NoSandbox().worker_start == "warm"
    fields = bwrap_fields({"worker_start": WorkerStartChoice.cold}, sandbox="none")
    assert NoSandbox(**fields).worker_start == "cold"
    with pytest.raises(typer.BadParameter, match="--executor-cage needs --sandbox bwrap"):
        bwrap_fields({"executor_cage": ExecutorCageChoice.shared}, sandbox="none")


def test_a_run_with_sandbox_none_takes_the_worker_start() -> None:
    from rollcage.controller._unit import RolloutSettings, build_supervisor_config
    from rollcage.supervisor import BwrapSandbox

    for mode in ("warm", "cold"):
        settings = RolloutSettings(sandbox="none", bwrap=BwrapSandbox(worker_start=mode))
        sandbox = build_supervisor_config(settings).sandbox
        assert isinstance(sandbox, NoSandbox) and sandbox.worker_start == mode


@pytest.mark.timeout(90)
async def test_a_warm_worker_killed_by_someone_else_reads_as_a_cold_ones_death(tmp_path: Path) -> None:
    """Its holder dies of the worker's signal: the receipt says SIGKILL, not an exit code 137."""
    root = tmp_path / "r"
    with PolicyServer(NEVER, port=0, faults=["call=1:kind=hang"]) as server:
        _prepare(root, server.base_url)
        task = asyncio.ensure_future(supervise(root, SupervisorConfig(deadline_s=120, sandbox=NoSandbox())))
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            assert len(_rollout_processes(root)) == 2, "no holder beside the worker: not a warm start"
            os.kill(worker, 9)
        finally:
            receipt = await task
    assert receipt.outcome == "infra_failure", receipt.outcome_reason
    assert receipt.exit_signal == "SIGKILL" and receipt.exit_code is None and receipt.signals_sent == []
    assert receipt.cleanup_confirmed


def test_the_template_of_a_thread_that_ended_is_reaped_and_not_handed_to_another() -> None:
    """A thread's own template dies with it (its parent-death signal, once it has set it); the next
    ``template_for`` closes and reaps it and drops it, so a later thread given the same identifier gets
    one of its own."""
    bytecode = worker_bytecode()
    owned: list[warm_module.Template] = []

    def own() -> None:
        template = template_for(bytecode, thread=threading.get_ident())
        template.start()
        owned.append(template)

    thread = threading.Thread(target=own, name="test-template-owner")
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and owned
    (template,) = owned
    pid = template.pid
    assert pid is not None
    mine = template_for(bytecode, thread=threading.get_ident())
    assert mine is not template
    assert reaped(pid) and not alive(pid), "the dead thread's template was left behind"
    assert template.pid is None
    assert template_for(bytecode, thread=thread.ident) is not template  # its identifier may come again


@pytest.mark.timeout(600)
def test_this_suite_passes_as_an_unprivileged_user() -> None:
    """The warm start needs no privilege: the same tests, in a session of their own, as a plain user
    (whose template could not name its own PID namespace again, nor raise a hard limit)."""
    from tests.helpers.unprivileged import make_test_user, run_as, user_dir

    user = make_test_user()  # skips where the suite already runs unprivileged
    with user_dir(user) as home:
        argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
        argv += ["--basetemp", str(home / "pytest"), __file__]
        done = run_as(user, argv, home=home, timeout_s=540)
    assert done.returncode == 0, f"as {user.name} (uid {user.uid}):\n{done.stdout[-12000:]}"
