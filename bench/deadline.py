"""Benchmark: how late the deadline's first signal is, quiet and under load.

Each round supervises ``--rollouts`` sandboxed workers concurrently in one event
loop (as the controller does); each worker hangs until signalled, so every one
of them is stopped by its deadline. The latency of a rollout is the time from
its deadline to the first signal the supervisor records in its receipt
(``signals_sent[0].at - (started_at + deadline_s)``).

What is measured is the stop, not the launch: the processes of a round exist
before it starts, and its busy executor starts once every worker runs. Rounds,
interleaved ``--rounds`` times:

* ``quiet``: nothing else runs (the baseline);
* ``busy executor``: the loop's default thread pool is kept saturated by
  blocking calls (as slow fsync calls of captures and receipts do on a loaded
  disk): ``--busy-threads`` tasks each loop ``to_thread(time.sleep, 0.3)``;
* ``many processes``: ``--processes`` sleeping processes on the host, so that a
  walk of all of ``/proc`` is expensive;
* ``both``: the two loads together.

It prints the median, 90th percentile and maximum latency of each round kind,
and their ratio over the quiet round.

Run: ``.venv/bin/python bench/deadline.py [--rollouts 8] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.helpers.supervisor_env import HELPERS, bwrap_usable  # noqa: E402

from rollcage.supervisor import BwrapSandbox, NoSandbox, SupervisorConfig, supervise  # noqa: E402


def _prepare(base: Path, name: str) -> Path:
    root = base / name
    root.mkdir()
    (root / "workspace").mkdir()
    spec = {
        "rollout_id": name,
        "task_id": "bench",
        "input": "hang",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "bench", "max_retries": 0},
    }
    (root / "input.json").write_text(json.dumps(spec))
    return root


@contextlib.asynccontextmanager
async def _busy_executor(tasks: int) -> AsyncIterator[None]:
    stop = asyncio.Event()

    async def hog() -> None:
        while not stop.is_set():
            await asyncio.to_thread(time.sleep, 0.3)

    running = [asyncio.ensure_future(hog()) for _ in range(tasks)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*running)


@contextlib.contextmanager
def _many_processes(count: int) -> Iterator[None]:
    procs = [subprocess.Popen(["sleep", "600"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


async def _round(
    base: Path, config: SupervisorConfig, rollouts: int, tag: str, *, processes: int, busy: int
) -> list[float]:
    roots = [_prepare(base, f"{tag}-{i}") for i in range(rollouts)]
    # The processes exist before the round starts (spawning them would block this loop); the
    # busy executor starts once every worker runs: what is measured is the stop, not the launch.
    with _many_processes(processes):
        running = [asyncio.ensure_future(supervise(root, config)) for root in roots]
        async with asyncio.timeout(60):
            while not all((root / "workspace" / "started").exists() for root in roots):  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        async with _busy_executor(busy):
            receipts = await asyncio.gather(*running)
    latencies = []
    for receipt in receipts:
        if not receipt.deadline_fired or not receipt.signals_sent:
            raise SystemExit(f"{receipt.rollout_id}: {receipt.outcome}: {receipt.outcome_reason}")
        latencies.append((receipt.signals_sent[0].at - (receipt.started_at + receipt.deadline_s)) * 1000)
    return latencies


async def _run(args: argparse.Namespace, base: Path, config: SupervisorConfig) -> dict[str, list[float]]:
    loads = {
        "quiet": (0, 0),
        "busy executor": (0, args.busy_threads),
        "many processes": (args.processes, 0),
        "both": (args.processes, args.busy_threads),
    }
    results: dict[str, list[float]] = {name: [] for name in loads}
    await _round(base, config, 1, "warm", processes=0, busy=0)
    for n in range(args.rounds):
        for name, (processes, busy) in loads.items():
            tag = f"{name.split()[0]}{n}"
            results[name] += await _round(base, config, args.rollouts, tag, processes=processes, busy=busy)
    return results


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rollouts", type=int, default=8, help="concurrent rollouts per round (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind (default 3)")
    parser.add_argument("--deadline", type=float, default=4.0, help="deadline of each rollout, s (default 4)")
    parser.add_argument(
        "--busy-threads", type=int, default=24, help="blocking tasks in the busy executor (default 24)"
    )
    parser.add_argument("--processes", type=int, default=1500, help="sleeping host processes (default 1500)")
    args = parser.parse_args()

    reason = bwrap_usable()
    sandbox: BwrapSandbox | NoSandbox
    if reason is None:
        sandbox = BwrapSandbox(extra_ro_paths=[str(HELPERS)])
    else:
        print(f"(bwrap unusable, running with --sandbox none: {reason})")
        sandbox = NoSandbox()
        logging.getLogger("rollcage.supervisor").setLevel(logging.ERROR)
    config = SupervisorConfig(
        deadline_s=args.deadline,
        grace_s=1.0,
        sandbox=sandbox,
        proxy=None,
        worker_command=[sys.executable, str(HELPERS / "fake_worker.py"), "hang"],
    )
    base = Path(tempfile.mkdtemp(prefix="rollcage-bench-"))
    try:
        results = asyncio.run(_run(args, base, config))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(
        f"sandbox: {sandbox.type}   {args.rollouts} rollouts x {args.rounds} rounds per kind; "
        "deadline -> first signal, ms"
    )
    print(f"{'round':<16}{'median':>10}{'p90':>10}{'max':>10}{'median/quiet':>14}")
    quiet = statistics.median(results["quiet"])
    for name, values in results.items():
        median = statistics.median(values)
        ratio = median / quiet if quiet > 0 else float("nan")
        print(f"{name:<16}{median:>10.1f}{_p90(values):>10.1f}{max(values):>10.1f}{ratio:>13.1f}x")


if __name__ == "__main__":
    main()
