"""What ``/dev`` the agent's code finds in a real rollout's executor cage, as a cold and as a warm start.

The worker's cage takes ``/dev`` as the outer stage made it (its device nodes,
its own ``devpts``, the bounded ``/dev/shm``), and the executor's cage takes the
worker's: neither makes a ``/dev`` of its own. Whatever the way it gets there,
the agent's code must find the usual devices usable, ``/dev/shm`` writable, and
nothing it can make or change in ``/dev`` itself.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rollcage.policy import PolicyServer
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import requires_bwrap
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
json.dump(found, open("dev.json", "w"))
"""


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


def test_the_repl_executors_cage_starts_bwrap_itself_and_other_callers_through_sh() -> None:
    from rollcage.cage import NestedCage

    cage = NestedCage(bwrap="/usr/bin/bwrap", workspace="/rollout/workspace", hide=("/rollout",))
    # The repl executor starts its cage with SIGINT blocked (rollcage.tools._repl): nothing to ignore it.
    assert cage.prefix(ignore_sigint=False)[0] == "/usr/bin/bwrap"
    assert cage.prefix(ignore_sigint=False) == cage.prefix()[4:]
    assert cage.prefix()[:3] == ["/bin/sh", "-c", 'trap "" INT; exec "$@"']
