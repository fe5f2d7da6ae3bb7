"""The upstream projects' own code, for conformance tests: side environments built by scripts/upstream-envs.

Each environment (``nemo-gym``, ``harbor``, ``inspect-ai``) lives under ``$ROLLCAGE_UPSTREAM_DIR``
(default ``.upstream/`` in the repository) on the Python 3.13 the machine carries. A test asks for
one with :func:`upstream_python`, which skips with the ``optional:`` reason when the machine has
no Python 3.13 (the script said so while ``make test`` ran), and fails when the interpreter exists
but the environment is missing (a broken set-up must not look green). :func:`run_upstream` runs a
script in it with a bound and returns its JSON answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import REPO

__all__ = ["UPSTREAM_DIR", "harbor_atif_errors", "run_upstream", "upstream_python"]

UPSTREAM_DIR = Path(os.environ.get("ROLLCAGE_UPSTREAM_DIR", REPO / ".upstream"))
"""Where scripts/upstream-envs puts the side environments."""


def _python313_exists() -> bool:
    # The script's own search, so the test and the set-up never disagree on what exists.
    probe = subprocess.run(
        [str(REPO / "scripts" / "upstream-envs"), "--python"], capture_output=True, timeout=30, check=False
    )
    return probe.returncode == 0


def upstream_python(name: str) -> Path:
    """The interpreter of the side environment *name*, or a skip (no Python 3.13) / failure (not built)."""
    python = UPSTREAM_DIR / name / "bin" / "python"
    if python.exists() and (UPSTREAM_DIR / name / ".rollcage-pin").exists():
        return python
    if not _python313_exists():
        pytest.skip(f"optional: no Python 3.13 on this machine for the {name} side environment")
    pytest.fail(
        f"the {name} side environment is missing under {UPSTREAM_DIR}: run scripts/upstream-envs "
        "(make test does)"
    )


def run_upstream(name: str, script: str, *args: str, stdin: str | None = None, timeout: float = 300) -> Any:
    """Run *script* (Python source) in side environment *name*; return the JSON it prints last.

    The script runs with the repository's tests on ``sys.path`` only through its own imports: it
    sees the upstream package, never rollcage, so what it accepts is what upstream accepts.
    """
    python = upstream_python(name)
    done = subprocess.run(
        [str(python), "-c", script, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=UPSTREAM_DIR,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"{name} side script exited {done.returncode}\n--- stderr ---\n{done.stderr[-4000:]}"
            f"\n--- stdout ---\n{done.stdout[-2000:]}"
        )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, f"{name} side script printed nothing; stderr: {done.stderr[-2000:]}"
    return json.loads(lines[-1])


_HARBOR_VALIDATE = """
import json, sys
from harbor.models.trajectories import Trajectory
from harbor.utils.trajectory_validator import TrajectoryValidator
answer = {}
for path in sys.argv[1:]:
    validator = TrajectoryValidator()
    errors = [] if validator.validate(path) else list(validator.get_errors())
    try:
        Trajectory.model_validate_json(open(path).read())
    except Exception as error:
        errors.append(f"Trajectory model: {error}")
    answer[path] = errors
print(json.dumps(answer))
"""


def harbor_atif_errors(paths: list[Path]) -> dict[str, list[str]]:
    """What Harbor's own ATIF validator and ``Trajectory`` model say of each file: path -> errors."""
    assert paths, "no ATIF files to validate"
    answer: dict[str, list[str]] = run_upstream("harbor", _HARBOR_VALIDATE, *(str(p) for p in paths))
    return {path: errors for path, errors in answer.items() if errors}


if __name__ == "__main__":  # pragma: no cover - a manual probe
    print(upstream_python(sys.argv[1]))
