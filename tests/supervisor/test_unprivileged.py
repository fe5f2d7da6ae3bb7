"""The non-root path, run for real: the sandbox and budget suites as an unprivileged user, and weak budgets.

``make test`` runs as root, where the supervisor takes its root path. Here the
tests make an unprivileged user (:mod:`tests.helpers.unprivileged`) and run, as
that user:

* the escape, sandbox, ``/dev`` and usage suites in a pytest session of their own,
  with a cgroup subtree delegated to the user as systemd delegates a user's
  session: every probe must be blocked and every budget must hold, or be one the
  run refuses up front when budgets are required;
* ``rollcage run`` and ``rollcage supervise`` with and without that delegation:
  a budget that is no hard bound is named in one line when the run starts, and
  ``--require-budgets`` refuses to run (exit 2) naming each.

Not root: the suite already runs unprivileged, and these skip, saying so. Cost
under ``make test``: one nested session of about 30 s on two cores, and four
short runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.supervisor_env import make_rollout, requires_bwrap
from tests.helpers.unprivileged import (
    UnprivilegedUser,
    can_delegate,
    chown_tree,
    delegated_cgroups,
    make_test_user,
    run_as,
    user_dir,
)

pytestmark = [pytest.mark.bwrap, requires_bwrap(), pytest.mark.timeout(600)]

SUITES = [
    "tests/supervisor/test_escape.py",
    "tests/supervisor/test_sandbox.py",
    "tests/supervisor/test_cage_dev.py",
    "tests/supervisor/test_usage.py",
]
"""The suites that must also pass as an unprivileged user: escapes, containment, budgets."""

MEMORY_AND_PROCESSES = ("memory_bytes (", "processes (")
DISK = ("workspace_bytes (", "workspace_inodes (", "tmp_inodes (", "shm_inodes (")
"""How a refusal or the warning names each weak budget without root (``/tmp`` and ``/dev/shm`` bytes
are bounded by bubblewrap's tmpfs; their inodes and the workspace are polled)."""


@pytest.fixture(scope="module")
def user() -> UnprivilegedUser:
    return make_test_user()


@pytest.fixture
def home(user: UnprivilegedUser) -> Iterator[Path]:
    with user_dir(user) as directory:
        yield directory


def _passed_on() -> dict[str, str]:
    names = ("ROLLCAGE_TEST_NO_SKIPS", "ROLLCAGE_REQUIRE_BWRAP")
    return {name: os.environ[name] for name in names if name in os.environ}


def test_the_sandbox_and_budget_suites_pass_as_an_unprivileged_user(
    user: UnprivilegedUser, home: Path
) -> None:
    argv = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider"]
    argv += ["--basetemp", str(home / "pytest"), *SUITES]
    # Without cgroups to delegate the suites still run: memory and processes are then rlimits, which the
    # budget probes check are refused under require_budgets.
    delegation = delegated_cgroups(user) if can_delegate() else contextlib.nullcontext([])
    with delegation as cgroups:
        done = run_as(user, argv, home=home, cgroups=cgroups, env=_passed_on(), timeout_s=540)
    assert done.returncode == 0, f"as {user.name} (uid {user.uid}):\n{done.stdout[-12000:]}"


def _dataset(home: Path, user: UnprivilegedUser) -> Path:
    data = home / "data"
    data.mkdir()
    (data / "dataset.jsonl").write_text(json.dumps({"id": "t", "input": "hi", "expected": "hello"}) + "\n")
    (data / "policy.yaml").write_text("tasks:\n  t:\n    - text: hello\n")
    chown_tree(data, user)
    return data / "dataset.jsonl"


def _rollcage(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollcage", *args]


def _warning(output: str) -> str:
    """The weak budgets' warning, whitespace folded (the console wraps it), and how often it was given."""
    text = " ".join(output.split())
    count = text.count("WEAK BUDGETS")
    assert count == 1, f"the warning was given {count} times:\n{output[-6000:]}"
    start = text.index("WEAK BUDGETS")
    return text[start : text.index("refuses to run instead", start)]


def test_without_delegation_the_run_names_each_weak_budget_in_one_warning_at_its_start(
    user: UnprivilegedUser, home: Path
) -> None:
    dataset = _dataset(home, user)
    done = run_as(user, _rollcage("run", str(dataset), "--out", str(home / "out")), home=home)
    assert done.returncode == 0, done.stdout[-6000:]
    warned = _warning(done.stdout)
    for budget in (*MEMORY_AND_PROCESSES, *DISK):
        assert budget in warned, (budget, warned)
    assert "tmp_bytes (" not in warned and "shm_bytes (" not in warned, warned
    assert "--require-budgets" in warned, warned
    # At the start: before the rollout's result is reported.
    folded = " ".join(done.stdout.split())
    assert folded.index("WEAK BUDGETS") < folded.index("completed"), done.stdout[-6000:]


def test_without_delegation_require_budgets_refuses_before_anything_runs(
    user: UnprivilegedUser, home: Path
) -> None:
    dataset = _dataset(home, user)
    out = home / "out"
    done = run_as(user, _rollcage("run", str(dataset), "--out", str(out), "--require-budgets"), home=home)
    assert done.returncode == 2, done.stdout[-6000:]
    assert "--require-budgets" in done.stdout, done.stdout
    for budget in (*MEMORY_AND_PROCESSES, *DISK):
        assert budget in done.stdout, (budget, done.stdout)
    assert not (out / "rollouts.jsonl").exists() and not (out / "rollouts").exists()


def test_with_delegated_cgroups_memory_and_processes_are_hard_bounds(
    user: UnprivilegedUser, home: Path
) -> None:
    # The delegated subtree makes memory and processes cgroup bounds: only the polled disk budgets are
    # left for --require-budgets to refuse, for `run` and `supervise` alike.
    dataset = _dataset(home, user)
    rollout = make_rollout(home, "r1")
    chown_tree(rollout, user)
    with delegated_cgroups(user) as cgroups:
        run = run_as(
            user,
            _rollcage("run", str(dataset), "--out", str(home / "out"), "--require-budgets"),
            home=home,
            cgroups=cgroups,
        )
        supervised = run_as(
            user, _rollcage("supervise", str(rollout), "--require-budgets"), home=home, cgroups=cgroups
        )
    for done in (run, supervised):
        assert done.returncode == 2, done.stdout[-6000:]
        for budget in DISK:
            assert budget in done.stdout, (budget, done.stdout)
        for budget in MEMORY_AND_PROCESSES:
            assert budget not in done.stdout, (budget, done.stdout)
    assert not (rollout / "receipt.json").exists(), "refused, yet the rollout was run"
