"""The ``tests`` grader: the task's command in a fresh root made from the image and the rollout's changes."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import (
    Controller,
    InvalidRow,
    LocalBackend,
    ModelEndpointConfig,
    RunConfig,
    iter_dataset,
)
from rollcage.controller._graders import TestsGrader as Spec
from rollcage.controller._image_grade import grade_tests
from rollcage.controller.testing import FakeSupervisor
from rollcage.protocol import RolloutRecord
from tests.helpers.image_rollouts import agent_session, make_image, needs_root, write_image_json
from tests.helpers.waiting import wait_for, wait_for_async

pytestmark = needs_root

# The image's test runner: JUnit as pytest writes it; test_fixed passes once the agent fixed
# fix.txt, test_kept always passes, test_broken never does.
RUNNER = r"""#!/bin/sh
if [ "$(cat fix.txt)" = fixed ]; then fixed='/>'; else fixed='><failure message="not fixed"/></testcase>'; fi
cat > "$1" <<EOF
<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_task" name="test_fixed"$fixed
<testcase classname="tests.test_task.TestKept" name="test_kept[a::b]"/>
<testcase classname="tests.test_task" name="test_broken"><failure message="always"/></testcase>
</testsuite></testsuites>
EOF
"""
FILES = {"fix.txt": "broken\n", "run_tests.sh": RUNNER}
FIX = "echo fixed > fix.txt"


def _grade(spec: Spec, rollout_dir: Path, scratch: Path | None = None) -> Any:
    return asyncio.run(grade_tests(spec, rollout_dir, scratch_parent=scratch))


def test_the_exit_status_gives_the_reward(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    spec = Spec(command='test "$(cat fix.txt)" = fixed && test "$TASK_ENV" = from-the-image')
    with agent_session(image, tmp_path / "fixed", FIX):
        pass
    with agent_session(image, tmp_path / "unfixed", "echo still broken > fix.txt"):
        pass
    fixed, unfixed = _grade(spec, tmp_path / "fixed"), _grade(spec, tmp_path / "unfixed")
    assert (fixed.reward, fixed.error, fixed.detail["exit_code"]) == (1.0, None, 0)
    assert (unfixed.reward, unfixed.error, unfixed.detail["exit_code"]) == (0.0, None, 1)


def test_fail_to_pass_and_pass_to_pass_come_from_the_junit_xml(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", FIX):
        pass
    command = "sh run_tests.sh /tmp/junit.xml; exit 1"  # a failing test in the suite: exit 1, as pytest's
    passing = Spec(
        command=command,
        junit_xml="/tmp/junit.xml",
        fail_to_pass=["tests/test_task.py::test_fixed"],
        pass_to_pass=["tests/test_task.py::TestKept::test_kept[a::b]"],
    )
    grade = _grade(passing, tmp_path / "r")
    assert grade.reward == 1.0 and grade.error is None
    assert grade.detail["failed"] == [] and grade.detail["missing"] == []
    one_failing_one_missing = passing.model_copy(
        update={"pass_to_pass": ["tests/test_task.py::test_broken", "tests/test_task.py::test_never_run"]}
    )
    grade = _grade(one_failing_one_missing, tmp_path / "r")
    assert grade.reward == 0.0 and grade.error is None
    assert grade.detail["failed"] == ["tests/test_task.py::test_broken"]
    assert grade.detail["missing"] == ["tests/test_task.py::test_never_run"]


def test_an_unfixed_fail_to_pass_test_fails_the_grade(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", "echo still broken > fix.txt"):
        pass
    spec = Spec(
        command="sh run_tests.sh /tmp/junit.xml",
        junit_xml="/tmp/junit.xml",
        fail_to_pass=["tests/test_task.py::test_fixed"],
    )
    grade = _grade(spec, tmp_path / "r")
    assert grade.reward == 0.0 and grade.detail["failed"] == ["tests/test_task.py::test_fixed"]


BOMB = (
    '<?xml version="1.0"?><!DOCTYPE t [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
    '<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;"><!ENTITY d "&c;&c;&c;&c;&c;&c;&c;&c;&c;&c;">]>'
    '<testsuite><testcase classname="tests.test_task" name="test_fixed">&d;&d;&d;&d;</testcase></testsuite>'
)


@pytest.mark.parametrize(
    ("agent", "why"),
    [
        (f"cat > /testbed/junit.xml <<'EOF'\n{BOMB}\nEOF", "document type"),
        ("head -c 40000000 /dev/zero | tr '\\0' ' ' > /testbed/junit.xml", "byte limit"),
        ("ln -s /etc/hostname /testbed/junit.xml", "link"),
        ("mkfifo /testbed/junit.xml", "not a regular file"),
        ("echo '<testsuite><testcase' > /testbed/junit.xml", "not well-formed"),
    ],
    ids=["entity-bomb", "huge", "symlink", "fifo", "malformed"],
)
def test_a_hostile_junit_file_is_a_grader_error(tmp_path: Path, agent: str, why: str) -> None:
    """The agent left a junit.xml the test command does not rewrite: it is read with suspicion."""
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", agent):
        pass
    spec = Spec(
        command="true", junit_xml="/testbed/junit.xml", fail_to_pass=["tests/test_task.py::test_fixed"]
    )
    grade = _grade(spec, tmp_path / "r")
    assert grade.reward is None and grade.error is not None and why in grade.error, grade


def test_grading_never_sees_the_agent_s_live_root(tmp_path: Path) -> None:
    """A process the agent left running writes on in its own root; the grading root is a copy out of reach."""
    image = make_image(tmp_path / "image", FILES)
    rollout = tmp_path / "r"
    linger = "while :; do echo tick >> /testbed/log; done"
    with agent_session(image, rollout, "echo start > log", linger=linger):
        changes_log = rollout / "changes/testbed/log"
        wait_for(lambda: changes_log.stat().st_size > 100, what="the lingering process to write")
        # The log must not grow under the test command, and what the command writes stays in its root.
        spec = Spec(
            command='a=$(wc -c < log); sleep 1; b=$(wc -c < log); echo "$a $b"; '
            'echo graded > /tmp/marker; test "$a" = "$b"'
        )
        grade = _grade(spec, rollout, tmp_path)
        assert grade.reward == 1.0, grade
        assert not (rollout / "changes/tmp/marker").exists()
        assert changes_log.stat().st_size > 0
    assert f" {tmp_path}/" not in Path("/proc/self/mounts").read_text()  # the grading root is gone
    assert not [path for path in tmp_path.iterdir() if path.name.startswith("rollcage-grade-")]


def test_a_grade_that_cannot_be_given_is_a_grader_error(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    spec = Spec(command="true")
    no_image = tmp_path / "no-image"
    no_image.mkdir()
    assert "no image.json" in (_grade(spec, no_image).error or "")
    no_changes = tmp_path / "no-changes"
    no_changes.mkdir()
    write_image_json(no_changes, image)
    assert "changes" in (_grade(spec, no_changes).error or "")
    gone = tmp_path / "gone"
    with agent_session(image, gone, FIX):
        pass
    info = json.loads((gone / "image.json").read_text())
    (gone / "image.json").write_text(json.dumps({**info, "root": str(tmp_path / "removed-from-the-store")}))
    grade = _grade(spec, gone)
    assert grade.reward is None and "is gone" in (grade.error or "")


def test_a_command_past_its_timeout_fails_the_tests(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", FIX):
        pass
    grade = _grade(Spec(command="sleep 600", timeout_s=1), tmp_path / "r")
    assert grade.reward == 0.0 and grade.detail["timed_out"] is True


@pytest.mark.parametrize(
    ("grader", "reason"),
    [
        ({"command": "pytest", "fail_to_pass": ["tests/test_x.py::test_a"]}, "need junit_xml"),
        ({"command": "pytest", "junit_xml": "junit.xml"}, "must be an absolute path"),
        ({"command": ""}, "command"),
        ({"command": "pytest", "timeout_s": 0}, "timeout_s"),
    ],
)
def test_a_row_with_an_unusable_tests_grader_is_refused_naming_why(
    tmp_path: Path, grader: dict[str, Any], reason: str
) -> None:
    dataset = tmp_path / "d.jsonl"
    dataset.write_text(
        json.dumps({"id": "x", "input": "fix it", "grader": {"type": "tests", **grader}}) + "\n"
    )
    (item,) = list(iter_dataset(dataset))
    assert isinstance(item, InvalidRow) and reason in item.reason, item


def test_the_controller_grades_an_image_rollout_and_keeps_its_diff(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES, git=True)
    dataset = tmp_path / "d.jsonl"
    grader = {
        "type": "tests",
        "command": "sh run_tests.sh /tmp/junit.xml",
        "junit_xml": "/tmp/junit.xml",
        "fail_to_pass": ["tests/test_task.py::test_fixed"],
    }
    dataset.write_text(json.dumps({"id": "task", "input": "fix it", "grader": grader}) + "\n")
    fake = FakeSupervisor({"task": "done"})

    async def supervise(rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None) -> Any:
        supervised = await fake(rollout_dir, config, stop=stop)
        # What i1's image rollouts leave: image.json and changes/ (here made by a real overlay).
        with agent_session(image, rollout_dir, FIX):
            pass
        return supervised

    cfg = RunConfig(
        dataset=dataset,
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        sandbox="none",
    )
    asyncio.run(Controller(cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=supervise)).run())
    (line,) = (cfg.out / "rollouts.jsonl").read_bytes().splitlines()
    record = RolloutRecord.model_validate_json(line)
    assert record.reward == 1.0 and record.grader is not None and record.grader["name"] == "tests"
    diff = (Path(record.rollout_dir) / "workspace.diff").read_text()
    assert "-broken\n+fixed\n" in diff and "diff --git a/fix.txt b/fix.txt" in diff
    assert os.listdir(Path(record.rollout_dir) / "changes")


def test_the_command_may_write_what_root_owns_in_the_image_and_the_image_stays_as_it_was(
    tmp_path: Path,
) -> None:
    """As a container's root may: a SWE-bench evaluation applies its test patch inside the repository."""
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", FIX):
        pass
    before = (image.root / "etc/hostname").read_bytes()
    spec = Spec(command="echo patched >> /etc/hostname && mkdir /testbed/.cache && rm run_tests.sh")
    grade = _grade(spec, tmp_path / "r")
    assert grade.reward == 1.0, grade
    assert (image.root / "etc/hostname").read_bytes() == before
    assert (image.root / "testbed/run_tests.sh").exists() and not (image.root / "testbed/.cache").exists()


