"""Start-up pacing: rollouts take turns to start up, and hand the turn on once their worker runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollcage.protocol import SupervisorReceipt
from rollcage.supervisor import core as supervisor_core
from rollcage.supervisor import supervise
from tests.helpers.supervisor_env import config, fake, make_rollout
from tests.helpers.supervisor_upstream import Upstream
from tests.helpers.waiting import wait_for_async

SLOTS = 2


@pytest.fixture
def two_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two start-up slots, held until the worker's first request or exit (never the time cap here)."""
    gate = asyncio.Semaphore(SLOTS)
    monkeypatch.setattr(supervisor_core, "start_gate", lambda: gate)
    monkeypatch.setattr(supervisor_core, "START_HOLD_S", 300.0)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


async def _run_all(roots: list[Path], mode: str, stop: asyncio.Event) -> list[SupervisorReceipt]:
    cfg = config("none", *fake(mode), deadline_s=120, grace_s=1)
    return list(await asyncio.gather(*(supervise(root, cfg, stop=stop) for root in roots)))


@pytest.mark.usefixtures("two_slots")
@pytest.mark.timeout(120)
async def test_no_more_rollouts_start_up_at_once_than_there_are_slots(tmp_path: Path) -> None:
    roots = [make_rollout(tmp_path, f"r{i}") for i in range(SLOTS + 1)]
    stop = asyncio.Event()
    running = asyncio.ensure_future(_run_all(roots, "hang", stop))

    def started() -> list[Path]:
        return [root for root in roots if (root / "workspace" / "started").exists()]

    await wait_for_async(lambda: len(started()) >= SLOTS, within_s=60, what="two rollouts started")
    stop.set()
    receipts = await running
    assert all(r.outcome == "cancelled" for r in receipts)
    # Exactly one never had a worker to signal: its turn never came while the others were starting up.
    never = [root for root, r in zip(roots, receipts, strict=True) if not r.signals_sent]
    assert len(never) == 1 and never[0] not in started() and len(started()) == SLOTS


@pytest.mark.usefixtures("two_slots")
@pytest.mark.timeout(120)
async def test_a_rollout_hands_its_turn_on_once_its_worker_calls_out(
    tmp_path: Path, upstream: Upstream
) -> None:
    # Each worker's model call hangs upstream, so it never exits: only its first request can free the slot.
    roots = [
        make_rollout(tmp_path, f"r{i}", model_url=f"{upstream.base_url}/hang/v1") for i in range(SLOTS + 2)
    ]
    stop = asyncio.Event()
    running = asyncio.ensure_future(_run_all(roots, "hang-model", stop))
    await wait_for_async(
        lambda: upstream.hanging == len(roots), within_s=90, what="every worker's request upstream"
    )
    stop.set()
    receipts = await running
    assert all(r.outcome == "cancelled" and r.model_calls_captured == 1 for r in receipts)
