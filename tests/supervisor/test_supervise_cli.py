"""``rollcage supervise`` as a process: its exit code is its receipt's, and it starts by sweeping R.

A signal that arrives once the receipt is written has nothing left to stop: it must not
end the process with -15 or -2 instead of the receipt's exit code. Temporary files a
SIGKILLed supervisor left in the rollout directory are removed by the next one at its
start, whether or not it then runs the rollout.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rollcage.protocol import SupervisorReceipt
from tests.helpers.supervisor_env import fake, make_rollout

SIGNAL_AT_THE_OUTCOME = """
import os, signal, sys
import typer
from rollcage.cli import main

printed, landing = typer.echo, getattr(signal, sys.argv[1])

def echo(*args, **kwargs):
    # The receipt is written and the outcome about to be printed: the signal lands now.
    os.kill(os.getpid(), landing)
    printed(*args, **kwargs)

typer.echo = echo
sys.argv = ["rollcage", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_after_the_receipt_leaves_the_receipts_exit_code(
    tmp_path: Path, signum: signal.Signals
) -> None:
    root = make_rollout(tmp_path)
    worker = " ".join(fake("ok"))
    argv = [sys.executable, "-c", SIGNAL_AT_THE_OUTCOME, signum.name, "supervise", str(root)]
    done = subprocess.run(
        [*argv, "--sandbox", "none", "--worker-command", worker],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    receipt = SupervisorReceipt.model_validate_json((root / "receipt.json").read_bytes())
    assert receipt.outcome == "completed", receipt.outcome_reason
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "outcome: completed" in done.stdout


def test_a_killed_supervisors_temporary_files_are_swept_at_the_start(tmp_path: Path) -> None:
    root = make_rollout(tmp_path)
    left = [root / ".result.json.0123456789abcdef.tmp", root / ".receipt.json.fedcba9876543210.tmp"]
    for path in left:
        path.write_text("{half a file")
    kept = root / ".notes.tmp"  # not a publisher's temporary name: never touched
    kept.write_text("mine")
    (root / "result.json").write_text("{}")  # it was killed after publishing the result: refused below
    argv = [sys.executable, "-m", "rollcage", "supervise", str(root), "--sandbox", "none"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and "already exists" in done.stderr
    assert not any(path.exists() for path in left)
    assert kept.read_text() == "mine"
