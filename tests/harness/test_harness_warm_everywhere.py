"""Harness rollouts start warm without root and under ``--sandbox none``, their relay carried with the start.

A harness rollout's worker relays the boundaries its harness reports to the supervisor through a
pipe, which a cold worker inherits at the number ``ROLLCAGE_JOURNAL_FD`` names. As root under
bubblewrap the warm start carries it to the template (``tests/harness/test_harness_warm.py``). The
two other warm starts carry it too: a non-root supervisor's, whose template forks a go-between that
joins the cage and forks the worker there, and ``--sandbox none``'s, whose worker is forked beside a
holder. Their holder runs the cold worker should the warm start fail, so it holds the relay as well,
at its number, for that worker.

These are real rollouts: the scripted policy server, the supervisor with its egress proxy and
capture journal, the worker forked from the template, and a black-box harness (a plain
``python -c``, with no harness environment) that reports one tool call. Each warm worker is held to a
cold one seen the same way from the host: its parent, its descriptors, who holds the relay, the
boundary relayed, the outcome of a stop, a deadline and a killed supervisor, and a warm start that
fails running the cold worker with the relay.

As root, the non-root tests are not collected; the last test runs this file again as
``rollcage-test``, where they run (with the ``--sandbox none`` ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

import rollcage.supervisor.warm as warm_module
from rollcage.durable import read_journal
from rollcage.errors import SupervisorError
from rollcage.policy import PolicyServer
from rollcage.procs import ensure_subreaper, read_proc, scan_processes
from rollcage.protocol import SupervisorReceipt
from rollcage.supervisor import BwrapSandbox, NoSandbox, ProxyConfig, SupervisorConfig, supervise
from tests.helpers.relay_harness import relay_harness_code
from tests.helpers.supervisor_env import processes_with_token, requires_bwrap
from tests.helpers.waiting import alive, wait_for, wait_for_async

ROOT = os.geteuid() == 0
pytestmark = [pytest.mark.xdist_group("harness"), pytest.mark.timeout(300)]
_F = TypeVar("_F", bound=Callable[..., Any])

TOKEN = "ROLLCAGE_SUPERVISION_TOKEN"
RELAY_FD_ENV = "ROLLCAGE_JOURNAL_FD"


def not_root(test: _F) -> _F:
    """A non-root supervisor's test: collected only where this session is not root (the last test
    runs this file again as rollcage-test). Not a skip: a skip under ``make test`` is a failure."""
    test.__test__ = not ROOT  # type: ignore[attr-defined]
    return test


SCRIPT = {"tasks": {"*": [{"text": "again"}, {"text": "again"}]}}


@pytest.fixture(autouse=True)
def _no_strays() -> Any:
    """Every test must leave no supervised process behind."""
    yield
    assert processes_with_token() == [], "a supervised process outlived its test"


def _prepare(root: Path, policy_url: str, marker: str) -> None:
    (root / "workspace").mkdir(parents=True)
    code = relay_harness_code(marker)
    data = {
        "rollout_id": root.name,
        "task_id": root.name,
        "input": "go",
        # The hanging call outlasts every deadline here: the model's own timeout must not end it first.
        "model": {"base_url": policy_url, "model": "m", "max_retries": 0, "timeout_s": 600},
        "agent": {
            "max_policy_calls": 8,
            "harness": {"type": "command", "argv": [sys.executable, "-c", code], "answer": "events"},
        },
    }
    (root / "input.json").write_text(json.dumps(data))


def _config(sandbox: str, mode: str, **fields: Any) -> SupervisorConfig:
    chosen = NoSandbox(worker_start=mode) if sandbox == "none" else BwrapSandbox(worker_start=mode)
    return SupervisorConfig(
        **{"deadline_s": 120, "grace_s": 10, **fields}, proxy=ProxyConfig(), sandbox=chosen
    )


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as file:
        entries = file.read().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def _token(root: Path) -> str | None:
    try:
        return (root / ".sandbox" / "token").read_text().splitlines()[0]
    except (OSError, IndexError):
        return None  # not written yet: nothing of the rollout runs


def _rollout_processes(root: Path) -> dict[int, list[bytes]]:
    """The rollout's live processes (by the token in their environment): PID -> command line."""
    token = _token(root)
    found: dict[int, list[bytes]] = {}
    if token is None:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if _environ(int(name)).get(TOKEN) != token:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as file:
                found[int(name)] = file.read().split(b"\0")
        except OSError:
            continue
    return found


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return "?"


