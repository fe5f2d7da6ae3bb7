"""Harness rollouts start their worker warm: the relay to the supervisor travels with the start.

A harness rollout's worker relays the boundaries the harness reports to the supervisor through a
pipe a cold start's worker inherits through bubblewrap. A warm start hands that descriptor to the
template with the start (:attr:`rollcage.forkserver.WorkerStart.pass_fds`), and the forked worker
holds it at the number a cold worker has it, and nothing else the template received. These are
real rollouts, each in a real cage: the scripted policy server, the supervisor with its egress
proxy and capture journal, the worker forked from the template, and a black-box Python harness in
the executor's cage. The harness's processes are seen from the host through ``/proc``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

import rollcage.forkserver._wire as wire
from rollcage.durable import read_journal
from rollcage.policy import PolicyServer
from rollcage.procs import read_proc
from rollcage.protocol import SupervisorReceipt
from rollcage.supervisor import BwrapSandbox, NoSandbox, ProxyConfig, SupervisorConfig, supervise
from tests.helpers.harness_env import HarnessEnvs, prepare_harness_envs
from tests.helpers.relay_harness import relay_harness_code
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import wait_for_async

pytestmark = [
    pytest.mark.bwrap,
    requires_bwrap(),
    pytest.mark.xdist_group("harness"),
    # The first test also waits for the one-time install of the harness environment (about 40 s).
    pytest.mark.timeout(600),
]

TOKEN = "ROLLCAGE_SUPERVISION_TOKEN"
RELAY_FD_ENV = "ROLLCAGE_JOURNAL_FD"


@pytest.fixture(scope="module")
def envs() -> HarnessEnvs:
    """The harness environment, installed once and cached (``tests/helpers/harness_env.py``)."""
    return prepare_harness_envs()


def _prepare(root: Path, policy_url: str, envs: HarnessEnvs, marker: str) -> None:
    from rollcage.harness import resolve_environment

    (root / "workspace").mkdir(parents=True)
    env = resolve_environment("command", envs.env)
    assert env is not None
    code = relay_harness_code(marker)
    data = {
        "rollout_id": root.name,
        "task_id": root.name,
        "input": "go",
        "model": {"base_url": policy_url, "model": "m", "max_retries": 0},
        "agent": {
            "max_policy_calls": 8,
            "harness": {"type": "command", "argv": ["python", "-c", code], "answer": "events"},
        },
        "harness_env": env.model_dump(),
    }
    (root / "input.json").write_text(json.dumps(data))


def _config(mode: str = "warm", **fields: Any) -> SupervisorConfig:
    return SupervisorConfig(
        deadline_s=120, grace_s=10, proxy=ProxyConfig(), sandbox=BwrapSandbox(worker_start=mode), **fields
    )


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as file:
        entries = file.read().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in entries if b"=" in entry)


def _worker_of(root: Path) -> int | None:
    """The rollout's worker: the interpreter running ``rollcage worker`` on the cage's input."""
    token = (root / ".sandbox" / "token").read_text().splitlines()[0]
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if _environ(int(name)).get(TOKEN) != token:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
            with open(f"/proc/{name}/comm") as file:
                interpreter = file.read().startswith("python")
        except OSError:
            continue
        if interpreter and b"worker" in words and b"/rollout/input.json" in words:
            return int(name)
    return None


def _pid_with(marker: str) -> int | None:
    """The harness's interpreter: the one process whose command line holds ``marker`` and is python."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as file:
                words = file.read().split(b"\0")
        except OSError:
            continue
        if (
            words
            and os.path.basename(words[0]).startswith(b"python")
            and any(marker.encode() in w for w in words)
        ):
            return int(name)
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
    """Every process on the machine holding ``link`` (``pipe:[inode]``): PID -> how many descriptors."""
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
    """What a process's descriptors are, counted: ``pipe``, ``socket``, an anonymous inode, or a path
    (the rollout's directory written ``ROOT``)."""
    return Counter(
        re.sub(r"^(pipe|socket):\[\d+\]$", r"\1", link).replace(str(root), "ROOT") for link in links.values()
    )


