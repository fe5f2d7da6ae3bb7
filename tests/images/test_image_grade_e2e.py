"""End to end: image rollouts through the controller, graded by their tests in a fresh root, with their diff.

Needs i1's image rollouts (``sandbox.image``, ``tests/helpers/task_images.py``): until those are
merged this module is skipped as a whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tests.helpers.task_images", reason="image rollouts (sandbox.image) are not merged yet")

from rollcage.supervisor.config import BwrapSandbox
from tests.helpers.task_images import TaskImage
from tests.images.test_image_rollouts import _run, python_image, store  # noqa: F401

# The task's test runner, left by the agent in the image's working directory: JUnit as pytest names it.
RUNNER = (
    "import pathlib\n"
    "ok = pathlib.Path('fixed.txt').exists()\n"
    'case = \'<testcase classname="tests.test_t" name="test_fix"\'\n'
    "case += '/>' if ok else '><failure/></testcase>'\n"
    "pathlib.Path('/tmp/junit.xml').write_text('<testsuite>' + case + '</testsuite>')\n"
)
WRITE_RUNNER = "cat > /work/run_tests.py <<'EOF'\n" + RUNNER + "EOF\n"


def _bash(command: str) -> dict[str, object]:
    return {"tool_calls": [{"name": "bash", "arguments": {"command": command}}]}


def test_image_rollouts_are_graded_by_their_tests_and_keep_their_diff(
    tmp_path: Path,
    store: Path,  # noqa: F811
    python_image: TaskImage,  # noqa: F811
) -> None:
    grader = {
        "type": "tests",
        "command": "python3 /work/run_tests.py",
        "junit_xml": "/tmp/junit.xml",
        "fail_to_pass": ["tests/test_t.py::test_fix"],
    }
    image = {"image": python_image.ref}
    rows = [
        {"id": "fix", "input": "fix", "tools": ["bash"], "sandbox": image, "grader": grader},
        {"id": "nofix", "input": "no", "tools": ["bash"], "sandbox": image, "grader": grader},
    ]
    script = {
        "tasks": {
            "fix": [_bash(WRITE_RUNNER + "echo yes > fixed.txt; rm marker.txt"), {"text": "done"}],
            "nofix": [_bash(WRITE_RUNNER), {"text": "done"}],
        }
    }
    records, _ = _run(tmp_path / "run", rows, script, bwrap=BwrapSandbox(worker_start="cold"))
    by_task = {record.task_id: record for record in records}
    assert by_task["fix"].reward == 1.0, by_task["fix"].grader
    assert by_task["nofix"].reward == 0.0, by_task["nofix"].grader
    assert (by_task["nofix"].grader or {})["failed"] == ["tests/test_t.py::test_fix"]
    diff = (Path(by_task["fix"].rollout_dir) / "workspace.diff").read_text()
    assert "+++ b/work/fixed.txt\n@@ -0,0 +1 @@\n+yes\n" in diff
    assert "diff --git a/work/marker.txt b/work/marker.txt\ndeleted file mode 100644" in diff