def _worker_of(root: Path) -> int | None:
    """The rollout's worker: the interpreter running ``rollcage worker`` (a warm start's holder carries
    the cold command line too, but is a shell)."""
    for pid, words in _rollout_processes(root).items():
        if b"worker" in words and _comm(pid).startswith("python"):
            return pid
    return None


def _holder_of(root: Path) -> int | None:
    """A warm start's holder: the shell whose arguments are the cold start's."""
    for pid, words in _rollout_processes(root).items():
        if b"rollcage-holder" in words and _comm(pid) == "sh":
            return pid
    return None


def _fd_links(pid: int) -> dict[int, str]:
    links = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
    return links


def _holders_of(link: str) -> dict[int, int]:
    """Every process on the machine holding ``link`` (``pipe:[inode]``) that this user may look at:
    PID -> how many descriptors."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            count = sum(1 for target in _fd_links(int(name)).values() if target == link)
        except OSError:
            continue
        if count:
            found[int(name)] = count
    return found


def _kinds(links: dict[int, str], root: Path) -> Counter[str]:
    """What a process's descriptors are, counted: ``pipe``, ``socket``, or a path (the rollout's
    directory written ``ROOT``)."""
    return Counter(
        re.sub(r"^(pipe|socket):\[\d+\]$", r"\1", link).replace(str(root), "ROOT") for link in links.values()
    )


def _relayed(root: Path) -> list[str]:
    """The names of the tool calls the supervisor journaled from the worker's relay."""
    path = root / "checkpoint.jsonl"
    if not path.exists():
        return []
    return [
        e["tool_calls"][0]["name"]
        for e in read_journal(path)
        if e["kind"] == "tool_call" and e.get("reported_by") == "harness"
    ]


