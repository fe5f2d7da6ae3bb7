"""Warm worker starts under bubblewrap without root: the worker forked into a cage is a cold start's.

A supervisor that is not root makes its cages with bubblewrap's unprivileged user
namespaces, which its own uid owns. Its default is a warm start too: bubblewrap
runs a holder in the worker's place, and a go-between forked by the pre-imported
template joins every namespace of the holder at once, takes its root and forks
the worker there, the supervisor's own child (:mod:`rollcage.warm`). These tests
run real rollouts of the real worker both ways, as the unprivileged user, and hold
the warm worker to the cold one from the host (credentials, capabilities,
``no_new_privs``, seccomp, limits, namespaces, mounts, cgroups, environment, command
line, working directory, descriptors); then the guarantees a cold worker has: a stop
is a cancellation, the deadline kills the whole tree, a killed supervisor takes
everything with it, a worker killed before it reports fails its start at once, and
a start the kernel refuses runs the cold worker, with one warning for the process.

As root the supervisor takes its root path (tests/supervisor/test_warm.py): these
tests skip there, and the last one runs this file again as ``rollcage-test``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rollcage.supervisor.warm as warm_module
from rollcage.policy import PolicyServer
from rollcage.procs import ensure_subreaper, read_proc, scan_processes
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from rollcage.supervisor.bytecode import worker_bytecode
from rollcage.supervisor.sandbox import BwrapLauncher
from rollcage.supervisor.warm import template_for
from tests.helpers.host_view import (
    NAMESPACES,
    REFUSE_SETNS,
    SETNS_NUMBERS,
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


def _rollout_processes(root: Path) -> dict[int, bytes]:
    """The rollout's live processes (by the token in their environment): PID -> command line."""
    return {pid: b"\0".join(words) for pid, words in rollout_processes(root).items()}


def _worker_of(root: Path) -> int | None:
    """The rollout's worker: the interpreter in the sandbox running ``rollcage worker`` on the cage's input
    (a warm start's holder carries the cold command line too, but is a shell)."""
    for pid, cmdline in _rollout_processes(root).items():
        words = cmdline.split(b"\0")
        if b"worker" not in words or b"/rollout/input.json" not in words:
            continue
        try:
            with open(f"/proc/{pid}/comm") as file:
                interpreter = file.read().startswith("python")
            with open(f"/proc/{pid}/status") as file:
                depth = next(len(line.split()) - 1 for line in file if line.startswith("NSpid:"))
        except OSError:
            continue
        if interpreter and depth >= 1:
            return pid
    return None


def _describe(pid: int, *, token: str) -> dict[str, Any]:
    """What a worker is, from the host (:func:`tests.helpers.host_view.describe`): its arguments from
    ``worker`` on, and whether its parent is this process."""
    seen = describe(pid, token=token)
    words = seen.pop("words")
    seen["args"] = words[words.index("worker") :]
    seen["parent_is_supervisor"] = seen.pop("ppid") == os.getpid()
    del seen["leads_its_session"]
    return seen


def _config(mode: str, **fields: Any) -> SupervisorConfig:
    return SupervisorConfig(sandbox=BwrapSandbox(worker_start=mode), **fields)


