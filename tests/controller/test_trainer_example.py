"""examples/trainer_loop.py runs: batches of token ids, logprobs and advantages; infra failures out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import EXAMPLES

EXAMPLE = EXAMPLES / "trainer_loop.py"
SANDBOX = os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")

pytestmark = [
    pytest.mark.bwrap,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)"),
    pytest.mark.timeout(600),
]


def test_the_grpo_loop_gets_trainable_batches_from_collect(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE),
            "--steps",
            "2",
            "--k",
            "3",
            "--sandbox",
            SANDBOX,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps: list[dict[str, Any]] = json.loads(done.stdout)["steps"]
    assert [step["step"] for step in steps] == [0, 1]
    for step in steps:
        # 3 tasks x k=3 samples, each answered in two model calls; every call's tokens complete and aligned.
        assert step["samples"] == 3 * 3 * 2 and step["aligned"] and step["completion_tokens"] > 0
        # One sample per task answered wrongly: rewards differ within each group, so advantages are not zero
        # and sum to zero per group.
        assert all(sorted(rewards) == [0.0, 1.0, 1.0] for rewards in step["rewards"].values())
        assert all(abs(total) < 1e-9 for total in step["group_advantage_sums"].values())
        assert step["loss"] != 0.0
    # The injected HTTP 503 made one attempt an infrastructure failure: retried, and kept out of the batch.
    assert steps[0]["filtered"] == {"infra_failure": 1}
    first = tmp_path / "step-0" / "rollouts.jsonl"
    assert sum('"outcome":"infra_failure"' in line for line in first.read_text().splitlines()) == 1


def test_the_tree_variant_trains_on_the_branches_live_calls_only(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "1", "--k", "3", "--tree", "--sandbox", SANDBOX],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (step,) = json.loads(done.stdout)["steps"]
    # 3 tasks x k=3 branches from the trunk's last turn: one live model call each; the replayed first
    # call (the shared prefix) is not in the batch.
    assert step["samples"] == 3 * 3 * 1 and step["aligned"]
    assert all(sorted(rewards) == [0.0, 1.0, 1.0] for rewards in step["rewards"].values())
    assert all(abs(total) < 1e-9 for total in step["group_advantage_sums"].values())
    assert step["filtered"] == {"infra_failure": 1}
    trees = sorted((tmp_path / "runs" / "trainer-loop" / "step-0").glob("branches-*/tree.json"))
    assert len(trees) == 3