async def _standing(root: Path, sandbox: str, mode: str) -> tuple[dict[str, Any], SupervisorReceipt]:
    """A harness rollout seen from the host once its boundary is relayed and its second model call
    hangs, then stopped: what was seen, and its receipt."""
    marker = f"rollcage-harness-{secrets.token_hex(6)}"
    with PolicyServer(SCRIPT, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(root, server.base_url, marker)
        stop = asyncio.Event()
        task = asyncio.ensure_future(supervise(root, _config(sandbox, mode), stop=stop))
        try:
            await wait_for_async(
                lambda: task.done() or server.faults_injected, what="the harness's second model call"
            )
            assert not task.done(), f"the rollout ended early: {task.result()!r}"
            relayed = await wait_for_async(lambda: _relayed(root), what="the relayed tool call boundary")
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            info = read_proc(worker)
            relay_fd = int(_environ(worker)[RELAY_FD_ENV])
            links = _fd_links(worker)
            holders = _holders_of(links[relay_fd]) if relay_fd in links else {}
            seen = {
                "worker": worker,
                "parent": None if info is None else info.ppid,
                "holder": _holder_of(root),
                "relayed": relayed,
                "relay_fd": relay_fd,
                "fds": links,
                "relay_holders": holders,
                "relay_holder_comms": sorted(
                    _comm(pid) for pid in holders if pid not in (worker, os.getpid())
                ),
            }
        finally:
            stop.set()
            receipt = await task
    return seen, receipt


def _relay_ended(caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor's journal saw the relay's end once the rollout was over: no copy was left open
    (it waits a while for it, then gives up and says so)."""
    assert "relay did not close" not in caplog.text, caplog.text


def _stopped(*receipts: SupervisorReceipt) -> None:
    """Stopped on request: SIGTERM to the worker, a cancelled rollout with its result, nothing left."""
    for receipt in receipts:
        assert receipt.outcome == "cancelled", receipt.outcome_reason
        assert receipt.signals_sent and receipt.signals_sent[0].signal == "SIGTERM", receipt.signals_sent
        assert [s.reason for s in receipt.signals_sent] == ["stop"], receipt.signals_sent
        assert receipt.result_present and receipt.cleanup_confirmed, receipt


def _same_descriptors(
    warm: dict[str, Any], cold: dict[str, Any], tmp_path: Path, *, extra: Counter[str] | None = None
) -> None:
    """The running warm worker holds what the running cold one holds: the relay at the number it was
    told, a pipe, and the same others (its standard ones, its event loop's and sockets), and ``extra``
    besides (a caged worker's socket to the executor template, which forks its executors); none of
    what the template received (holder pidfd, report socket, log copy)."""
    for seen in (warm, cold):
        relay = seen["relay_fd"]
        assert relay >= 3 and seen["fds"][relay].startswith("pipe:"), seen["fds"]
    # By what each is, not its number: the relay's number is the supervisor's, which differs per rollout.
    warm_kinds, cold_kinds = _kinds(warm["fds"], tmp_path / "warm"), _kinds(cold["fds"], tmp_path / "cold")
    assert warm_kinds == cold_kinds + (extra or Counter()), (warm["fds"], cold["fds"])


# ---- --sandbox none, as any user ----------------------------------------------------------------


async def test_a_harness_rollout_without_a_sandbox_is_forked_warm_holding_a_cold_worker_s_descriptors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warm, receipt = await _standing(tmp_path / "warm", "none", "warm")
    cold, cold_receipt = await _standing(tmp_path / "cold", "none", "cold")

    # Warm: forked beside a holder (a shell that relays its exit status); cold: the worker alone. Both
    # are the supervisor's children (a cold one is spawned, a warm one forked as its child).
    assert warm["holder"] is not None and cold["holder"] is None, (warm, cold)
    assert warm["parent"] == cold["parent"] == os.getpid()
    assert warm["relayed"] == cold["relayed"] == ["probe"]
    _same_descriptors(warm, cold, tmp_path)
    # The relay: held by the worker, the supervisor's reading end and (warm) the holder, which runs the
    # cold worker with it should the warm start fail; not the template, nor a second copy anywhere.
    assert cold["relay_holders"] == {cold["worker"]: 1, os.getpid(): 1}, cold["relay_holders"]
    assert warm["relay_holders"] == {warm["worker"]: 1, warm["holder"]: 1, os.getpid(): 1}, warm
    _stopped(receipt, cold_receipt)
    _relay_ended(caplog)


async def test_a_harness_rollout_without_a_sandbox_completes_warm_with_its_journal_and_result(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "done"
    with PolicyServer(SCRIPT, port=0) as server:
        _prepare(root, server.base_url, "rollcage-harness-completes")
        task = asyncio.ensure_future(supervise(root, _config("none", "warm")))
        # Warm: the holder stands beside the worker while it runs (seen before the rollout ends).
        holder = await wait_for_async(lambda: task.done() or _holder_of(root), what="the warm start's holder")
        receipt = await task
    assert holder is not True, "no holder was seen: not a warm start"
    assert receipt.outcome == "completed", receipt.outcome_reason
    result = json.loads((root / "result.json").read_text())
    assert result["response"]["output_text"] == "done"
    assert _relayed(root) == ["probe"]
    models = [e for e in read_journal(root / "checkpoint.jsonl") if e["kind"] == "model_call"]
    assert len(models) == 2 and {e["reported_by"] for e in models} == {"supervisor"}
    _relay_ended(caplog)


async def test_the_deadline_ends_a_warm_harness_rollout_without_a_sandbox_and_its_tree(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "late"
    marker = f"rollcage-harness-{secrets.token_hex(6)}"
    with PolicyServer(SCRIPT, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(root, server.base_url, marker)
        # Long enough for a fresh template and the harness's first call on a loaded machine.
        task = asyncio.ensure_future(supervise(root, _config("none", "warm", deadline_s=30, grace_s=2)))
        try:
            await wait_for_async(
                lambda: task.done() or server.faults_injected, what="the harness's second model call"
            )
            assert not task.done(), f"the rollout ended early: {task.result()!r}"
            assert _holder_of(root) is not None, "not a warm start"
            started = list(_rollout_processes(root))
            assert len(started) >= 3, started  # holder, worker, harness
        finally:
            receipt = await task
    assert receipt.outcome == "timeout", receipt.outcome_reason
    assert receipt.deadline_fired and receipt.cleanup_confirmed
    assert not any(alive(pid) for pid in started), "a process of the rollout outlived its deadline"
    assert _relayed(root) == ["probe"]
    _relay_ended(caplog)


_SUPERVISE = """
import asyncio, sys
from pathlib import Path
from rollcage.supervisor import NoSandbox, ProxyConfig, SupervisorConfig, supervise
config = SupervisorConfig(deadline_s=120, grace_s=10, proxy=ProxyConfig(), sandbox=NoSandbox())
asyncio.run(supervise(Path(sys.argv[1]), config))
"""


@pytest.mark.timeout(120)
def test_a_sigkilled_supervisor_takes_a_warm_harness_rollout_without_a_sandbox_along(tmp_path: Path) -> None:
    # What the killed supervisor leaves is reparented to this process (a subreaper): the token search sees it.
    ensure_subreaper()
    root = tmp_path / "r"
    with PolicyServer(SCRIPT, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(root, server.base_url, f"rollcage-harness-{secrets.token_hex(6)}")
        argv = [sys.executable, "-c", _SUPERVISE, str(root)]
        with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
            try:
                wait_for(lambda: server.faults_injected, what="the harness's second model call")
                worker = wait_for(lambda: _worker_of(root), what="the worker's process")
                info = read_proc(worker)
                assert info is not None and info.ppid == proc.pid, "the worker is not the supervisor's child"
                holder = _holder_of(root)
                assert holder is not None, "no holder beside the worker: not a warm start"
                started = [worker, holder]
                proc.kill()
                proc.wait(timeout=10)
            finally:
                proc.kill()
        # The worker and its holder die with the supervisor (the worker's parent-death signal, the
        # holder's end of its socket), as a cold worker does.
        wait_for(
            lambda: not any(alive(pid) for pid in started), timeout=10, what="the worker and holder to die"
        )
    # The harness (the worker's child, with no parent-death signal of its own) is left by a cold start
    # alike: not this start's to end. Ended here, by its PID.
    for pid in processes_with_token():
        os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not processes_with_token(), timeout=10, what="the harness to be gone")


async def test_a_failed_warm_start_without_a_sandbox_runs_the_cold_worker_with_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def refuse(self: warm_module.Template, request: object, fds: object) -> int:
        raise SupervisorError("the warm worker template refused a start: (test)")

    monkeypatch.setattr(warm_module.Template, "send", refuse)
    with caplog.at_level(logging.WARNING, logger="rollcage.supervisor"):
        seen, receipt = await _standing(tmp_path / "r", "none", "warm")
    assert "refused a start: (test); the worker starts cold" in caplog.text
    # The holder became the cold worker: a python process where the shell was, with the relay at its
    # number, held by it and the supervisor's reading end alone.
    assert seen["holder"] is None and seen["relayed"] == ["probe"]
    assert seen["fds"][seen["relay_fd"]].startswith("pipe:")
    assert seen["relay_holders"] == {seen["worker"]: 1, os.getpid(): 1}, seen["relay_holders"]
    _stopped(receipt)
    _relay_ended(caplog)


# ---- bubblewrap without root (as rollcage-test) --------------------------------------------------


@not_root
@requires_bwrap()
async def test_a_non_root_harness_rollout_s_worker_is_forked_warm_holding_a_cold_worker_s_descriptors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warm, receipt = await _standing(tmp_path / "warm", "bwrap", "warm")
    cold, cold_receipt = await _standing(tmp_path / "cold", "bwrap", "cold")

    # Warm: the worker is the supervisor's own child (forked by the go-between), not bubblewrap's.
    assert warm["parent"] == os.getpid() and cold["parent"] != os.getpid(), (warm, cold)
    assert warm["holder"] is not None and cold["holder"] is None
    assert warm["relayed"] == cold["relayed"] == ["probe"]
    _same_descriptors(warm, cold, tmp_path, extra=Counter(["socket"]))
    # The relay: besides the worker and the supervisor's reading end, bubblewrap holds it as in a cold
    # start, and the holder, which runs the cold worker with it should the kernel refuse the warm one;
    # not the template nor the go-between (python), nor a second copy in any.
    assert warm["relay_holders"][warm["worker"]] == 1 and warm["relay_holders"][os.getpid()] == 1
    assert warm["relay_holder_comms"] == sorted([*cold["relay_holder_comms"], "sh"]), (warm, cold)
    assert set(cold["relay_holder_comms"]) <= {"bwrap"}, cold
    _stopped(receipt, cold_receipt)
    _relay_ended(caplog)


@not_root
@requires_bwrap()
async def test_a_non_root_harness_rollout_completes_warm_and_its_deadline_ends_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "done"
    with PolicyServer(SCRIPT, port=0) as server:
        _prepare(root, server.base_url, "rollcage-harness-completes")
        receipt = await supervise(root, _config("bwrap", "warm"))
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert json.loads((root / "result.json").read_text())["response"]["output_text"] == "done"
    assert _relayed(root) == ["probe"]
    assert "could not enter its cage" not in (root / "worker.log").read_text()

    late = tmp_path / "late"
    with PolicyServer(SCRIPT, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(late, server.base_url, f"rollcage-harness-{secrets.token_hex(6)}")
        task = asyncio.ensure_future(supervise(late, _config("bwrap", "warm", deadline_s=30, grace_s=2)))
        try:
            await wait_for_async(
                lambda: task.done() or server.faults_injected, what="the harness's second model call"
            )
            assert not task.done(), f"the rollout ended early: {task.result()!r}"
            worker = await wait_for_async(lambda: _worker_of(late), what="the worker's process")
            info = read_proc(worker)
            assert info is not None and info.ppid == os.getpid(), "not a warm worker"
            started = list(_rollout_processes(late))
        finally:
            timed_out = await task
    assert timed_out.outcome == "timeout", timed_out.outcome_reason
    assert timed_out.deadline_fired and timed_out.cleanup_confirmed
    assert not any(alive(pid) for pid in started), "a process of the rollout outlived its deadline"
    _relay_ended(caplog)


@not_root
@requires_bwrap()
async def test_a_non_root_warm_start_that_fails_runs_the_cold_worker_with_the_relay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A go-between that cannot move into the rollout's cgroups: the holder runs the cold worker,
    which relays the harness's boundary through the holder's copy of the relay."""
    from rollcage.budgets import RolloutBudgets

    missing = tmp_path / "no-such-cgroup" / "cgroup.procs"
    monkeypatch.setattr(RolloutBudgets, "cgroup_procs", lambda self: [str(missing)])
    with caplog.at_level(logging.WARNING, logger="rollcage.supervisor"):
        seen, receipt = await _standing(tmp_path / "r", "bwrap", "warm")
    assert "cannot move into the rollout's cgroups" in caplog.text
    assert "could not enter its cage" in (tmp_path / "r" / "worker.log").read_text()
    assert seen["parent"] != os.getpid() and seen["holder"] is None, "not the cold fallback"
    assert seen["relayed"] == ["probe"]
    assert seen["fds"][seen["relay_fd"]].startswith("pipe:")
    assert set(seen["relay_holder_comms"]) <= {"bwrap"}, seen
    _stopped(receipt)
    _relay_ended(caplog)


@not_root
@requires_bwrap()
@pytest.mark.timeout(120)
def test_a_sigkilled_non_root_supervisor_takes_its_warm_harness_rollout_with_it(tmp_path: Path) -> None:
    ensure_subreaper()
    root = tmp_path / "r"
    script = _SUPERVISE.replace("sandbox=NoSandbox()", "sandbox=BwrapSandbox()").replace(
        "import NoSandbox", "import BwrapSandbox"
    )
    with PolicyServer(SCRIPT, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(root, server.base_url, f"rollcage-harness-{secrets.token_hex(6)}")
        with subprocess.Popen(
            [sys.executable, "-c", script, str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        ) as proc:
            try:
                wait_for(lambda: server.faults_injected, what="the harness's second model call")
                worker = wait_for(lambda: _worker_of(root), what="the worker's process")
                info = read_proc(worker)
                assert info is not None and info.ppid == proc.pid, "not a warm worker"
                started = list(_rollout_processes(root))
                proc.kill()
                proc.wait(timeout=10)
            finally:
                proc.kill()

    # The cage's PID namespace ends with its holder (whose socket's end is the supervisor's death): the
    # worker, the harness and its executor's cage in it. The worker, the supervisor's child, is this
    # process's now (a subreaper, as init would be), and the cage's init lingers until its zombie is
    # reaped: reaped here as init would.
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


@pytest.mark.timeout(600)
def test_this_suite_passes_as_an_unprivileged_user() -> None:
    """The non-root warm path, for real: this file again, in a session of its own, as a plain user."""
    from tests.helpers.unprivileged import make_test_user, run_as, user_dir

    user = make_test_user()  # skips where the suite already runs unprivileged
    with user_dir(user) as home:
        argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
        argv += ["--basetemp", str(home / "pytest"), __file__]
        done = run_as(user, argv, home=home, timeout_s=540)
    assert done.returncode == 0, f"as {user.name} (uid {user.uid}):\n{done.stdout[-12000:]}"
    # Every test ran there but this one (which skips where it is not root).
    assert " passed, 1 skipped" in done.stdout, done.stdout[-3000:]
