"""A cancel signal sent while the worker starts, before its handlers are in place, still cancels it.

The worker holds SIGTERM and SIGINT from the first thing its command line does
(``rollcage.cli``) until its event loop's handlers are installed: a signal sent
meanwhile is pending, not fatal, and cancels the rollout with a well-formed result.
The signal is sent by the worker process itself at a chosen moment of its start (a
patched step, through the real command line), so the moment is exact, not a race.
Then what it starts (the executor, agent code) must not inherit a blocked mask.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from rollcage.policy import PolicyServer
from rollcage.worker import EXIT_CANCELLED, EXIT_OK
from tests.helpers.waiting import DEADLINE_S
from tests.helpers.worker_env import RolloutDir, worker_input

# The worker, started through its real command line (rollcage.cli.main), with one step of its start
# patched to send the process ``SIGNUM`` first: in the CLI's hands, or as the input is read.
_EARLY = """
import os, sys
import rollcage.worker as worker

signum, step = int(sys.argv[1]), sys.argv[2]
real = getattr(worker, step)

def early(*args, **kwargs):
    os.kill(os.getpid(), signum)
    return real(*args, **kwargs)

setattr(worker, step, early)
sys.argv = ["rollcage", "worker", *sys.argv[3:]]
from rollcage.cli import main
main()
"""

CANCELLED_BY = {signal.SIGTERM: EXIT_CANCELLED, signal.SIGINT: 128 + signal.SIGINT}


@pytest.mark.parametrize(
    ("signum", "step"),
    [
        (signal.SIGTERM, "run_worker"),  # the CLI has just held the signals: nothing of the worker ran
        (signal.SIGTERM, "_read_input"),  # the last step before the handlers
        (signal.SIGINT, "_read_input"),
    ],
)
def test_a_signal_before_the_handlers_are_installed_cancels_the_rollout_with_a_result(
    signum: signal.Signals,
    step: str,
    serve_policy: Callable[..., PolicyServer],
    rollout: RolloutDir,
) -> None:
    server = serve_policy({"tasks": {"t": [{"text": "done"}]}})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    with rollout.log.open("ab") as log:
        rollout.proc = subprocess.Popen(
            [sys.executable, "-c", _EARLY, str(int(signum)), step, str(rollout.input), str(rollout.result)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    code = rollout.wait()
    # Not killed by the signal (-signum): the worker's own exit, after its result.
    assert code == CANCELLED_BY[signum], rollout.log_text()
    result = rollout.result_model()
    assert result.error is not None and result.error.kind == "cancelled", result.error
    assert signum.name in result.error.message
    assert result.termination_reason == "cancelled"
    assert not server.requests, "a rollout cancelled before it began asked the model"


def _blocked(status: str) -> set[signal.Signals]:
    """The cancel signals a process's ``/proc/PID/status`` says it blocks."""
    mask = int(next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16)
    return {signum for signum in (signal.SIGTERM, signal.SIGINT) if mask & (1 << (signum - 1))}


def test_what_the_worker_starts_does_not_inherit_the_held_signals(
    serve_policy: Callable[..., PolicyServer], rollout: RolloutDir
) -> None:
    # The executor runs the cell; the shell it starts is agent code's own process.
    code = (
        "import subprocess\n"
        "print(open('/proc/self/status').read())\n"
        "print(subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True).stdout)"
    )
    call = {"name": "python", "arguments": {"code": code}}
    server = serve_policy({"tasks": {"t": [{"tool_calls": [call]}, {"text": "done"}]}})
    rollout.write_input(worker_input(model_url=server.base_url, task_id="t"))
    assert rollout.run(timeout=DEADLINE_S) == EXIT_OK, rollout.log_text()
    (tool,) = rollout.result_model().trajectory.tool_calls
    assert tool.status == "completed" and tool.output is not None, tool
    statuses = tool.output.split("Name:")[1:]
    assert len(statuses) == 2, tool.output
    for status in statuses:
        assert _blocked(status) == set(), status
