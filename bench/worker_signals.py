"""Benchmark (not a test): what the worker's two signal handlers cost a rollout, on two loops.

A rollout's worker adds a handler for SIGTERM and SIGINT when it starts and removes both when
it ends (``rollcage.worker._Session.run``). asyncio checks each signal against
``signal.valid_signals()``, which makes an enum member of every signal at each call; the
worker's loop (``rollcage.worker._WorkerLoop``) checks against a set made once. Each round
times ``--rollouts`` such add/remove cycles on a fresh loop of each kind, in ABBA order (so a
drifting machine load hits both alike); printed: CPU per rollout (process time), medians over
the rounds, and worker / asyncio.

    .venv/bin/python bench/worker_signals.py [--rounds 10] [--rollouts 200]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import time
from collections.abc import Callable

from rollcage.worker import _WorkerLoop

__all__ = ["cycle_cost", "main"]

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def cycle_cost(make_loop: Callable[[], asyncio.AbstractEventLoop], rollouts: int) -> float:
    """CPU seconds per rollout of adding and removing the worker's two handlers on ``make_loop()``."""
    loop = make_loop()
    try:
        started = time.process_time()
        for _ in range(rollouts):
            for signum in _SIGNALS:
                loop.add_signal_handler(signum, lambda: None)
            for signum in _SIGNALS:
                loop.remove_signal_handler(signum)
        return (time.process_time() - started) / rollouts
    finally:
        loop.close()


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="ABBA rounds (default 10)")
    parser.add_argument("--rollouts", type=int, default=200, help="add/remove cycles per round and loop")
    args = parser.parse_args()
    kinds: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio's loop (before)": asyncio.SelectorEventLoop,
        "the worker's loop": _WorkerLoop,
    }
    samples: dict[str, list[float]] = {name: [] for name in kinds}
    print(f"load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    for index in range(args.rounds):
        order = list(kinds) if index % 2 == 0 else list(kinds)[::-1]
        for name in order:
            samples[name].append(cycle_cost(kinds[name], args.rollouts))
    print(f"{'loop':28} {'us CPU per rollout (median)':>28} {'min':>8} {'max':>8}")
    for name, values in samples.items():
        median = 1e6 * statistics.median(values)
        print(f"{name:28} {median:28.1f} {1e6 * min(values):8.1f} {1e6 * max(values):8.1f}")
    before, after = (statistics.median(values) for values in samples.values())
    print(f"worker / asyncio: {after / before:.3f}; saved per rollout: {1e6 * (before - after):.0f} us")
    print(f"load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
