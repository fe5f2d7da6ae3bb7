"""Benchmark (not a test): what a fork of the warm template copies and spends in its first steps, two ways.

A warm worker is a fork of the template (``rollcage.warm``): every page of the template's it
writes is copied (``Private_Dirty`` in ``/proc/self/smaps_rollup``), and each copy is a page
fault's CPU. Each round starts a template of each kind in a fresh interpreter (``python -I``:
``rollcage.worker.warm_up()``, ``gc.collect()``, ``gc.freeze()``, as ``rollcage template``
does), which forks ``--forks`` children one after another; each child runs the worker's first
steps and reports what it copied and the CPU it took (its own ``process_time``, from its birth):

* the command line (``rollcage.worker``'s parse of the sandbox's);
* logging set up at INFO, httpx's logger at WARNING;
* the event loop and the child watcher;
* ``input.json`` read and validated (a bench task's, as the controller writes it), and three
  HTTP exchanges through h11 in memory (a model call's framing).

The two kinds, in ABBA order (a drifting load hits both alike):

* *before*: as ``c676fda``: ``logging.basicConfig`` and ``setLevel`` (each sweeps every logger's
  cache), argparse at every start, the template's allocator left with its holes;
* *after*: this tree: the levels set in the template and only differing ones set again, the
  sandbox's command line parsed in the template, the allocator's free blocks taken before the
  freeze (:func:`rollcage.forkserver.fill_free_blocks`).

Printed: medians over every child of each kind: KB copied in the first steps, KB copied at birth
(before them), CPU ms in the first steps, and after / before.

    .venv/bin/python bench/worker_lean.py [--rounds 6] [--forks 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from rollcage.protocol import SCHEMA_VERSION

__all__ = ["TEMPLATE", "main", "run_template"]

_INPUT = json.dumps(
    {
        "schema_version": SCHEMA_VERSION,
        "rollout_id": "t1-s0-t0",
        "task_id": "t1",
        "input": "[task:t1] Compute 6 * 7 with the python tool, then answer with the number only.",
        "model": {"base_url": "http://127.0.0.1:9/v1", "model": "scripted"},
        "tools": [{"type": "python", "name": "python"}],
    }
)
"""A bench task's input (``bench/_measure.py``'s), as the controller writes it but for its defaults."""

TEMPLATE = r"""
import asyncio, gc, json, logging, os, sys, time
from rollcage import worker
from rollcage.forkserver import fill_free_blocks
from rollcage.http import exchange_in_memory
from rollcage.procs import wait_for_children_by_pidfd

kind, forks, raw = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
worker.warm_up()
if kind == "before":
    # As c676fda's template left them: no levels set, nothing parsed ahead.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    worker._PARSED.clear()
gc.collect()
if kind == "after":
    fill_free_blocks()
gc.freeze()


def dirty():
    with open("/proc/self/smaps_rollup", "rb") as f:
        text = f.read()
    return int(text.split(b"Private_Dirty:")[1].split()[0])


def first_steps():
    argv = list(worker._SANDBOX_ARGV)
    if kind == "before":
        worker._parser().parse_args(argv)
        logging.basicConfig(level="INFO", format=worker._LOG_FORMAT, stream=sys.stderr)
        if logging.getLogger().level > logging.DEBUG:
            logging.getLogger("httpx").setLevel(logging.WARNING)
    else:
        worker._parse_args(argv)
        worker._configure_logging(logging.INFO)
    wait_for_children_by_pidfd()
    loop = worker._WorkerLoop()
    asyncio.set_event_loop(loop)

    async def episode():
        worker.parse_input(raw)
        for _ in range(3):
            exchange_in_memory()

    with asyncio.Runner(loop_factory=lambda: loop) as runner:
        runner.run(episode())


samples = []
for _ in range(forks):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        born = dirty()
        first_steps()
        cpu = time.process_time()
        os.write(w, json.dumps([born, dirty() - born, cpu * 1e3]).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 4096):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    samples.append(json.loads(data))
print(json.dumps(samples))
"""
"""The template of one kind (run with ``python -I -c``): forks its children and prints their samples."""


def run_template(kind: str, forks: int) -> list[list[float]]:
    """One template of ``kind`` and its ``forks`` children: ``[born KB, first steps KB, CPU ms]`` each."""
    python = Path(sys.executable)
    done = subprocess.run(
        [str(python), "-I", "-c", TEMPLATE, kind, str(forks), _INPUT],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the {kind} template failed:\n{done.stderr}")
    samples: list[list[float]] = json.loads(done.stdout.splitlines()[-1])
    return samples


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=6, help="ABBA rounds (default 6)")
    parser.add_argument("--forks", type=int, default=8, help="children per template (default 8)")
    args = parser.parse_args()
    print(f"load average: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    samples: dict[str, list[list[float]]] = {"before": [], "after": []}
    for index in range(args.rounds):
        order = ("before", "after") if index % 2 == 0 else ("after", "before")
        for kind in order:
            samples[kind] += run_template(kind, args.forks)
    print(f"\n{'kind':8} {'children':>8} {'copied KB':>10} {'at birth KB':>12} {'CPU ms':>8}")
    medians: dict[str, tuple[float, float, float]] = {}
    for kind, rows in samples.items():
        born = statistics.median(r[0] for r in rows)
        copied = statistics.median(r[1] for r in rows)
        cpu = statistics.median(r[2] for r in rows)
        medians[kind] = (copied, born, cpu)
        print(f"{kind:8} {len(rows):8} {copied:10.0f} {born:12.0f} {cpu:8.2f}")
    before, after = medians["before"], medians["after"]
    print(
        f"{'after / before':17} {after[0] / before[0]:10.2f} {after[1] / before[1]:12.2f} "
        f"{after[2] / before[2]:8.2f}"
    )
    print(f"load average at the end: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