def _relayed(root: Path) -> list[dict[str, Any]]:
    """The tool calls the supervisor journaled from the worker's relay (the harness reported them)."""
    path = root / "checkpoint.jsonl"
    if not path.exists():
        return []
    return [e for e in read_journal(path) if e["kind"] == "tool_call" and e.get("reported_by") == "harness"]


async def _standing_rollout(
    root: Path, envs: HarnessEnvs, mode: str = "warm"
) -> tuple[dict[str, Any], SupervisorReceipt]:
    """A harness rollout in ``mode``, seen from the host once its boundary is relayed and its second model
    call hangs, then stopped: what was seen, and its receipt."""
    marker = f"rollcage-warm-harness-{secrets.token_hex(6)}"
    script = {"tasks": {"*": [{"text": "again"}, {"text": "again"}]}}
    with PolicyServer(script, port=0, faults=["call=2:kind=hang"]) as server:
        _prepare(root, server.base_url, envs, marker)
        stop = asyncio.Event()
        task = asyncio.ensure_future(supervise(root, _config(mode), stop=stop))
        try:
            await wait_for_async(
                lambda: server.faults_injected, what="the harness's second model call", within_s=180
            )
            relayed = await wait_for_async(lambda: _relayed(root), what="the relayed tool call boundary")
            worker = await wait_for_async(lambda: _worker_of(root), what="the worker's process")
            harness = await wait_for_async(lambda: _pid_with(marker), what="the harness's process")
            info = read_proc(worker)
            relay_fd = int(_environ(worker)[RELAY_FD_ENV])
            links = _fd_links(worker)
            seen = {
                "worker": worker,
                "parent": None if info is None else info.ppid,
                "relayed": relayed,
                "relay_fd": relay_fd,
                "fds": links,
                "relay_holders": _holders_of(links[relay_fd]) if relay_fd in links else {},
                "harness_fds": _fd_links(harness),
            }
        finally:
            stop.set()
            receipt = await task
    return seen, receipt


def _relay_ended(caplog: pytest.LogCaptureFixture) -> None:
    """The supervisor's journal saw the relay's end once the worker was gone: no copy was left open
    anywhere (it waits a while for it, then gives up and says so)."""
    assert "relay did not close" not in caplog.text, caplog.text


