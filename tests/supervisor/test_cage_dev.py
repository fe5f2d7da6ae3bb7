"""What ``/dev`` the agent's code finds in a real rollout's executor cage, as a cold and as a warm start.

The worker's cage takes ``/dev`` as the outer stage made it (its device nodes,
its own ``devpts``, the bounded ``/dev/shm``), and the executor's cage takes the
worker's: neither makes a ``/dev`` of its own. Whatever the way it gets there,
the agent's code must find the usual devices usable, ``/dev/shm`` writable, and
nothing it can make or change in ``/dev`` itself.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rollcage.policy import PolicyServer
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import make_rollout, processes_with_token, requires_bwrap
from tests.helpers.waiting import wait_for_async
from tests.helpers.worker_env import worker_input

pytestmark = [requires_bwrap(), pytest.mark.bwrap]

_PROBE = """\
import json, os
found = {"devices": sorted(n for n in ("null", "zero", "full", "random", "urandom", "tty")
                           if os.path.exists("/dev/" + n))}
with open("/dev/null", "w") as null:
    found["null"] = null.write("discarded")
with open("/dev/zero", "rb") as zero:
    found["zero"] = zero.read(4).hex()
with open("/dev/urandom", "rb") as urandom:
    found["urandom"] = len(urandom.read(16))
with open("/dev/shm/probe", "w") as shm:
    found["shm"] = shm.write("kept")
for name, make in (("file", lambda: open("/dev/made", "w")), ("dir", lambda: os.mkdir("/dev/made")),
                   ("fifo", lambda: os.mkfifo("/dev/made")), ("unlink", lambda: os.unlink("/dev/tty"))):
    try:
        make()
        found[name] = "made"
    except OSError as exc:
        found[name] = "refused: " + type(exc).__name__
found["devices_on"] = sorted(line.split()[4] for line in open("/proc/self/mountinfo")
                            if "nodev" not in line.split(" - ")[0].split()[5].split(","))
json.dump(found, open("dev.json", "w"))
"""

# What bubblewrap's --dev makes: the only mounts of a cage where a device node may be opened.
DEVICE_MOUNTS = ["/dev/full", "/dev/null", "/dev/pts", "/dev/random", "/dev/tty", "/dev/urandom", "/dev/zero"]


def _devices_on(mountinfo: str) -> list[str]:
    """The mount points of a ``mountinfo`` file that allow device nodes (no ``nodev``), sorted."""
    found = []
    for line in Path(mountinfo).read_text().splitlines():
        fields = line.split(" - ")[0].split()
        if "nodev" not in fields[5].split(","):
            found.append(fields[4])
    return sorted(found)


def _worker(root: Path) -> int | None:
    """The rollout's worker (the interpreter running ``rollcage worker`` in the cage), once it runs."""
    token = (root / ".sandbox" / "token").read_text().splitlines()[0]
    for pid in processes_with_token(f"ROLLCAGE_SUPERVISION_TOKEN={token}"):
        try:
            words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        nspid = next((line.split() for line in status if line.startswith("NSpid:")), [])
        if b"worker" in words and b"/rollout/input.json" in words and len(nspid) > 2:
            return pid
    return None


def _script() -> dict[str, Any]:
    call = {"name": "python", "arguments": {"code": _PROBE}}
    return {"tasks": {"t": [{"tool_calls": [call]}, {"text": "done"}]}}


@pytest.mark.parametrize("start", ["cold", "warm"])
async def test_the_agents_code_finds_the_devices_usable_and_dev_itself_unchangeable(
    tmp_path: Path, start: str
) -> None:
    root = tmp_path / "r"
    root.mkdir()
    (root / "workspace").mkdir()
    with PolicyServer(_script(), port=0) as server:
        (root / "input.json").write_text(json.dumps(worker_input(model_url=server.base_url, task_id="t")))
        sandbox = BwrapSandbox(worker_start=start)
        receipt = await supervise(root, SupervisorConfig(deadline_s=120, sandbox=sandbox))

    assert receipt.outcome == "completed", receipt.outcome_reason
    found = json.loads((root / "workspace" / "dev.json").read_text())
    assert found["devices"] == ["full", "null", "random", "tty", "urandom", "zero"], found
    assert (found["null"], found["zero"], found["urandom"], found["shm"]) == (9, "00000000", 16, 4), found
    for name in ("file", "dir", "fifo", "unlink"):
        assert found[name].startswith("refused"), (name, found)
    assert found["devices_on"] == DEVICE_MOUNTS, found["devices_on"]


@pytest.mark.parametrize("start", ["cold", "warm"])
async def test_in_the_workers_cage_only_devs_own_nodes_allow_devices(tmp_path: Path, start: str) -> None:
    # The inner stage binds the outer's tree with --dev-bind: every mount but /dev's nodes must
    # already be nodev, or the worker could open a device node planted anywhere else.
    with PolicyServer({"tasks": {"t": [{"text": "never"}]}}, port=0, faults=["call=1:kind=hang"]) as server:
        root = make_rollout(tmp_path, "r", model_url=server.base_url)
        stop = asyncio.Event()
        config = SupervisorConfig(deadline_s=120, sandbox=BwrapSandbox(worker_start=start))
        task = asyncio.ensure_future(supervise(root, config, stop=stop))
        try:
            await wait_for_async(lambda: server.faults_injected, what="the worker's first model call")
            pid = await wait_for_async(lambda: _worker(root), what="the worker's process")
            devices_on = _devices_on(f"/proc/{pid}/mountinfo")
        finally:
            stop.set()
            receipt = await task
    assert devices_on == DEVICE_MOUNTS, devices_on
    assert receipt.outcome == "cancelled" and receipt.cleanup_confirmed, receipt.outcome_reason


def test_the_repl_executors_cage_starts_bwrap_itself_and_other_callers_through_sh() -> None:
    from rollcage.cage import NestedCage

    cage = NestedCage(bwrap="/usr/bin/bwrap", workspace="/rollout/workspace", hide=("/rollout",))
    # The repl executor starts its cage with SIGINT blocked (rollcage.tools._repl): nothing to ignore it.
    assert cage.prefix(ignore_sigint=False)[0] == "/usr/bin/bwrap"
    assert cage.prefix(ignore_sigint=False) == cage.prefix()[4:]
    assert cage.prefix()[:3] == ["/bin/sh", "-c", 'trap "" INT; exec "$@"']
