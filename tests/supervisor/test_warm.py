"""Warm worker starts (``rollcage.warm``): the worker forked into a cage is the one a cold start runs.

Under bubblewrap as root the supervisor's default is a warm start: bubblewrap
makes the cage as for a cold start, with a holder where the worker would be,
and a pre-imported template forks the worker into the holder's namespaces. These
tests look at the real worker process of a real rollout, from the host, in both
ways, and hold the warm one to the cold one: credentials, capabilities, limits,
namespaces, cgroups, environment, command line, working directory and open
descriptors. Then what happens when the template dies, and when a start fails.
The sandbox, escape and chaos suites run on the warm path as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

import rollcage.supervisor.warm as warm_module
from rollcage.controller import Controller, RunConfig
from rollcage.policy import PolicyServer
from rollcage.procs import read_proc, scan_processes
from rollcage.protocol import RolloutRecord
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from rollcage.supervisor.bytecode import worker_bytecode
from rollcage.supervisor.warm import template_for
from tests.helpers.host_view import NAMESPACES, STATUS_FIELDS, TOKEN, namespaces
from tests.helpers.paths import EXAMPLES
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import alive, reaped, wait_for, wait_for_async
from tests.helpers.worker_env import worker_input

pytestmark = [requires_bwrap(), pytest.mark.bwrap]


def _prepare(root: Path, model_url: str) -> None:
    root.mkdir()
    (root / "workspace").mkdir()
    (root / "input.json").write_text(json.dumps(worker_input(model_url=model_url, task_id="t")))


def _rollout_processes(root: Path) -> dict[int, bytes]:
    """The rollout's live processes (by the token in their environment): PID -> command line."""
    token = (root / ".sandbox" / "token").read_text().splitlines()[0]
    marked = f"{TOKEN}={token}".encode()
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as file:
                if marked not in file.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/cmdline", "rb") as file:
                found[int(name)] = file.read()
        except OSError:
            continue
    return found


def _worker_of(root: Path) -> int | None:
    """The rollout's worker: the interpreter in the sandbox running ``rollcage worker`` on the cage's input.

    (bubblewrap, setpriv and prlimit carry the same words on their command lines, outside the
    interpreter or the sandbox's PID namespace.)
    """
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
        if interpreter and depth >= 2:
            return pid
    return None