async def test_a_harness_rollout_s_worker_is_forked_warm_holding_its_relay_and_nothing_else(
    envs: HarnessEnvs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    warm, receipt = await _standing_rollout(tmp_path / "warm", envs)
    cold, cold_receipt = await _standing_rollout(tmp_path / "cold", envs, mode="cold")

    # Warm: the worker is the supervisor's own child (forked from the template), not bubblewrap's.
    assert warm["parent"] == os.getpid(), warm
    assert cold["parent"] != os.getpid(), cold
    # The boundary the harness reported reached the supervisor's journal while the rollout ran.
    assert [e["tool_calls"][0]["name"] for e in warm["relayed"]] == ["probe"]

    # The relay sits at the number the worker was told, a pipe, as in a cold start.
    relay = warm["relay_fd"]
    assert relay >= 3 and warm["fds"][relay].startswith("pipe:"), warm["fds"]
    assert cold["fds"][cold["relay_fd"]].startswith("pipe:"), cold["fds"]
    # Held by the worker and by the supervisor's reading end alone: not the holder, bubblewrap, the
    # template, the executor template, nor a second copy here.
    assert warm["relay_holders"] == {warm["worker"]: 1, os.getpid(): 1}, warm["relay_holders"]
    # Nor the harness, which runs in the executor's cage.
    assert warm["fds"][relay] not in warm["harness_fds"].values()

    # Every other descriptor is the cold worker's, but for one socket (to the executor template): none
    # of the template's received descriptors (holder pidfd, report socket, log copy) is left open.
    # (By what each is, not its number: the relay's number is the supervisor's, which differs per rollout.)
    warm_kinds, cold_kinds = _kinds(warm["fds"], tmp_path / "warm"), _kinds(cold["fds"], tmp_path / "cold")
    assert warm_kinds - cold_kinds == Counter(["socket"]) and not cold_kinds - warm_kinds, (
        warm["fds"],
        cold["fds"],
    )

    # Stopped on request: SIGTERM to the worker's group, a cancelled rollout, its journal whole.
    for done in (receipt, cold_receipt):
        assert done.outcome == "cancelled", done.outcome_reason
        assert done.signals_sent and done.signals_sent[0].signal == "SIGTERM", done.signals_sent
        assert done.cleanup_confirmed
    assert [e["tool_calls"][0]["name"] for e in _relayed(tmp_path / "warm")] == ["probe"]
    models = [e for e in read_journal(tmp_path / "warm" / "checkpoint.jsonl") if e["kind"] == "model_call"]
    assert len(models) >= 1 and {e["reported_by"] for e in models} == {"supervisor"}
    _relay_ended(caplog)


async def test_a_harness_rollout_completes_warm(
    envs: HarnessEnvs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "done"
    marker = f"rollcage-warm-harness-{secrets.token_hex(6)}"
    with PolicyServer({"tasks": {"*": [{"text": "again"}, {"text": "again"}]}}, port=0) as server:
        _prepare(root, server.base_url, envs, marker)
        receipt = await supervise(root, _config())
    assert receipt.outcome == "completed", receipt.outcome_reason
    result = json.loads((root / "result.json").read_text())
    assert result["response"]["output_text"] == "done"
    assert [e["tool_calls"][0]["name"] for e in _relayed(root)] == ["probe"]
    _relay_ended(caplog)


async def test_a_harness_rollout_without_a_sandbox_relays(
    envs: HarnessEnvs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # --sandbox none's warm start carries the relay too (tests/harness/test_harness_warm_everywhere.py
    # holds it to a cold start's): here with the harness's own environment.
    root = tmp_path / "none"
    marker = f"rollcage-none-harness-{secrets.token_hex(6)}"
    config = SupervisorConfig(deadline_s=120, grace_s=10, proxy=ProxyConfig(), sandbox=NoSandbox())
    with PolicyServer({"tasks": {"*": [{"text": "again"}, {"text": "again"}]}}, port=0) as server:
        _prepare(root, server.base_url, envs, marker)
        receipt = await supervise(root, config)
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert [e["tool_calls"][0]["name"] for e in _relayed(root)] == ["probe"]
    _relay_ended(caplog)


async def test_a_warm_start_that_cannot_carry_the_relay_falls_back_to_cold(
    envs: HarnessEnvs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # As if the wire could pass no descriptor on: the launch refuses the warm start, not the rollout.
    monkeypatch.setattr(wire, "MAX_PASS_FDS", 0)
    seen, receipt = await _standing_rollout(tmp_path / "refused", envs)
    assert seen["parent"] != os.getpid(), "the worker was forked warm all the same"
    assert [e["tool_calls"][0]["name"] for e in seen["relayed"]] == ["probe"]
    assert receipt.outcome == "cancelled", receipt.outcome_reason
    assert any("started cold, not warm" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_failed_warm_start_of_a_harness_rollout_is_an_infra_failure_and_ends_its_journal(
    envs: HarnessEnvs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from rollcage.budgets import RolloutBudgets

    missing = tmp_path / "no-such-cgroup" / "cgroup.procs"
    monkeypatch.setattr(RolloutBudgets, "cgroup_procs", lambda self: [str(missing)])
    root = tmp_path / "failed"
    with PolicyServer({"tasks": {"*": [{"text": "never asked"}]}}, port=0) as server:
        _prepare(root, server.base_url, envs, "rollcage-never-started")
        # Bounded: a relay whose end never came would leave the supervisor waiting on its journal.
        receipt = await asyncio.wait_for(supervise(root, _config()), timeout=120)
        assert not server.requests, "a worker that was never started asked the model"
    assert receipt.outcome == "infra_failure", receipt.outcome_reason
    assert re.search(
        r"worker was not started: the warm start failed: .*no-such-cgroup", receipt.outcome_reason
    )
    assert receipt.cleanup_confirmed
    _relay_ended(caplog)
