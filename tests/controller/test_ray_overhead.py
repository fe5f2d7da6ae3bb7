"""What a run on Ray costs beyond its rollouts: the processes it starts, what they import (issue 41).

No cluster: the stop flag's class is unpickled in a bare interpreter, and the end-of-run sweep
is driven with Ray's node listing and task submission replaced by fakes.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import pytest

try:
    import ray  # noqa: F401

    HAVE_RAY = True
except ImportError:  # pragma: no cover - CI installs ray
    HAVE_RAY = False

pytestmark = pytest.mark.skipif(
    not HAVE_RAY, reason="needs ray: pip install 'rollcage[ray]' (CI installs it)"
)

_LOAD_FLAG = """
import asyncio, json, sys
from ray import cloudpickle
flag = cloudpickle.loads(sys.stdin.buffer.read())()
async def main():
    before = await flag.wait(0.01)
    await flag.set()
    return before, await flag.wait(5)
imported = sorted(m for m in sys.modules if m.startswith("rollcage"))
print(json.dumps([type(flag).__name__, asyncio.run(main()), imported]))
"""


def test_the_stop_flag_travels_by_value_so_its_process_imports_no_rollcage() -> None:
    """The run's stop flag actor's process loads the class Ray pickled: pickled by reference, it
    would import rollcage's controller, supervisor and models (~0.5 s of CPU every run)."""
    from ray import cloudpickle

    from rollcage.controller._ray import _stop_flag_class

    blob = cloudpickle.dumps(_stop_flag_class())
    done = subprocess.run(
        [sys.executable, "-I", "-c", _LOAD_FLAG], input=blob, capture_output=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr.decode()
    name, (before, after), imported = json.loads(done.stdout)
    # Still titled ray::_StopFlag (what operators and the stop tests look for); it still works.
    assert (name, before, after) == ("_StopFlag", False, True)
    assert imported == []


def _node(letter: str) -> str:
    """A Ray node id (28 bytes in hex, as NodeAffinitySchedulingStrategy insists) named by a letter."""
    return letter * 56


class _FakeRemote:
    """``_sweep_remote``: records the nodes a sweep task is submitted to, each sweeping nothing."""

    def __init__(self) -> None:
        self.nodes: list[str] = []

    def options(self, **options: Any) -> _FakeRemote:
        self.nodes.append(options["scheduling_strategy"].node_id[0])
        return self

    def remote(self) -> asyncio.Future[int]:
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        future.set_result(0)
        return future


@pytest.mark.parametrize(
    ("swept", "dirty", "expected"),
    [
        (set(), set(), ["a", "b", "c"]),  # a resumed run with nothing left to do: every node
        ({"a", "b"}, set(), ["c"]),  # a node no task of the run swept
        ({"a", "b", "c"}, set(), []),  # every node swept by its tasks: no sweep task, no process
        ({"a", "b", "c"}, {"b"}, ["b"]),  # a lost task's leftovers, after its node's sweep
    ],
)
async def test_a_run_ends_sweeping_the_nodes_its_tasks_did_not_sweep_or_lost_a_task_on(
    monkeypatch: pytest.MonkeyPatch, swept: set[str], dirty: set[str], expected: list[str]
) -> None:
    from rollcage.controller import RayBackendConfig
    from rollcage.controller import _ray as module
    from rollcage.controller._unit import RolloutSettings

    fake = _FakeRemote()
    nodes = [{"NodeID": _node(n), "Alive": True} for n in "abc"] + [{"NodeID": _node("d"), "Alive": False}]
    monkeypatch.setattr(module, "_sweep_remote", fake)
    monkeypatch.setattr(module._ray, "nodes", lambda: json.loads(json.dumps(nodes)))
    backend = module.RayBackend(RayBackendConfig(), RolloutSettings())

    async def released() -> None:
        pass

    monkeypatch.setattr(backend, "_release", released)
    backend._state = "opened"
    backend._swept_nodes, backend._dirty_nodes = {_node(n) for n in swept}, {_node(n) for n in dirty}
    await backend.__aexit__(None, None, None)
    assert sorted(fake.nodes) == expected


async def test_a_cancelled_run_sweeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from rollcage.controller import RayBackendConfig
    from rollcage.controller import _ray as module
    from rollcage.controller._unit import RolloutSettings

    fake = _FakeRemote()
    monkeypatch.setattr(module, "_sweep_remote", fake)
    monkeypatch.setattr(module._ray, "nodes", lambda: [{"NodeID": _node("a"), "Alive": True}])
    backend = module.RayBackend(RayBackendConfig(), RolloutSettings())

    async def released() -> None:
        pass

    monkeypatch.setattr(backend, "_release", released)
    backend._state = "opened"
    await backend.__aexit__(asyncio.CancelledError, asyncio.CancelledError(), None)
    assert fake.nodes == []


def test_a_node_task_process_imports_no_dataset_reader() -> None:
    """Every Ray worker process that runs a rollout imports ``rollcage.controller._ray`` (its task's
    module); the dataset readers (and their formats) are the driver's alone."""
    code = (
        "import sys, rollcage.controller._ray; "
        "print(sorted(m for m in sys.modules if m.endswith(('._dataset', '._formats'))))"
    )
    done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "[]"
