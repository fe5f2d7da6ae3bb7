"""Benchmark (not a test): the CPU ``rollcage run`` spends before its controller starts, per tree.

Each checkout's own python runs its own ``rollcage run DATASET ...`` (bubblewrap, warm workers,
C=256: ``bench/peers.py``'s C=256 command line) with ``Collection.__init__`` patched to print the
process's CPU time (user + system, ``getrusage``) and exit: what a run pays once before its first
rollout (imports, the command's options, the configuration's validation). ``--help`` is timed
apart: it builds the same options but imports what printing them needs instead of the run's
start. The trees take turns (A B B A ...), ``--repeat`` times each.

    .venv/bin/python bench/run_startup.py --tree . --tree /work/bench/old --repeat 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

_STOP_AT_COLLECTION = r"""
import resource, sys
import rollcage.controller as controller
def stop(self, *args, **kwargs):
    used = resource.getrusage(resource.RUSAGE_SELF)
    print(f"{used.ru_utime + used.ru_stime:.4f}", file=sys.stderr)
    raise SystemExit(0)
controller.Collection.__init__ = stop
sys.argv = ["rollcage", *sys.argv[1:]]
from rollcage.cli import main
main()
"""

_HELP = r"""
import resource, sys
sys.argv = ["rollcage", "run", "--help"]
from rollcage.cli import main
try:
    main()
except SystemExit:
    pass
used = resource.getrusage(resource.RUSAGE_SELF)
print(f"{used.ru_utime + used.ru_stime:.4f}", file=sys.stderr)
"""


def _cpu(tree: Path, code: str, argv: list[str]) -> float:
    done = subprocess.run(
        [str(tree / ".venv" / "bin" / "python"), "-c", code, *argv],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    lines = done.stderr.strip().splitlines()
    if not lines:
        raise RuntimeError(f"{tree}: nothing measured (exit {done.returncode})")
    return float(lines[-1])


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or tree.name


def main() -> None:
    """Time each tree's start of a run and its ``run --help``; print medians, the ratio to the last tree."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a checkout (repeatable)")
    parser.add_argument("--repeat", type=int, default=6, help="runs of each tree, in turns")
    args = parser.parse_args()
    trees = [t.resolve() for t in args.tree]
    names = [_commit(t) for t in trees]
    start: list[list[float]] = [[] for _ in trees]
    helps: list[list[float]] = [[] for _ in trees]
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="rollcage-startup-") as tmp:
        dataset = Path(tmp) / "dataset.jsonl"
        dataset.write_text('{"id": "t1", "prompt": "x"}\n')
        argv = [
            "run",
            str(dataset),
            "--out",
            str(Path(tmp) / "out"),
            "--model",
            "http://127.0.0.1:9/v1",
            "--model-name",
            "scripted",
            "--concurrency",
            "256",
            "--sandbox",
            "bwrap",
            "--worker-start",
            "warm",
            "--quiet",
        ]
        for turn in range(args.repeat):
            order = list(range(len(trees)))
            if turn % 2:
                order.reverse()
            for i in order:
                start[i].append(_cpu(trees[i], _STOP_AT_COLLECTION, argv))
                helps[i].append(_cpu(trees[i], _HELP, []))
    print(f"{args.repeat} runs of each tree, in turns; medians (min-max)")
    print(f"load average before: {load}; after:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print()
    print("| CPU s | " + " | ".join(names) + f" | ratio (first / {names[-1]}) |")
    print("|---|" + "---|" * (len(names) + 1))
    for what, samples in (("`rollcage run` to its controller", start), ("`rollcage run --help`", helps)):
        medians = [statistics.median(s) for s in samples]
        cells = [f"{m:.3f} ({min(s):.3f}-{max(s):.3f})" for m, s in zip(medians, samples, strict=True)]
        print(f"| {what} | " + " | ".join(cells) + f" | {medians[0] / medians[-1]:.2f}x |")


if __name__ == "__main__":
    main()