def _describe(pid: int, *, token: str) -> dict[str, Any]:
    """What a process is, from the host, with what differs between any two rollouts left out."""
    with open(f"/proc/{pid}/status") as file:
        status = dict(line.split(":", 1) for line in file.read().splitlines() if ":" in line)
    with open(f"/proc/{pid}/environ", "rb") as file:
        env = dict(
            entry.decode().split("=", 1) for entry in file.read().split(b"\0") if entry and b"=" in entry
        )
    env[TOKEN] = "<token>" if env.get(TOKEN) == token else f"wrong: {env.get(TOKEN)}"
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        words = file.read().split(b"\0")
    with open(f"/proc/{pid}/limits") as file:
        limits = file.read()
    with open(f"/proc/{pid}/cgroup") as file:
        # Which hierarchies hold it in a cgroup of its own (the rollout's), not the paths.
        confined = sorted(line.split(":")[1] for line in file.read().splitlines() if "rollcage-" in line)
    return {
        "status": {name: status[name].strip() for name in STATUS_FIELDS},
        "pid_depth": len(status["NSpid"].split()),
        "leads_its_group": status["NSpgid"].split()[-1] == status["NSpid"].split()[-1],
        "environ": env,
        "args": [word.decode() for word in words[words.index(b"worker") :]],
        "limits": limits,
        "cgroups": confined,
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "root_is_host": _file_id(f"/proc/{pid}/root/") == _file_id("/"),
        "fds": sorted(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")),
    }


def _file_id(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_dev, info.st_ino


def _same_file(one: str, other: str) -> bool:
    try:
        return _file_id(one) == _file_id(other)
    except OSError:
        return False


async def _running_worker(mode: str, root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rollout in ``mode``, stopped while its worker waits on its first model call: worker, receipt."""
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        _prepare(root, server.base_url)
        stop = asyncio.Event()
        config = SupervisorConfig(deadline_s=120, grace_s=10, sandbox=BwrapSandbox(worker_start=mode))
        task = asyncio.ensure_future(supervise(root, config, stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what=f"the {mode} worker's first model call")
            pid = await wait_for_async(lambda: _worker_of(root), what=f"the {mode} worker's process")
            token = (root / ".sandbox" / "token").read_text().splitlines()[0]
            seen = _describe(pid, token=token)
            seen["namespaces"] = namespaces(pid)
            seen["others"] = {
                other: namespaces(other)
                for other, cmdline in _rollout_processes(root).items()
                if other != pid
            }
            seen["pid"] = pid
            seen["fd_links"] = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in seen["fds"]}
        finally:
            stop.set()
            receipt = await task
    return seen, receipt.model_dump()


async def test_a_warm_worker_is_what_a_cold_start_runs(tmp_path: Path) -> None:
    cold, cold_receipt = await _running_worker("cold", tmp_path / "cold")
    warm, warm_receipt = await _running_worker("warm", tmp_path / "warm")

    # Both were stopped on request and said so, through SIGTERM to the worker's group.
    for receipt in (cold_receipt, warm_receipt):
        assert receipt["outcome"] == "cancelled", receipt
        assert receipt["result_valid"] and receipt["result_error"]["kind"] == "cancelled", receipt
        assert receipt["cleanup_confirmed"] and receipt["descendants_killed"] == 0, receipt
    for key in ("exit_code", "exit_signal"):
        assert warm_receipt[key] == cold_receipt[key], key
    assert warm_receipt["exit_signal"] == "SIGTERM"

    # The same process, seen from the host; but for one descriptor more: the warm worker's socket to
    # the executor template, which forks its executors (rollcage.tools._forked).
    for key in ("status", "pid_depth", "environ", "args", "limits", "cgroups", "cwd", "root_is_host"):
        assert warm[key] == cold[key], key
    extra = sorted(set(warm["fds"]) - set(cold["fds"]))
    assert set(cold["fds"]) <= set(warm["fds"]) and len(extra) == 1, (warm["fds"], cold["fds"])
    assert warm["fd_links"][extra[0]].startswith("socket:")
    assert warm["status"]["CapEff"] == warm["status"]["CapBnd"] == "0000000000000000"
    assert warm["status"]["NoNewPrivs"] == "1"
    assert warm["pid_depth"] == 3 and not warm["root_is_host"]
    assert warm["cgroups"], "the warm worker is not in the rollout's cgroups"
    assert warm["leads_its_group"], "SIGTERM to the worker's group must reach the warm worker"
    # Born with them held (rollcage.warm), it let them go once its handlers were in place.
    held = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGINT - 1))
    assert int(warm["status"]["SigBlk"], 16) & held == 0, warm["status"]["SigBlk"]

    # In the cage's namespaces, every one of them: those of its holder, none of the host's.
    mine = namespaces(os.getpid())
    holders = [others for others in warm["others"].values() if others == warm["namespaces"]]
    assert holders, f"no process of the sandbox shares the warm worker's namespaces: {warm['others']}"
    for name in NAMESPACES:
        assert warm["namespaces"][name] != mine[name], name
        assert cold["namespaces"][name] != mine[name], name


async def test_a_dead_template_fails_no_running_rollout_and_the_next_start_makes_a_new_one(
    tmp_path: Path,
) -> None:
    template = template_for(worker_bytecode())
    # Slow enough an answer that the template is gone while the worker waits for it.
    with PolicyServer(
        {"tasks": {"t": [{"text": "first"}]}}, port=0, faults=["call=1:kind=latency:delay=5"]
    ) as server:
        root = tmp_path / "first"
        _prepare(root, server.base_url)
        config = SupervisorConfig(deadline_s=120, grace_s=10, sandbox=BwrapSandbox(worker_start="warm"))
        task = asyncio.ensure_future(supervise(root, config))
        await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
        worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
        old = template.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        await wait_for_async(lambda: template.pid is None, what="the template's death")
        assert alive(worker), "the worker died with the template"
        receipt = await task
    assert receipt.outcome == "completed", receipt.outcome_reason
    with PolicyServer({"tasks": {"t": [{"text": "second"}]}}, port=0) as server:
        root = tmp_path / "second"
        _prepare(root, server.base_url)
        receipt = await supervise(
            root, SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start="warm"))
        )
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert template.pid not in (None, old)


def _complete_on_a_thread_of_its_own(root: Path, answer: str) -> str:
    """A rollout supervised on a fresh thread and event loop, as a Ray node runs each one; its outcome,
    once that thread has ended in the kernel too (its parent-death signals have gone out)."""
    outcomes: list[str] = []

    def rollout() -> None:
        with PolicyServer({"tasks": {"t": [{"text": answer}]}}, port=0) as server:
            _prepare(root, server.base_url)
            config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start="warm"))
            receipt = asyncio.run(supervise(root, config))
        outcomes.append(f"{receipt.outcome}: {receipt.outcome_reason}")

    thread = threading.Thread(target=rollout, name="test-rollout-thread")
    thread.start()
    thread.join(150)
    assert not thread.is_alive(), "the rollout's thread did not end"
    task = f"/proc/self/task/{thread.native_id}"
    wait_for(lambda: not os.path.exists(task), timeout=30, what="the rollout's thread to be gone")
    assert outcomes, "the rollout's thread ended without a receipt"
    return outcomes[0]


def test_the_template_outlives_the_thread_of_the_rollout_that_started_it(tmp_path: Path) -> None:
    """On a Ray node each rollout runs on a thread of its own: the template is the process's (started by
    its keeper thread), so the next rollout's worker is forked from the same one, not from a new one."""
    warm_module.stop_templates()  # none yet: the first rollout's thread asks for it
    template = template_for(worker_bytecode())
    assert template.pid is None
    started = warm_module.templates_started
    first = _complete_on_a_thread_of_its_own(tmp_path / "first", "one")
    assert first.startswith("completed"), first
    pid = template.pid
    assert pid is not None, "the template died with the thread of the rollout that started it"
    second = _complete_on_a_thread_of_its_own(tmp_path / "second", "two")
    assert second.startswith("completed"), second
    assert template.pid == pid and alive(pid), "the second rollout's worker came from another template"
    assert warm_module.templates_started == started + 1
    keepers = [t for t in threading.enumerate() if t.name == warm_module.KEEPER_NAME]
    assert len(keepers) == 1 and keepers[0].daemon
    assert warm_module.stop_templates() == 1
    assert not alive(pid) and not [t for t in threading.enumerate() if t.name == warm_module.KEEPER_NAME]


async def test_a_start_that_cannot_enter_the_cage_is_an_infra_failure_that_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollcage.budgets import RolloutBudgets

    missing = tmp_path / "no-such-cgroup" / "cgroup.procs"
    monkeypatch.setattr(RolloutBudgets, "cgroup_procs", lambda self: [str(missing)])
    with PolicyServer({"tasks": {"t": [{"text": "never asked"}]}}, port=0) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        receipt = await supervise(
            root, SupervisorConfig(deadline_s=60, sandbox=BwrapSandbox(worker_start="warm"))
        )
        assert not server.requests, "a worker that was never started asked the model"
    assert receipt.outcome == "infra_failure"
    assert receipt.exit_code == 125
    assert re.search(
        r"worker was not started: the warm start failed: .*no-such-cgroup", receipt.outcome_reason
    )
    assert "could not enter its cage" in (root / "worker.log").read_text()
    assert receipt.cleanup_confirmed and not (root / "result.json").exists()


def _signal_the_worker_once_forked(monkeypatch: pytest.MonkeyPatch, signum: signal.Signals) -> list[int]:
    """Send ``signum`` to the first warm worker the moment the template says it forked it (the worker
    is still entering its cage); the list gets its pid."""
    take = warm_module._Reports._take
    killed: list[int] = []

    def take_and_signal(self: Any, message: Any, *args: Any) -> None:
        take(self, message, *args)
        if isinstance(message, warm_module.Forked) and not killed:
            os.kill(message.pid, signum)
            killed.append(message.pid)

    monkeypatch.setattr(warm_module._Reports, "_take", take_and_signal)
    return killed


async def test_a_sigterm_while_the_warm_worker_enters_its_cage_cancels_it_with_a_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker is born with SIGTERM held (rollcage.warm): one sent the moment it is forked, long before
    its handlers are in place, cancels the rollout with a well-formed result instead of killing it."""
    killed = _signal_the_worker_once_forked(monkeypatch, signal.SIGTERM)
    with PolicyServer({"tasks": {"t": [{"text": "never asked"}]}}, port=0) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        receipt = await supervise(
            root, SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start="warm"))
        )
        assert killed, "the template never said it forked the worker"
        assert not server.requests, "a rollout cancelled before it began asked the model"
    assert receipt.result_valid, receipt.outcome_reason
    assert receipt.result_error is not None and receipt.result_error.kind == "cancelled"
    assert "SIGTERM" in receipt.result_error.message
    # A published, valid result; the worker's exit status (128 + SIGTERM) reads as the signal, which the
    # supervisor did not send: not a stop it asked for, so the infrastructure's (preemption, a neighbour).
    assert receipt.exit_signal == "SIGTERM" and receipt.signals_sent == []
    assert receipt.outcome == "infra_failure"
    assert "which the supervisor did not send" in receipt.outcome_reason
    assert "its result (error kind 'cancelled') is kept" in receipt.outcome_reason
    assert receipt.cleanup_confirmed


async def test_a_warm_worker_killed_before_it_speaks_fails_its_start_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker SIGKILLed as it is forked never reports: its start fails when its report socket ends,
    not at the deadline. So no other process may hold a copy of that socket: not the executor template,
    started by a fresh template during its first start (it used to inherit the start's descriptors)."""
    template = template_for(worker_bytecode())
    if template.pid is not None:
        os.kill(template.pid, signal.SIGKILL)  # the next start is a fresh template's first
        await wait_for_async(lambda: template.pid is None, what="the template's death")
    killed = _signal_the_worker_once_forked(monkeypatch, signal.SIGKILL)
    with PolicyServer({"tasks": {"t": [{"text": "never asked"}]}}, port=0) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        receipt = await supervise(
            root, SupervisorConfig(deadline_s=30, sandbox=BwrapSandbox(worker_start="warm"))
        )
    assert killed, "the template never said it forked the worker"
    assert receipt.outcome == "infra_failure"
    # The report socket ended, or the worker's death was seen first (a race either may win): not the
    # time to wait.
    reason = receipt.outcome_reason
    assert (
        "the warm start failed: no report (" in reason
        or "killed by SIGKILL, which the supervisor did not send" in reason
    ), reason
    assert "deadline" not in reason, reason
    assert receipt.cleanup_confirmed


def _zombie_children() -> list[int]:
    """This process's children that have exited and nobody has reaped."""
    return [info.pid for info in scan_processes().values() if info.ppid == os.getpid() and not info.alive]


async def test_a_warm_worker_is_the_supervisors_own_child_whose_death_its_holder_reports(
    tmp_path: Path,
) -> None:
    """No process stands between the supervisor and a warm worker: the supervisor reaps it and hands its
    exit status to the holder, so bwrap reports a worker killed by someone else as a cold start's."""
    template = template_for(worker_bytecode())
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        root = tmp_path / "r"
        _prepare(root, server.base_url)
        config = SupervisorConfig(deadline_s=120, grace_s=10, sandbox=BwrapSandbox(worker_start="warm"))
        task = asyncio.ensure_future(supervise(root, config))
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            info = read_proc(worker)
            assert info is not None and info.ppid == os.getpid(), f"the warm worker's parent: {info}"
            assert template.pid is not None and template.pid != os.getpid()
            os.kill(worker, signal.SIGKILL)
        finally:
            receipt = await task
    assert receipt.outcome == "infra_failure", receipt.outcome_reason
    assert receipt.exit_signal == "SIGKILL" and receipt.signals_sent == []
    assert "SIGKILL, which the supervisor did not send" in receipt.outcome_reason
    assert receipt.cleanup_confirmed
    assert worker not in _zombie_children(), "the warm worker was left unreaped"


async def test_a_warm_worker_imports_nothing_its_template_had_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A module a fork imports is paid again by every rollout (~1 ms for a codec a text-mode open looks
    # up): the template's warm-up takes what a rollout runs into, from its entry into the cage to its
    # published result, a python cell included. The worker says what it imported at DEBUG.
    monkeypatch.setenv("ROLLCAGE_LOG_LEVEL", "DEBUG")
    call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    script = {"tasks": {"t": [{"tool_calls": [call]}, {"text": "42"}]}}
    root = tmp_path / "r"
    with PolicyServer(script, port=0) as server:
        _prepare(root, server.base_url)
        config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start="warm"))
        receipt = await supervise(root, config)
    assert receipt.outcome == "completed", receipt.outcome_reason
    log = (root / "worker.log").read_text()
    said = [line.split(" rollcage.worker: ")[-1] for line in log.splitlines() if "after the fork" in line]
    assert said == ["imported after the fork from the template: nothing"], log


def test_worker_start_is_a_sandbox_flag_warm_by_default() -> None:
    import typer

    from rollcage.commands._sandbox_options import WorkerStartChoice, bwrap_fields

    assert BwrapSandbox().worker_start == "warm"
    fields = bwrap_fields({"worker_start": WorkerStartChoice.cold}, sandbox="bwrap")
    assert BwrapSandbox(**fields).worker_start == "cold"
    # --sandbox none starts warm or cold too (tests/supervisor/test_warm_none.py); not so its cage.
    assert bwrap_fields({"worker_start": WorkerStartChoice.cold}, sandbox="none") == {"worker_start": "cold"}
    with pytest.raises(typer.BadParameter, match="--executor-cage needs --sandbox bwrap"):
        bwrap_fields({"executor_cage": "shared"}, sandbox="none")


# --------------------------------------------------------------------------- scratch in the cage

MIB = 1 << 20
SCRATCH = {"tmp_size_bytes": 8 * MIB, "tmp_inodes": 70, "shm_bytes": 2 * MIB, "shm_inodes": 30}


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(mount point, file system type, source) of each line of the ``mountinfo`` file at this path."""
    found = []
    for line in Path(mountinfo).read_text().splitlines():
        fields, _, rest = line.partition(" - ")
        fstype, source = rest.split()[:2]
        found.append((fields.split()[4], fstype, source))
    return found


def _mounts_with_options(mountinfo: str) -> dict[str, set[str]]:
    """Mount point -> its per-mount options, of the ``mountinfo`` file at this path (the last mount wins)."""
    found = {}
    for line in Path(mountinfo).read_text().splitlines():
        fields = line.split(" - ")[0].split()
        found[fields[4]] = set(fields[5].split(","))
    return found


@pytest.mark.parametrize("shows_a_path_in_tmp", [False, True])
async def test_a_warm_cage_mounts_its_bounded_tmp_and_shm_inside_and_the_host_holds_only_its_workspace(
    tmp_path: Path, shows_a_path_in_tmp: bool
) -> None:
    """A path the cage shows under /tmp (a Python environment there) stays shown, read-only, on top."""
    from rollcage.budgets import mount_source

    root = tmp_path / "r"
    with contextlib.ExitStack() as stack:
        shown = Path(stack.enter_context(tempfile.TemporaryDirectory(dir="/tmp")))
        (shown / "inside").mkdir()
        server = stack.enter_context(
            PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"])
        )
        _prepare(root, server.base_url)
        stop = asyncio.Event()
        extra = {"extra_ro_paths": [str(shown)]} if shows_a_path_in_tmp else {}
        sandbox = BwrapSandbox(worker_start="warm", **SCRATCH, **extra)
        task = asyncio.ensure_future(
            supervise(root, SupervisorConfig(deadline_s=120, sandbox=sandbox), stop=stop)
        )
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            pid = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            inside = {point: (fstype, source) for point, fstype, source in _mounts(f"/proc/{pid}/mountinfo")}
            options = _mounts_with_options(f"/proc/{pid}/mountinfo")
            bounds = {place: os.statvfs(f"/proc/{pid}/root{place}") for place in ("/tmp", "/dev/shm")}
            still_shown = _same_file(f"/proc/{pid}/root{shown}/inside", str(shown / "inside"))
            ours = mount_source()
            on_the_host = sorted(
                point for point, _, source in _mounts("/proc/self/mountinfo") if source == ours
            )
        finally:
            stop.set()
            receipt = await task

    # The last mount at each place is the one the cage sees: the warm start's, with the budgets as bounds.
    assert inside["/tmp"] == ("tmpfs", "rollcage") and inside["/dev/shm"] == ("tmpfs", "rollcage"), inside
    for place, size, inodes in (("/tmp", 8 * MIB, 70), ("/dev/shm", 2 * MIB, 30)):
        assert bounds[place].f_blocks * bounds[place].f_frsize == size, place
        assert bounds[place].f_files == inodes + 1, place  # and one for its root
    # The host's mount table holds this rollout's workspace, and nothing else of it.
    assert on_the_host == [str(root / "workspace")], on_the_host
    if shows_a_path_in_tmp:
        assert still_shown, f"{shown} was hidden by the cage's /tmp"
        assert {"ro", "nosuid", "nodev"} <= options[str(shown)], options[str(shown)]
    else:
        assert not still_shown and str(shown) not in options
    uses = {use.budget: use for use in receipt.budgets}
    for budget in ("tmp_bytes", "tmp_inodes", "shm_bytes", "shm_inodes"):
        assert uses[budget].mechanism == "tmpfs" and uses[budget].peak is not None, uses[budget]
    assert receipt.outcome == "cancelled" and receipt.cleanup_confirmed, receipt.outcome_reason


async def test_the_kernel_bounds_the_inodes_of_a_warm_cages_tmp(tmp_path: Path) -> None:
    fill = (
        "import errno\nmade = 0\ntry:\n    while made < 1000:\n        open(f'/tmp/f{made}', 'w').close()\n"
        "        made += 1\nexcept OSError as exc:\n    stop = errno.errorcode.get(exc.errno)\n"
        "open('made.txt', 'w').write(f'{made} {stop}')\n"
    )
    script = {
        "tasks": {"t": [{"tool_calls": [{"name": "python", "arguments": {"code": fill}}]}, {"text": "x"}]}
    }
    root = tmp_path / "r"
    with PolicyServer(script, port=0) as server:
        _prepare(root, server.base_url)
        sandbox = BwrapSandbox(worker_start="warm", budget_poll_s=0.1, **SCRATCH)
        receipt = await supervise(root, SupervisorConfig(deadline_s=120, sandbox=sandbox))
    made, stop = (root / "workspace" / "made.txt").read_text().split()
    # Refused by the kernel at the budget, not found a poll later.
    assert stop == "ENOSPC" and 0 < int(made) <= 70, (made, stop)
    assert receipt.outcome == "agent_error" and receipt.budget_exceeded == "tmp_inodes", (
        receipt.outcome_reason
    )
    uses = {use.budget: use for use in receipt.budgets}
    assert uses["tmp_inodes"].mechanism == "tmpfs" and uses["tmp_inodes"].peak == 70


async def test_a_cage_that_refuses_its_mounts_fails_one_start_and_the_next_mount_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollcage.budgets import CageTmpfs
    from rollcage.budgets import _rollout as budgets
    from rollcage.supervisor import warm

    monkeypatch.setattr(warm, "_cage_mounts_refused", [])
    # Where the cage has no such directory, the worker cannot mount: as a kernel that refused.
    monkeypatch.setattr(
        budgets,
        "CageTmpfs",
        lambda name, inside, **bounds: CageTmpfs(
            name, "/no-such-place" if name == "tmp" else inside, **bounds
        ),
    )
    script = {"tasks": {"t": [{"text": "done"}]}}
    with PolicyServer(script, port=0) as server:
        _prepare(tmp_path / "first", server.base_url)
        config = SupervisorConfig(deadline_s=60, sandbox=BwrapSandbox(worker_start="warm"))
        first = await supervise(tmp_path / "first", config)
        assert not server.requests, "a worker that was never started asked the model"
        assert first.outcome == "infra_failure" and first.exit_code == 125, first.outcome_reason
        assert re.search(
            r"worker was not started: .*cannot mount a tmpfs at /no-such-place", first.outcome_reason
        )
        assert not warm.cage_mounts()
        _prepare(tmp_path / "second", server.base_url)
        second = await supervise(tmp_path / "second", config)
    assert second.outcome == "completed", second.outcome_reason
    uses = {use.budget: use for use in second.budgets}
    assert uses["tmp_inodes"].mechanism == "tmpfs" and uses["tmp_inodes"].peak is not None


def _calc_weather_subset(directory: Path, tasks: tuple[str, ...]) -> Path:
    """A dataset of some of the calc-weather example's rows, beside a copy of its scripted policy."""
    directory.mkdir()
    shutil.copy(EXAMPLES / "calc-weather" / "policy.yaml", directory / "policy.yaml")
    rows = (EXAMPLES / "calc-weather" / "dataset.jsonl").read_text().splitlines()
    chosen = [line for line in rows if json.loads(line)["id"] in tasks]
    (directory / "dataset.jsonl").write_text("".join(line + "\n" for line in chosen))
    return directory / "dataset.jsonl"


async def test_a_hung_template_is_replaced_and_the_starts_it_held_are_retried_as_infra_failures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template that stops answering (SIGSTOP: alive, its socket open, silent) fails the starts sent to
    it as the infrastructure's, not as timeouts: no worker ran. It is killed and a new one serves the
    controller's retries, which complete."""
    monkeypatch.setattr(warm_module, "TEMPLATE_ANSWER_S", 10.0)
    template = template_for(worker_bytecode())
    template.start()
    hung = template.pid
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)
    try:
        dataset = _calc_weather_subset(tmp_path / "data", ("oslo-sum", "cairo-sum"))
        config = RunConfig(
            dataset=dataset,
            out=tmp_path / "out",
            sandbox="bwrap",
            deadline_s=120,
            concurrency=2,
            max_infra_retries=3,
            retry_backoff_s=0.0,
        )
        summary = await Controller(config).run()
        left_behind = alive(hung) or not reaped(hung)
    finally:
        if alive(hung):
            os.kill(hung, signal.SIGKILL)  # a stopped process dies of SIGKILL too
            template.close()
    got = [
        RolloutRecord.model_validate_json(line)
        for line in (config.out / "rollouts.jsonl").read_bytes().splitlines()
    ]
    final = {r.task_id: r for r in got if r.outcome != "infra_failure"}
    assert {task: r.outcome for task, r in final.items()} == {
        "oslo-sum": "completed",
        "cairo-sum": "completed",
    }
    failed = [r for r in got if r.outcome == "infra_failure"]
    assert failed, "no start was sent to the hung template"
    assert all(r.outcome != "timeout" for r in got), [(r.task_id, r.outcome) for r in got]
    assert any(f"template (PID {hung}) did not answer" in r.receipt.outcome_reason for r in failed), [
        r.receipt.outcome_reason for r in failed
    ]
    for record in failed:
        assert "worker was not started" in record.receipt.outcome_reason, record.receipt.outcome_reason
        assert record.receipt.cleanup_confirmed
    assert summary.exit_code == 0
    # Killed and reaped while the run went on (not by the finally above): no process, no zombie.
    assert not left_behind, f"the hung template {hung} was left behind"
