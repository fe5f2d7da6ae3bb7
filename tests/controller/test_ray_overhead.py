"""What a run on Ray costs beyond its rollouts: the processes it starts, what they import (issue 41).

No cluster: the stop flag's class is unpickled in a bare interpreter, and the end-of-run sweep
is driven with Ray's node listing and task submission replaced by fakes.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