async def _running_worker(mode: str, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout in ``mode``, stopped while its worker waits on its first model call: worker, receipt."""
    with PolicyServer(NEVER, port=0, faults=["call=1:kind=hang"]) as server:
        _prepare(root, server.base_url)
        stop = asyncio.Event()
        task = asyncio.ensure_future(supervise(root, _config(mode, deadline_s=120, grace_s=10), stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what=f"the {mode} worker's first model call")
            pid = await wait_for_async(lambda: _worker_of(root), what=f"the {mode} worker's process")
            token = (root / ".sandbox" / "token").read_text().splitlines()[0]
            seen = _describe(pid, token=token)
            seen["namespaces"] = namespaces(pid)
            seen["others"] = [namespaces(other) for other in _rollout_processes(root) if other != pid]
        finally:
            stop.set()
            receipt = await task
    return seen, receipt.model_dump()


@not_root
async def test_a_warm_worker_without_root_is_what_a_cold_start_runs(tmp_path: Path) -> None:
    cold, cold_receipt = await _running_worker("cold", tmp_path / "cold")
    warm, warm_receipt = await _running_worker("warm", tmp_path / "warm")

    # Warm as test_warm.py knows it: the supervisor's own child, forked by a template that lives on.
    assert warm.pop("parent_is_supervisor") and not cold.pop("parent_is_supervisor")
    assert template_for(worker_bytecode()).pid is not None

    for receipt in (cold_receipt, warm_receipt):
        assert receipt["outcome"] == "cancelled", receipt
        assert receipt["result_valid"] and receipt["result_error"]["kind"] == "cancelled", receipt
        assert receipt["cleanup_confirmed"] and receipt["descendants_killed"] == 0, receipt
    for key in ("exit_code", "exit_signal"):
        assert warm_receipt[key] == cold_receipt[key], key

    # The same process, seen from the host: every key but two, its group (a cold worker is in the group of
    # bubblewrap's init, which leads the session; a warm one leads its own, where SIGTERM reaches it), and
    # one descriptor more: its socket to the executor template, which forks its executors.
    keys = ("status", "pid_depth", "environ", "args", "limits", "cgroups", "cwd", "root_is_host", "mounts")
    differ = {key: (warm[key], cold[key]) for key in keys if warm[key] != cold[key]}
    assert not differ, differ
    extra = {fd: kind for fd, kind in warm["fds"].items() if fd not in cold["fds"]}
    assert {fd: warm["fds"][fd] for fd in cold["fds"]} == cold["fds"], (warm["fds"], cold["fds"])
    assert list(extra.values()) == ["socket"], (warm["fds"], cold["fds"])
    assert warm["leads_its_group"] and not cold["leads_its_group"]
    assert warm["status"]["CapEff"] == warm["status"]["CapBnd"] == "0000000000000000"
    assert warm["status"]["NoNewPrivs"] == "1"
    assert warm["pid_depth"] == 2 and not warm["root_is_host"]
    held = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    assert int(warm["status"]["SigBlk"], 16) & held == 0, warm["status"]["SigBlk"]

    # In the cage's namespaces, every one of them: its holder's, none of the host's.
    mine = namespaces(os.getpid())
    assert warm["namespaces"] in warm["others"], "no process of the sandbox shares the worker's namespaces"
    for name in NAMESPACES:
        assert warm["namespaces"][name] != mine[name], name
        assert cold["namespaces"][name] != mine[name], name


def _python(code: str) -> dict[str, Any]:
    return {"tool_calls": [{"name": "python", "arguments": {"code": code}}]}


@not_root
async def test_a_warm_rollout_without_root_completes_as_a_cold_one(tmp_path: Path) -> None:
    results = {}
    for mode in ("cold", "warm"):
        root = tmp_path / mode
        with PolicyServer({"tasks": {"t": [_python("print(6 * 7)"), {"text": "42"}]}}, port=0) as server:
            _prepare(root, server.base_url)
            receipt = await supervise(root, _config(mode, deadline_s=120))
        assert receipt.outcome == "completed", receipt.outcome_reason
        result = json.loads((root / "result.json").read_text())
        results[mode] = (receipt.exit_code, result["termination_reason"], result["response"])
    assert results["warm"] == results["cold"]
    assert "42" in (tmp_path / "warm" / "checkpoint.jsonl").read_text()


SLEEPER = """
import subprocess
child = subprocess.Popen(["sleep", "3600"], start_new_session=True)
open("sleeper.pid", "w").write(str(child.pid))
print("started", child.pid)
"""


@not_root
@pytest.mark.timeout(150)
async def test_the_deadline_kills_a_warm_worker_and_everything_its_agent_left(tmp_path: Path) -> None:
    script = {"tasks": {"t": [_python(SLEEPER), {"text": "never"}]}}
    root = tmp_path / "r"
    with PolicyServer(script, port=0, faults=["call=2:kind=hang"]) as server:
        # The hanging call outlasts the deadline: the worker's own model timeout must not end it first.
        _prepare(root, server.base_url, model_timeout_s=600)
        # Long enough for a fresh template's imports and the cell on a loaded machine (two cores shared
        # with other suites); the model hangs on the next call.
        task = asyncio.ensure_future(supervise(root, _config("warm", deadline_s=45, grace_s=1)))
        try:
            pid_file = root / "workspace" / "sleeper.pid"
            await wait_for_async(lambda: task.done() or pid_file.exists(), what="the agent's sleeper")
            assert not task.done(), f"the rollout ended before its cell ran: {task.result()!r}"
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            info = read_proc(worker)
            assert info is not None and info.ppid == os.getpid(), "not a warm worker"
            left = list(_rollout_processes(root))
        finally:
            receipt = await task
    assert receipt.outcome == "timeout", receipt.outcome_reason
    assert receipt.deadline_fired and receipt.cleanup_confirmed
    assert not any(alive(pid) for pid in left), "a process of the rollout outlived its deadline"


BUSY = 'open("busy", "w").close()\nimport time\ntime.sleep(3600)\n'


@not_root
@pytest.mark.timeout(120)
def test_a_sigkilled_supervisor_leaves_nothing_of_a_warm_rollout(tmp_path: Path) -> None:
    ensure_subreaper()
    root = tmp_path / "r"
    with PolicyServer({"tasks": {"t": [_python(BUSY), {"text": "never"}]}}, port=0) as server:
        _prepare(root, server.base_url)
        argv = [sys.executable, "-m", "rollcage", "supervise", str(root), "--deadline", "120"]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            try:
                wait_for(lambda: (root / "workspace" / "busy").exists(), what="the agent's cell to run")
                worker = wait_for(lambda: _worker_of(root), what="the worker's process")
                info = read_proc(worker)
                assert info is not None and info.ppid == proc.pid, "not a warm worker (the supervisor's)"
                started = list(_rollout_processes(root))
                proc.kill()
                proc.wait(timeout=10)
            finally:
                proc.kill()

    # Its cage's PID namespace ends with its holder (whose socket's end is the supervisor's death): the
    # worker, its executor and the agent's cell in it.
    # The worker, the supervisor's child, is this process's now (a subreaper, as init would be), and
    # the cage's init lingers until its zombie is reaped: reaped here as init would.
    def gone() -> bool:
        _reap_orphans()
        return not any(alive(pid) for pid in started)

    wait_for(gone, timeout=20, what="the rollout's processes to die")
    wait_for(lambda: not processes_with_token(), timeout=10, what="every supervised process to be gone")


def _reap_orphans() -> None:
    """Reap this process's children that have exited (what a killed supervisor left it)."""
    for info in scan_processes().values():
        if info.ppid == os.getpid() and not info.alive:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.pid, os.WNOHANG)


