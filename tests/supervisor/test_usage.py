"""Each rollout's CPU time and peak memory: counted by its cgroup, in the receipt and in metrics.json."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rollcage.budgets import detect_cgroups
from rollcage.supervisor import supervise
from tests.helpers.supervisor_env import HELPERS, config, make_rollout, requires_bwrap

BURN_S = 0.4


@pytest.mark.bwrap
@requires_bwrap()
async def test_the_receipt_counts_cpu_time_that_the_sandbox_reaped_itself(tmp_path: Path) -> None:
    if detect_cgroups().cpu is None:
        pytest.skip("no cgroup here can count CPU time (v2 cpu.stat or a writable v1 cpuacct)")
    root = make_rollout(tmp_path)
    burn = [sys.executable, str(HELPERS / "burn_worker.py"), str(BURN_S)]
    receipt = await supervise(root, config("bwrap", *burn, deadline_s=120))
    assert receipt.outcome == "completed", receipt.outcome_reason
    usage = receipt.usage
    assert usage is not None and usage.cpu_mechanism in ("cgroup2", "cgroup1")
    # The daemon's CPU (reaped inside the sandbox, where RUSAGE_CHILDREN never sees it) is counted.
    assert usage.cpu_s is not None and usage.cpu_s >= BURN_S
    assert usage.memory_mechanism in ("cgroup2", "cgroup1", "none")
    if usage.memory_mechanism != "none":
        assert usage.peak_memory_bytes is not None and usage.peak_memory_bytes > 1 << 20
