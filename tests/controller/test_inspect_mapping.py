"""How an Inspect sample becomes a rollcage row: its solver's prompt, its tools, its scorer, and what is
said up front when it cannot run as Inspect would (Inspect's own behaviour: test_inspect_parity.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rollcage.controller import iter_dataset
from rollcage.controller._dataset import InvalidRow, Task
from rollcage.controller._formats import ASSUMED_SCORER
from rollcage.controller._graders import ChoiceGrader


def rows_of(tmp_path: Path, rows: list[Any], **options: Any) -> list[Task | InvalidRow]:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return list(iter_dataset(path, **options))


def test_multiple_choice_samples_pick_the_template_and_scorer_from_the_target(tmp_path: Path) -> None:
    base = {"input": "Pick", "choices": ["a", "b", "c"]}
    single, several, letters, beyond, zero, untargeted = rows_of(
        tmp_path,
        [
            {**base, "id": 1, "target": "B"},
            {**base, "id": 2, "target": ["A", "C"]},
            {**base, "id": 3, "target": "A, C"},
            {**base, "id": 4, "target": "D"},
            {**base, "id": 5, "target": "0"},
            {**base, "id": 6},
        ],
        format="inspect",
    )
    assert isinstance(single, Task) and single.grader == ChoiceGrader(choices=3)
    assert "one of A,B,C" in str(single.row.input) and "multiple answers" not in str(single.row.input)
    for multi in (several, letters):
        assert isinstance(multi, Task) and multi.grader == ChoiceGrader(choices=3, multiple_correct=True)
        assert "where multiple answers may be correct" in str(multi.row.input)
    # A target naming no option is refused with its line, before anything runs (Inspect raises as it scores).
    assert isinstance(beyond, InvalidRow) and beyond.line == 4 and "beyond the 3 choices: D" in beyond.reason
    assert isinstance(zero, InvalidRow) and "numeric choices start at 1" in zero.reason
    assert isinstance(untargeted, Task) and untargeted.grader is None and untargeted.tools == ()


def test_only_plain_samples_lose_the_python_tool_and_others_carry_a_notice(tmp_path: Path) -> None:
    plain, local, imaged = rows_of(
        tmp_path,
        [
            {"id": "p", "input": "x", "target": "y"},
            {"id": "l", "input": "x", "target": "y", "sandbox": "local"},
            {
                "id": "i",
                "input": "x",
                "target": "y",
                "sandbox": {"type": "docker", "config": {"image": "python:3"}},
            },
        ],
        format="inspect",
    )
    for task in (plain, local):
        assert isinstance(task, Task) and task.tools == () and task.notices == (ASSUMED_SCORER,)
    assert isinstance(imaged, Task) and [t.name for t in imaged.tools] == ["python"]
    assumed, left_out = imaged.notices
    assert assumed == ASSUMED_SCORER and left_out.startswith("Not reproduced: ") and "sandbox" in left_out
    (served,) = rows_of(
        tmp_path, [{"id": "e", "input": "x", "target": "y"}], format="inspect", environment="calc-weather"
    )
    assert isinstance(served, Task) and served.grader is not None and served.grader.type == "verify"
    (left_out,) = served.notices  # graded by the environment: no scorer is assumed
    assert left_out.startswith("Not reproduced: ") and "--environment" in left_out


@pytest.mark.parametrize(
    ("grader", "expected", "reason"),
    [
        ({"type": "match"}, None, "grader 'match' needs 'expected'"),
        ({"type": "includes"}, None, "grader 'includes' needs 'expected'"),
        ({"type": "choice", "choices": 2}, "C", "beyond the 2 choices: C"),
        ({"type": "choice", "choices": 2}, 1, "grader 'choice' needs 'expected'"),
        ({"type": "choice"}, "A", "choices"),
        ({"type": "match", "location": "middle"}, "A", "location"),
    ],
)
def test_rollcage_rows_may_name_inspects_scorers_and_are_refused_when_they_cannot(
    tmp_path: Path, grader: dict[str, Any], expected: Any, reason: str
) -> None:
    row = {"id": "r", "input": "x", "tools": [], "grader": grader, "expected": expected}
    (item,) = rows_of(tmp_path, [row])
    assert isinstance(item, InvalidRow) and reason in item.reason, item


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
@pytest.mark.timeout(300)
def test_a_run_says_up_front_what_it_does_not_reproduce_naming_the_first_row(tmp_path: Path) -> None:
    samples = [
        {"id": "plain", "input": "x", "target": "y"},
        {"id": "sunny", "input": "Weather in Oslo?", "target": "cold"},
        {"id": "rainy", "input": "Weather in Bergen?", "target": "wet"},
    ]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(s) + "\n" for s in samples))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollcage", "run", str(dataset), "--format", "inspect"),
            *("--environment", "calc-weather", "--quiet", "--out", str(tmp_path / "out")),
            *("--sandbox", os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    notices = [line for line in done.stdout.splitlines() if line.startswith(("Not reproduced:", "Assumed:"))]
    assert len(notices) == 1, done.stdout + done.stderr
    assert "--environment" in notices[0] and "(3 row(s), first line 1, id plain)" in notices[0]
    assert notices[0].startswith("Not reproduced: ")


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (CI installs it)")
@pytest.mark.timeout(300)
def test_a_run_says_which_solver_and_scorer_it_assumed(tmp_path: Path) -> None:
    samples = [
        {"id": "untargeted", "input": "x"},
        {"id": "plain", "input": "x", "target": "y"},
        {"id": "mc", "input": "x", "choices": ["a", "b"], "target": "B"},
    ]
    dataset = tmp_path / "d.jsonl"
    dataset.write_text("".join(json.dumps(s) + "\n" for s in samples))
    done = subprocess.run(
        [
            *(sys.executable, "-m", "rollcage", "run", str(dataset), "--format", "inspect"),
            *("--quiet", "--out", str(tmp_path / "out")),
            *("--sandbox", os.environ.get("ROLLCAGE_TEST_SANDBOX", "bwrap")),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        cwd=tmp_path,
    )
    lines = done.stdout.splitlines()
    assert f"{ASSUMED_SCORER} (2 row(s), first line 2, id plain)" in lines, done.stdout + done.stderr
    assert not any(line.startswith("Not reproduced:") for line in lines), done.stdout