def _signal_the_worker_once_forked(monkeypatch: pytest.MonkeyPatch, signum: signal.Signals) -> list[int]:
    """Send ``signum`` to the first warm worker the moment its go-between names it (it is still
    entering its cage); the list gets its pid."""
    take = warm_module._Reports._take
    signalled: list[int] = []

    def take_and_signal(self: Any, message: Any, *args: Any) -> None:
        take(self, message, *args)
        if isinstance(message, warm_module.Forked) and not message.go_between and not signalled:
            os.kill(message.pid, signum)
            signalled.append(message.pid)

    monkeypatch.setattr(warm_module._Reports, "_take", take_and_signal)
    return signalled


def _zombie_children() -> list[int]:
    return [info.pid for info in scan_processes().values() if info.ppid == os.getpid() and not info.alive]


@not_root
@pytest.mark.timeout(120)
async def test_a_warm_worker_killed_before_it_reports_fails_its_start_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    killed = _signal_the_worker_once_forked(monkeypatch, signal.SIGKILL)
    with PolicyServer({"tasks": {"t": [{"text": "never asked"}]}}, port=0) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        receipt = await supervise(root, _config("warm", deadline_s=60))
        assert not server.requests, "a worker killed before it ran asked the model"
    assert killed, "no go-between named a worker"
    assert receipt.outcome == "infra_failure"
    reason = receipt.outcome_reason
    assert (
        "the warm start failed: no report (" in reason
        or "killed by SIGKILL, which the supervisor did not send" in reason
    ), reason
    assert "deadline" not in reason and receipt.duration_s < 30, reason
    assert receipt.cleanup_confirmed
    # The go-between and the worker, both this process's children, are reaped.
    assert not set(_zombie_children()) & {killed[0]}, "the killed worker was left unreaped"


