"""Benchmark: what supervision and sandboxing add to every rollout.

For a one-turn rollout (the worker makes one model request and publishes its
result), each run measures

* first request: from the moment ``supervise()`` is called (or the bare process
  is spawned) to the moment the model request arrives at the upstream;
* total: until ``supervise()`` has returned its receipt (or the bare process
  has exited);

for four ways of running the same worker, interleaved so that the machine's
load hits them alike:

* ``python -c pass``: the floor, one interpreter start;
* ``bare``: the worker spawned directly (no supervisor, no proxy; it talks to
  the upstream over TCP);
* ``none``: ``supervise()`` with ``--sandbox none`` (proxy, capture, reaping);
* ``bwrap, no budgets``: bubblewrap with the per-rollout budgets off (no cgroup,
  no bounded tmpfs mounts: the baseline for their cost);
* ``bwrap``: ``supervise()`` under bubblewrap, as configured by default.

It prints the medians, and the overhead of each over ``bare`` and of bwrap over
none; the target is that sandboxing adds under 50 ms per rollout.

The worker is a parameter: by default the standard-library fake
(``tests/helpers/fake_worker.py model``), which starts in tens of
milliseconds and so shows the supervisor's own cost; ``--worker real`` runs
``rollcage worker`` (the real one), whose own start-up then dominates.

Run: ``.venv/bin/python bench/supervisor.py [--runs 15] [--worker fake|real]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.supervisor_env import HELPERS, bwrap_usable  # noqa: E402
from tests.helpers.supervisor_upstream import Upstream  # noqa: E402

from rollcage.supervisor import BwrapSandbox, NoSandbox, SupervisorConfig, default_worker_command, supervise  # noqa: E402


def _input(name: str, model_url: str) -> dict[str, Any]:
    return {
        "rollout_id": name,
        "task_id": "bench",
        "input": "Say hello.",
        "model": {"base_url": model_url, "model": "bench", "max_retries": 0},
    }


def _prepare(base: Path, name: str, model_url: str) -> Path:
    root = base / name
    root.mkdir()
    (root / "workspace").mkdir()
    (root / "input.json").write_text(json.dumps(_input(name, model_url)))
    return root


class Bench:
    def __init__(self, upstream: Upstream, base: Path, worker: list[str]) -> None:
        self.upstream = upstream
        self.base = base
        self.worker = worker
        self.count = 0

    def _name(self, kind: str) -> str:
        self.count += 1
        return f"{kind}-{self.count}"

    def _first_request_after(self, start_wall: float, seen_before: int) -> float | None:
        later = self.upstream.requests[seen_before:]
        return None if not later else (later[0].arrived_at - start_wall) * 1000

    async def python_pass(self) -> tuple[float | None, float]:
        start = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await proc.wait()
        return None, (time.perf_counter() - start) * 1000

    async def bare(self) -> tuple[float | None, float]:
        root = _prepare(self.base, self._name("bare"), f"{self.upstream.base_url}/v1")
        seen = len(self.upstream.requests)
        start_wall, start = time.time(), time.perf_counter()
        argv = [*self.worker, str(root / "input.json"), str(root / "result.json")]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            "--checkpoint",
            str(root / "checkpoint.jsonl"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if await proc.wait() != 0:
            raise SystemExit("the bare worker failed")
        return self._first_request_after(start_wall, seen), (time.perf_counter() - start) * 1000

    async def supervised(self, sandbox: BwrapSandbox | NoSandbox) -> tuple[float | None, float]:
        root = _prepare(self.base, self._name(sandbox.type), f"{self.upstream.base_url}/v1")
        config = SupervisorConfig(deadline_s=60, grace_s=2, sandbox=sandbox, worker_command=self.worker)
        seen = len(self.upstream.requests)
        start_wall, start = time.time(), time.perf_counter()
        receipt = await supervise(root, config)
        total = (time.perf_counter() - start) * 1000
        if receipt.outcome != "completed":
            raise SystemExit(f"{sandbox.type}: {receipt.outcome}: {receipt.outcome_reason}")
        return self._first_request_after(start_wall, seen), total


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=15, help="runs per way (default 15)")
    parser.add_argument(
        "--worker", choices=["fake", "real"], default="fake", help="which worker (default fake)"
    )
    args = parser.parse_args()

    worker = (
        default_worker_command()
        if args.worker == "real"
        else [sys.executable, str(HELPERS / "fake_worker.py"), "model"]
    )
    base = Path(tempfile.mkdtemp(prefix="rollcage-bench-"))
    try:
        with Upstream() as upstream:
            # One event loop for everything, as in the controller (threads and caches stay warm).
            results = asyncio.run(_run(Bench(upstream, base, worker), args.runs))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    medians = {
        name: (_median([first for first, _ in runs]), _median([total for _, total in runs]))
        for name, runs in results.items()
    }
    print(f"worker: {' '.join(worker)}   runs: {args.runs} per way, interleaved; medians in ms")
    print(f"{'way':<16}{'first request':>14}{'total':>10}{'total - bare':>14}")
    bare_total = medians["bare worker"][1]
    for name, (first, total) in medians.items():
        extra = (
            None if total is None or bare_total is None or name == "python -c pass" else total - bare_total
        )
        print(f"{name:<16}{_ms(first):>14}{_ms(total):>10}{_ms(extra):>14}")
    if "bwrap" in medians:
        (none_first, none_total), (bwrap_first, bwrap_total) = medians["none"], medians["bwrap"]
        print()
        print(
            f"sandboxing (bwrap - none): first request {_ms(_diff(bwrap_first, none_first))} ms, "
            f"total {_ms(_diff(bwrap_total, none_total))} ms   (target: < 50 ms)"
        )
        plain_first, plain_total = medians["bwrap, no budgets"]
        print(
            f"budgets (cgroups, bounded tmpfs, executor cage allowed): first request "
            f"{_ms(_diff(bwrap_first, plain_first))} ms, total {_ms(_diff(bwrap_total, plain_total))} ms"
        )
        print(
            f"ratios: bwrap/none total {bwrap_total / none_total:.2f}x, "
            f"bwrap/bare total {bwrap_total / bare_total:.2f}x, "
            f"bwrap/python -c pass {bwrap_total / medians['python -c pass'][1]:.2f}x"
        )


async def _run(bench: Bench, runs: int) -> dict[str, list[tuple[float | None, float]]]:
    ways: dict[str, Callable[[], Awaitable[tuple[float | None, float]]]] = {
        "python -c pass": bench.python_pass,
        "bare worker": bench.bare,
        "none": lambda: bench.supervised(NoSandbox()),
    }
    reason = bwrap_usable()
    if reason is None:
        # The fake worker's code lives in tests/helpers, which the sandbox must see. The baseline for
        # the per-rollout budgets is the same sandbox without them (no cgroup, no mounts, a poll).
        plain = BwrapSandbox(
            extra_ro_paths=[str(HELPERS)], cgroups="off", disk_budgets="poll", executor_cage="shared"
        )
        ways["bwrap, no budgets"] = lambda: bench.supervised(plain)
        ways["bwrap"] = lambda: bench.supervised(BwrapSandbox(extra_ro_paths=[str(HELPERS)]))
    else:
        print(f"(bwrap skipped: {reason})")
    logging.getLogger("rollcage.supervisor").setLevel(logging.ERROR)  # the none warning, every run
    results: dict[str, list[tuple[float | None, float]]] = {name: [] for name in ways}
    for way in ways.values():
        await way()  # warm-up: page cache, imports, bwrap --version, the SSL context
    for _ in range(runs):
        for name, way in ways.items():
            results[name].append(await way())
    return results


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


if __name__ == "__main__":
    main()
