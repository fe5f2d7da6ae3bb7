"""Run one controller with a lowered open-file limit: ``flood_run.py NOFILE DATASET OUT POLICY DEADLINE``.

The fd-starvation test runs this in a subprocess so that lowering
``RLIMIT_NOFILE`` (soft and hard) costs the test process nothing. It prints one
JSON line: the controller's open descriptors before and after the run, its exit
code and its limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
from pathlib import Path

from rollcage.controller import Controller, EmbeddedPolicyConfig, RunConfig
from rollcage.supervisor import BwrapSandbox


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def main(dataset: Path, out: Path, policy: Path, deadline: float) -> dict[str, int]:
    config = RunConfig(
        dataset=dataset,
        out=out,
        model=EmbeddedPolicyConfig(script=policy),
        concurrency=3,
        deadline_s=deadline,
        grace_s=1.0,
        max_infra_retries=0,
        # The flood comes from inside the worker's sandbox, beside the worker, as a harness that talks
        # to the model itself would: a caged executor cannot reach the proxy's socket at all.
        bwrap=BwrapSandbox(executor_cage="shared"),
    )
    before = open_fds()
    summary = await Controller(config).run()
    return {"fds_before": before, "fds_after": open_fds(), "exit_code": summary.exit_code}


if __name__ == "__main__":
    nofile = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    report = asyncio.run(main(Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), float(sys.argv[5])))
    report["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(json.dumps(report))