@not_root
@pytest.mark.timeout(120)
async def test_a_sigterm_while_a_warm_worker_enters_its_cage_cancels_it_with_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    signalled = _signal_the_worker_once_forked(monkeypatch, signal.SIGTERM)
    with PolicyServer({"tasks": {"t": [{"text": "never asked"}]}}, port=0) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        receipt = await supervise(root, _config("warm", deadline_s=120))
        assert not server.requests, "a rollout cancelled before it began asked the model"
    assert signalled, "no go-between named a worker"
    assert receipt.result_valid, receipt.outcome_reason
    assert receipt.result_error is not None and receipt.result_error.kind == "cancelled"
    assert receipt.exit_signal == "SIGTERM" and receipt.signals_sent == []
    assert receipt.cleanup_confirmed


@not_root
@pytest.mark.timeout(120)
async def test_a_stop_while_a_warm_worker_runs_cancels_it(tmp_path: Path) -> None:
    _, receipt = await _running_worker("warm", tmp_path / "r")
    assert receipt["outcome"] == "cancelled" and receipt["exit_signal"] == "SIGTERM", receipt
    assert [s["reason"] for s in receipt["signals_sent"]] == ["stop"]


_REFUSING = (
    REFUSE_SETNS
    + """
import asyncio, json, logging
from pathlib import Path

from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
receipts = []
for root in sys.argv[2:]:
    config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox())
    receipts.append(asyncio.run(supervise(Path(root), config)).model_dump(mode="json"))
print(json.dumps(receipts))
"""
)


@not_root
@pytest.mark.timeout(180)
def test_a_start_the_kernel_refuses_runs_the_cold_worker_and_warns_once(tmp_path: Path) -> None:
    nr = SETNS_NUMBERS.get(platform.machine())
    if nr is None:
        pytest.skip(f"optional: setns's number on {platform.machine()} is not known to this test")
    roots = [tmp_path / "first", tmp_path / "second"]
    with PolicyServer({"tasks": {"t": [_python("print(6 * 7)"), {"text": "42"}]}}, port=0) as server:
        for root in roots:
            _prepare(root, server.base_url)
        done = subprocess.run(
            [sys.executable, "-c", _REFUSING, str(nr), *map(str, roots)],
            capture_output=True,
            text=True,
            timeout=150,
        )
    assert done.returncode == 0, done.stderr[-6000:]
    receipts = json.loads(done.stdout.splitlines()[-1])
    for receipt in receipts:
        assert receipt["outcome"] == "completed", receipt["outcome_reason"]
        assert receipt["exit_code"] == 0 and receipt["cleanup_confirmed"]
    assert done.stderr.count("could not enter its cage without root") == 1, done.stderr[-6000:]
    assert "cannot join the sandbox's namespaces" in done.stderr, done.stderr[-6000:]
    assert "Operation not permitted" in done.stderr, done.stderr[-6000:]
    # The first start was tried and refused (its words in the log); the second was cold from the start.
    assert "could not enter its cage" in (roots[0] / "worker.log").read_text()
    assert "could not enter its cage" not in (roots[1] / "worker.log").read_text()


