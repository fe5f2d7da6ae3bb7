"""Benchmark (not a test): the controller's throughput, peak memory and CPU share.

For each dataset size and sandbox, one child process runs a whole ``rollcage run``
in-process (one-turn tasks on the embedded scripted policy, concurrency 32) and
reports its own resource usage, so the controller's peak memory and CPU time are
measured apart from the workers it supervises (``RUSAGE_SELF`` vs ``RUSAGE_CHILDREN``).

Target: peak memory does not grow with the dataset (10k within 1.2x of 1k), and
throughput is bounded by the machine's cores rather than by the controller.

    python bench/controller.py                        # 1000 and 10000 tasks, none and bwrap
    python bench/controller.py --sizes 200 2000 --sandboxes none
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

POLICY = "tasks:\n  '*':\n    - text: '42'\n"


def _child(size: int, sandbox: str, concurrency: int, workdir: Path) -> dict[str, Any]:
    from rollcage.commands.run import tune_collector
    from rollcage.controller import Controller, RunConfig

    dataset = workdir / "dataset.jsonl"
    with dataset.open("w") as handle:
        for i in range(size):
            row = {
                "id": f"t{i}",
                "input": "Say 42.",
                "expected": "42",
                "tools": [],
                "model": {"max_retries": 0},
            }
            handle.write(json.dumps(row) + "\n")
    (workdir / "policy.yaml").write_text(POLICY)
    config = RunConfig(
        dataset=dataset,
        out=workdir / "out",
        sandbox=sandbox,  # type: ignore[arg-type]
        concurrency=concurrency,
        deadline_s=120,
        metrics_interval_s=5,
    )
    tune_collector()  # as `rollcage run` does
    started = time.monotonic()
    summary = asyncio.run(Controller(config).run())
    wall = time.monotonic() - started
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "size": size,
        "sandbox": sandbox,
        "wall_s": wall,
        "rollouts": summary.metrics.rollouts,
        "completed": summary.metrics.outcomes["completed"],
        "rollouts_per_s": summary.metrics.rollouts / wall,
        "controller_peak_rss_mb": me.ru_maxrss / 1024,
        "controller_cpu_s": me.ru_utime + me.ru_stime,
        "controller_cpu_share": (me.ru_utime + me.ru_stime) / wall,
        "workers_cpu_s": kids.ru_utime + kids.ru_stime,
    }


def main() -> None:
    """Run the grid and print a table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--sandboxes", nargs="+", default=["none", "bwrap"], choices=["none", "bwrap"])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--child", nargs=3, metavar=("SIZE", "SANDBOX", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        size, sandbox, workdir = int(args.child[0]), args.child[1], Path(args.child[2])
        print(json.dumps(_child(size, sandbox, args.concurrency, workdir)))
        return
    rows = []
    for sandbox in args.sandboxes:
        for size in args.sizes:
            workdir = Path(tempfile.mkdtemp(prefix="rollcage-bench-"))
            try:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--concurrency",
                        str(args.concurrency),
                        "--child",
                        str(size),
                        sandbox,
                        str(workdir),
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"cores: {os.cpu_count()}  concurrency: {args.concurrency}")
    columns = ("sandbox", "tasks", "done", "wall s", "rollouts/s", "peak MB", "ctl CPU", "workers CPU s")
    print("  ".join(f"{c:>13}" for c in columns))
    for r in rows:
        cells = (
            r["sandbox"],
            r["size"],
            r["completed"],
            f"{r['wall_s']:.1f}",
            f"{r['rollouts_per_s']:.1f}",
            f"{r['controller_peak_rss_mb']:.1f}",
            f"{r['controller_cpu_share']:.0%}",
            f"{r['workers_cpu_s']:.1f}",
        )
        print("  ".join(f"{c:>13}" for c in cells))
    for sandbox in args.sandboxes:
        peaks = [r["controller_peak_rss_mb"] for r in rows if r["sandbox"] == sandbox]
        if len(peaks) >= 2:
            print(f"{sandbox}: peak memory largest/smallest = {peaks[-1] / peaks[0]:.2f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()
