"""Graders run off the controller's event loop, bounded per grade: one grade never stalls another rollout."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from rollcage.controller import Controller, LocalBackend, ModelEndpointConfig, RegexGrader, RunConfig
from rollcage.controller._graders import grade_builtin_off_loop
from rollcage.controller.testing import FakeSupervisor
from rollcage.protocol import RolloutRecord, SupervisorReceipt

# Catastrophic backtracking for the regex engine we use (the issue's '(a+)+$' it solves at once).
EVIL = r"(a|aa)+$"
EVIL_TEXT = "a" * 60 + "!"


async def test_a_runaway_regex_ends_in_a_grader_error_at_its_timeout() -> None:
    grade = await grade_builtin_off_loop(
        RegexGrader(pattern=EVIL, timeout_s=0.5), expected=None, answer=EVIL_TEXT, timeout_s=60
    )
    assert grade.reward is None and grade.error is not None and "timed out" in grade.error
    issue = await grade_builtin_off_loop(
        RegexGrader(pattern=r"(a+)+$"), expected=None, answer="a" * 26 + "!", timeout_s=60
    )
    assert issue.reward == 0.0


async def test_a_victim_rollout_finishes_while_a_runaway_grade_runs(tmp_path: Path) -> None:
    """The grade of 'evil' takes its whole regex timeout; 'victim' needs the loop meanwhile, and gets it."""
    dataset = tmp_path / "d.jsonl"
    rows = [
        {"id": "evil", "input": "x", "grader": {"type": "regex", "pattern": EVIL, "timeout_s": 5}},
        {"id": "victim", "input": "y", "expected": "ok"},
    ]
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fake = FakeSupervisor({"evil": EVIL_TEXT, "victim": "ok"})
    evil_supervised = asyncio.Event()

    async def supervise(
        rollout_dir: Path, config: Any, *, stop: asyncio.Event | None = None
    ) -> SupervisorReceipt:
        if rollout_dir.name.startswith("victim"):
            await evil_supervised.wait()  # start once the evil rollout is being graded...
            for _ in range(20):  # ...and need the loop for a while: every step yields to it
                await asyncio.sleep(0.01)
            return await fake(rollout_dir, config, stop=stop)
        receipt = await fake(rollout_dir, config, stop=stop)
        evil_supervised.set()
        return receipt

    cfg = RunConfig(
        dataset=dataset,
        out=tmp_path / "out",
        model=ModelEndpointConfig(base_url="http://127.0.0.1:9/v1", model_name="fake"),
        sandbox="none",
        concurrency=2,
    )
    await Controller(cfg, backend=LocalBackend(cfg.rollout_settings(), supervise=supervise)).run()
    records = [
        RolloutRecord.model_validate_json(x) for x in (cfg.out / "rollouts.jsonl").read_bytes().splitlines()
    ]
    # The victim's record was appended first: its rollout ran while the evil grade was still running.
    assert [r.task_id for r in records] == ["victim", "evil"]
    assert records[0].reward == 1.0
    # Its own regex timeout (5 s) ends it, or on a machine too busy to run it in time, the grade's bound.
    assert records[1].reward is None and "timed out after" in (records[1].grader or {})["error"]
