"""A worker that spends CPU in a daemon the sandbox reaps itself, then publishes an ``ok`` result.

``burn_worker.py SECONDS INPUT RESULT --checkpoint PATH``: a double-forked daemon
spins for SECONDS of CPU; the sandbox's PID-namespace init reaps it, so only a
count of the whole sandbox (its cgroup) sees that time, never RUSAGE_CHILDREN.
"""

from __future__ import annotations

import json
import os
import sys
import time

from fake_worker import publish, result


def burn_in_a_daemon(seconds: float) -> None:
    """Spend ``seconds`` of CPU in a daemon (bwrap only: waits until the sandbox shows no other process)."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            end = time.process_time() + seconds
            while time.process_time() < end:
                pass
        os._exit(0)
    os.wait()
    until = time.monotonic() + 60
    while time.monotonic() < until and any(
        pid not in (1, os.getpid()) for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
    ):
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    seconds, input_path, result_path = float(argv[0]), argv[1], argv[2]
    with open(input_path, "rb") as file:
        spec = json.load(file)
    burn_in_a_daemon(seconds)
    publish(result_path, result(spec, calls=[], error=None))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