@not_root
@pytest.mark.timeout(120)
async def test_a_start_that_fails_for_another_reason_runs_cold_and_the_next_is_warm_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A go-between that cannot move into the rollout's cgroups (not the kernel's refusal of the entry):
    its rollout runs the cold worker, with a warning of its own, and the next start is warm."""
    import logging

    from rollcage.budgets import RolloutBudgets

    script = {"tasks": {"t": [_python("print(6 * 7)"), {"text": "42"}]}}
    with caplog.at_level(logging.WARNING, logger="rollcage.supervisor"):
        with monkeypatch.context() as patch, PolicyServer(script, port=0) as server:
            missing = tmp_path / "no-such-cgroup" / "cgroup.procs"
            patch.setattr(RolloutBudgets, "cgroup_procs", lambda self: [str(missing)])
            root = tmp_path / "first"
            _prepare(root, server.base_url)
            first = await supervise(root, _config("warm", deadline_s=120))
        assert first.outcome == "completed", first.outcome_reason
        assert "cannot move into the rollout's cgroups" in caplog.text
        assert "the worker starts cold" in caplog.text and "from now on" not in caplog.text
        # Cold: the worker was its holder's exec, not the supervisor's child, and it ran the whole rollout.
        assert "could not enter its cage" in (root / "worker.log").read_text()
        with PolicyServer(NEVER, port=0, faults=["call=1:kind=hang"]) as server:
            second = tmp_path / "second"
            _prepare(second, server.base_url)
            stop = asyncio.Event()
            task = asyncio.ensure_future(supervise(second, _config("warm", deadline_s=120), stop=stop))
            try:
                worker = await wait_for_async(lambda: _worker_of(second), what="the second worker")
                info = read_proc(worker)
                assert info is not None and info.ppid == os.getpid(), "the next start was not warm"
            finally:
                stop.set()
                receipt = await task
        assert receipt.outcome == "cancelled", receipt.outcome_reason


@not_root
@pytest.mark.timeout(120)
async def test_a_worker_that_fell_back_to_cold_is_stopped_as_a_cold_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder that became the cold worker is found and signalled as a cold start's worker is (its
    group, under the cage's init): a stop cancels it with a result, not a SIGKILL after the grace."""
    from rollcage.budgets import RolloutBudgets

    missing = tmp_path / "no-such-cgroup" / "cgroup.procs"
    monkeypatch.setattr(RolloutBudgets, "cgroup_procs", lambda self: [str(missing)])
    seen, receipt = await _running_worker("warm", tmp_path / "r")
    assert not seen["parent_is_supervisor"], "not the cold fallback"
    assert receipt["outcome"] == "cancelled", receipt["outcome_reason"]
    assert receipt["result_valid"] and receipt["cleanup_confirmed"], receipt
    assert [s["reason"] for s in receipt["signals_sent"]] == ["stop"]


@not_root
def test_a_setuid_bubblewrap_stays_cold_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    bwrap = shutil.which("bwrap")
    assert bwrap is not None
    copy = tmp_path / "bwrap"
    shutil.copy2(bwrap, copy)
    copy.chmod(0o4755)  # setuid to this (unprivileged) user: only the bit matters here
    with caplog.at_level(logging.DEBUG, logger="rollcage.supervisor"):
        assert BwrapLauncher(BwrapSandbox(bwrap_path=str(copy))).enters_warm is False
        assert BwrapLauncher(BwrapSandbox(bwrap_path=bwrap)).enters_warm is True
    assert f"{copy} is setuid" in caplog.text and "workers start cold" in caplog.text


@pytest.mark.timeout(600)
def test_this_suite_passes_as_an_unprivileged_user() -> None:
    """The non-root warm path, for real: this file again, in a session of its own, as a plain user."""
    pass_as_the_test_user(__file__)
