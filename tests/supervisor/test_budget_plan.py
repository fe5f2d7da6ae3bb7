"""Weak budgets are said before a run starts, and refused when budgets are required.

A budget that is only a per-process rlimit or a poll lets a rollout pass it (four
processes under a 1 GiB rlimit held 1.6 GiB; a poll sees 64 MiB written into a
16 MiB workspace after the fact). The run names each such budget in one warning
when it starts, and ``require_budgets`` refuses to run at all. The non-root path's
own runs of these are in ``test_unprivileged.py``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rollcage.budgets import RolloutBudgets, check_budgets, planned_mechanisms
from rollcage.budgets import _plan as budgetplan
from rollcage.budgets._mechanisms import _v2_candidates
from rollcage.errors import SandboxError
from rollcage.supervisor import BwrapSandbox, SupervisorConfig, supervise
from tests.helpers.supervisor_env import make_rollout, requires_bwrap


def test_a_user_in_a_delegated_leaf_makes_its_cages_in_the_ancestors_it_owns(tmp_path: Path) -> None:
    # systemd: user.slice (root's) / user@U.service (U's) / app.slice (U's) / run-x.scope (U's, holds us).
    if os.geteuid() != 0:
        pytest.skip("optional: a tree owned by someone else needs root to make")
    owner = 54321
    top = tmp_path / "cgroup"
    service = top / "user.slice" / "user@U.service"
    leaf = service / "app.slice" / "run-x.scope"
    leaf.mkdir(parents=True)
    for directory in (service, service / "app.slice", leaf):
        (directory / "cgroup.procs").touch()
        os.chown(directory, owner, owner)
        os.chown(directory / "cgroup.procs", owner, owner)
    (top / "user.slice" / "cgroup.procs").touch()

    assert list(_v2_candidates(leaf, top, euid=owner)) == [leaf, service / "app.slice", service]
    # Root never walks up: every ancestor is writable to it, none is its to use.
    assert list(_v2_candidates(leaf, top, euid=0)) == [leaf]
    # Someone else's leaf: only itself (and it is not writable to them).
    assert list(_v2_candidates(leaf, top, euid=owner + 1)) == [leaf]


def test_polled_disk_budgets_are_named_once_when_not_required(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgetplan, "_warned", set())  # nothing said yet in this process
    config = BwrapSandbox(disk_budgets="poll", budget_poll_s=0.25)
    with caplog.at_level(logging.WARNING, logger="rollcage.supervisor"):
        weak = check_budgets(config)
        again = check_budgets(config)
    disk = {"workspace_bytes", "workspace_inodes", "tmp_inodes", "shm_inodes"}
    assert weak == again and disk <= {phrase.split(" (")[0] for phrase in weak}, weak
    warnings = [r.getMessage() for r in caplog.records if "WEAK BUDGETS" in r.getMessage()]
    assert len(warnings) == 1, warnings  # once per process, however many rollouts check
    for phrase in weak:
        if phrase.split(" (")[0] in disk:
            assert "polled every 0.25 s (--disk-budgets poll)" in phrase, phrase


def test_require_budgets_refuses_each_weak_budget_by_name() -> None:
    config = BwrapSandbox(disk_budgets="poll", cgroups="off", require_budgets=True)
    with pytest.raises(SandboxError) as refused:
        check_budgets(config)
    message = str(refused.value)
    assert message.startswith("--require-budgets: ")
    for budget in ("memory_bytes", "processes", "workspace_bytes", "workspace_inodes", "tmp_inodes"):
        assert f"{budget} (" in message, (budget, message)
    assert "tmp_bytes (" not in message, message  # bubblewrap's --size bounds it: a hard bound
    assert "--cgroups off" in message and "--disk-budgets poll" in message, message
    # A budget not asked for is not weak.
    unbounded = BwrapSandbox(disk_budgets="poll", cgroups="off", memory_bytes=None, max_processes=None)
    assert "memory_bytes" not in planned_mechanisms(unbounded)


@requires_bwrap()
@pytest.mark.bwrap
async def test_supervise_with_budgets_required_refuses_before_writing_anything(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    sandbox = BwrapSandbox(disk_budgets="poll", require_budgets=True)
    with pytest.raises(SandboxError, match="workspace_bytes"):
        await supervise(root, SupervisorConfig(deadline_s=30, sandbox=sandbox))
    assert sorted(p.name for p in root.iterdir()) == ["input.json", "workspace"]


@requires_bwrap()
@pytest.mark.bwrap
async def test_a_rollout_whose_budgets_come_out_weak_is_refused_as_infrastructure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Planned as hard bounds (root: tmpfs), made as a poll (the mounts refused at run time).
    if os.geteuid() != 0:
        pytest.skip("optional: without root the disk budgets are refused before the rollout")
    monkeypatch.setattr(RolloutBudgets, "_can_mount", lambda self: False)
    root = make_rollout(tmp_path)
    sandbox = BwrapSandbox(require_budgets=True, worker_start="cold")
    receipt = await supervise(root, SupervisorConfig(deadline_s=30, sandbox=sandbox))
    assert receipt.outcome == "infra_failure", receipt.outcome_reason
    assert "--require-budgets" in receipt.outcome_reason and "workspace_bytes" in receipt.outcome_reason
    assert receipt.cleanup_confirmed
