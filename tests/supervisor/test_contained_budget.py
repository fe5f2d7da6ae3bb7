"""Each grading cage has a process budget of its own: a fork bomb in one never starves another.

``RLIMIT_NPROC`` counts every process of a uid. A cage over an image's fresh root sets it before
its user namespace exists (the image has no ``prlimit``), so two such cages under one uid share it:
a bomb in one fills it and its neighbour cannot start. Each is bounded by its own pids cgroup where
one can be made, else by a uid of its own (the same test, with cgroups taken away). (The minimal
tree's cages set it inside their own user namespace, where only their own processes count.)
"""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest

from rollcage.budgets import CgroupSet
from rollcage.cage import RunLimits
from rollcage.controller._fresh_root import CAGE_UIDS, lease_uid
from rollcage.controller._graders import TestsGrader as Spec
from rollcage.controller._image_grade import grade_tests
from tests.helpers.image_rollouts import make_image, write_image_json
from tests.helpers.supervisor_env import requires_bwrap
from tests.helpers.waiting import processes_mentioning, wait_for_async

pytestmark = [
    pytest.mark.bwrap,
    requires_bwrap(),
    pytest.mark.skipif(os.geteuid() != 0, reason="cages run as uids of their own as root only"),
    pytest.mark.timeout(300),
]

LIMITS = RunLimits(max_processes=32)


def _bomb(seconds: str) -> list[str]:
    """Fill the cage's process budget, then hold it: a subshell forks until it cannot (a failed fork ends
    it), the shell then becomes a sleep itself. Each sleeps for a time no other process of the machine
    names: it counts the bomb's processes."""
    return ["/bin/sh", "-c", f"( while :; do sleep {seconds} & done ) 2>/dev/null; exec sleep {seconds}"]


@pytest.fixture(params=["cgroup", "no-cgroup"])
def cgroups(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "no-cgroup":
        monkeypatch.setattr("rollcage.cage._run_contained.CgroupSet.create", lambda *_, **__: CgroupSet())
    return str(request.param)


async def test_a_fork_bomb_in_one_tests_grade_leaves_its_neighbour_room(
    cgroups: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small budget, so the bomb fills it at once (the grader's own is 512 processes).
    monkeypatch.setattr("rollcage.controller._image_grade.GRADE_LIMITS", LIMITS)
    image = make_image(tmp_path / "image", {})
    rollouts = []
    for name in ("bomb", "neighbour"):
        (tmp_path / name / "changes").mkdir(parents=True)
        write_image_json(tmp_path / name, image)
        rollouts.append(tmp_path / name)
    seconds = f"{random.randint(500, 900)}.{random.randint(100000, 999999)}"
    bomb = asyncio.ensure_future(grade_tests(Spec(command=_bomb(seconds)[2], timeout_s=240), rollouts[0]))
    try:
        # The bomb has filled its budget, and holds it.
        await wait_for_async(
            lambda: bomb.done() or len(processes_mentioning(seconds)) >= 24,
            within_s=120,
            what="the bomb",
            interval=0.2,
        )
        assert not bomb.done(), bomb.result()
        command = "for i in 1 2 3 4 5 6 7 8; do sleep 0 & done; wait; echo room"
        grade = await grade_tests(Spec(command=command, timeout_s=120), rollouts[1])
        assert (grade.reward, grade.error) == (1.0, None), grade
        assert "room" in grade.detail["output_tail"]
    finally:
        bomb.cancel()
        with pytest.raises(asyncio.CancelledError):
            await bomb
    assert processes_mentioning(seconds) == []


def test_grading_uids_are_leased_one_holder_at_a_time(tmp_path: Path) -> None:
    with lease_uid(tmp_path) as first, lease_uid(tmp_path) as second:
        assert first != second and {first, second} <= set(CAGE_UIDS)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{first}.lease", f"{second}.lease"])
    assert list(tmp_path.iterdir()) == []  # released leases leave nothing behind