def test_a_cancelled_grade_leaves_no_mount_and_no_scratch(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", FILES)
    with agent_session(image, tmp_path / "r", FIX):
        pass
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    started = tmp_path / "r/changes/testbed/started"

    async def cancel_while_running() -> None:
        spec = Spec(command="touch started; sleep 600")
        grading = asyncio.ensure_future(grade_tests(spec, tmp_path / "r", scratch_parent=scratch))
        # The command runs once its scratch is mounted and its shell answers in the fresh root.
        await wait_for_async(
            lambda: grading.done() or any(scratch.glob("rollcage-grade-*/scratch/upper/testbed/started")),
            what="the test command to start",
        )
        assert not grading.done(), grading.result()
        grading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await grading

    asyncio.run(cancel_while_running())
    assert f" {scratch}/" not in Path("/proc/self/mounts").read_text()
    assert list(scratch.iterdir()) == [] and not started.exists()


@pytest.mark.parametrize("user", ["1000", "app:app"])
def test_an_image_user_s_files_are_the_grading_command_s_and_root_s_are_not(
    tmp_path: Path, user: str
) -> None:
    image = make_image(tmp_path / "image", FILES)
    (image.root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n")
    os.chown(image.root / "testbed", 1000, 1000)
    with agent_session(image, tmp_path / "r", "true", user=user):
        pass
    mine = _grade(Spec(command="mkdir /testbed/.cache"), tmp_path / "r")
    roots = _grade(Spec(command="echo no >> /etc/hostname"), tmp_path / "r")
    assert (mine.reward, roots.reward) == (1.0, 0.0), (mine, roots)
