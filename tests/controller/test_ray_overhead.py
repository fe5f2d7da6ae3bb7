"""What a run on Ray costs beyond its rollouts: the processes it starts, what they import (issue 41).

No cluster: the stop flag's class is unpickled in a bare interpreter, and the end-of-run sweep
is driven with Ray's node listing and task submission replaced by fakes.
"""

from __future__ import annotations

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
