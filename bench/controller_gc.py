"""Benchmark (not a test): the controller's garbage collector and selector look-ups at C=256, per tree.

Runs ``bench/peers.py``'s C=256 load (N tasks of the scripted python-tool policy, 1 s per model
call, ``--sandbox bwrap --worker-start warm``) with each checkout's own ``rollcage run``, in
turns (``--rounds``: A B A B ...), with the controller's python patched to count:

* the garbage collector: collections per generation, the objects each found unreachable (what
  reference counts did not free: cycles), and the CPU time of the thread that collected
  (``time.thread_time``, from ``gc.callbacks``);
* ``selectors``' ``get_key`` (from ``loop.add_reader``/``remove_reader`` and the ``sock_*`` calls):
  calls that found the descriptor and that did not, and look-ups that had to search every
  registered key (``_fileobj_lookup`` given an object whose ``fileno()`` fails: a closed socket).

Counts do not depend on the machine's load; CPU times do, so the turns are pooled.

    .venv/bin/python bench/controller_gc.py --tree . --tree /work/wt/perf2 --rounds 2
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_counts
from _measure import ModelServer, write_policy

# Run in the tree's own python before its CLI.
_PATCH = r"""
import collections, gc, json, os, selectors, sys, time
counts = collections.Counter()
_base = selectors._BaseSelectorImpl
_lookup = _base._fileobj_lookup
def _fileobj_lookup(self, fileobj):
    try:
        return selectors._fileobj_to_fd(fileobj)
    except ValueError:
        counts["exhaustive look-ups"] += 1
        return _lookup(self, fileobj)
_base._fileobj_lookup = _fileobj_lookup
_get_key = selectors.BaseSelector.get_key
def get_key(self, fileobj):
    try:
        key = _get_key(self, fileobj)
    except KeyError:
        counts["get_key misses"] += 1
        raise
    counts["get_key hits"] += 1
    return key
selectors.BaseSelector.get_key = get_key
_start = [0]
def _collected(phase, info):
    if phase == "start":
        _start[0] = time.thread_time_ns()
        return
    generation = info["generation"]
    counts[f"gen{generation} collections"] += 1
    counts[f"gen{generation} unreachable"] += info["collected"]
    counts[f"gen{generation} ms"] += (time.thread_time_ns() - _start[0]) / 1e6
gc.callbacks.append(_collected)
sys.argv = ["rollcage", *sys.argv[1:]]
from rollcage.cli import main
try:
    main()
finally:
    with open(os.environ["ROLLCAGE_COUNTS"], "w") as out:
        json.dump({"hops": {}, "counts": counts}, out)
"""

_ROWS = [
    *(f"gen{g} {what}" for g in (0, 1, 2) for what in ("collections", "unreachable", "ms")),
    "get_key hits",
    "get_key misses",
    "exhaustive look-ups",
]


def main() -> None:
    """Run each tree in turns and print the counts per rollout, pooled, with the ratio to the last tree."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tree", type=Path, action="append", required=True, help="a checkout (repeatable)")
    parser.add_argument("--tasks", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--latency", type=float, default=1.0, help="seconds per model call")
    parser.add_argument("--rounds", type=int, default=1, help="turns of every tree, alternating order")
    args = parser.parse_args()
    rollout_counts._PATCH = _PATCH
    trees = [t.resolve() for t in args.tree]
    names = [rollout_counts._commit(t) for t in trees]
    pooled: list[collections.Counter[str]] = [collections.Counter() for _ in trees]
    rollouts = [0 for _ in trees]
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="rollcage-gc-") as tmp:
        work = Path(tmp)
        policy = work / "policy.json"
        write_policy(policy, args.tasks)
        for round_ in range(args.rounds):
            order = list(range(len(trees)))
            if round_ % 2:
                order.reverse()
            for i in order:
                with ModelServer(policy, args.latency) as server:
                    found: dict[str, Any] = rollout_counts._one(
                        trees[i], work, server.base_url, args, strace=False
                    )
                pooled[i].update(found["counts"])
                rollouts[i] += found["rollouts"]
    print(f"N={args.tasks} C={args.concurrency}, {args.latency:g} s per model call, {args.rounds} round(s)")
    print(f"load average before: {load}; after:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print()
    print("| per rollout | " + " | ".join(names) + f" | ratio (first / {names[-1]}) |")
    print("|---|" + "---|" * (len(names) + 1))
    for row in [*_ROWS, "collector ms (all)"]:
        if row == "collector ms (all)":
            values = [
                sum(p[f"gen{g} ms"] for g in (0, 1, 2)) / n for p, n in zip(pooled, rollouts, strict=True)
            ]
        else:
            values = [p.get(row, 0) / n for p, n in zip(pooled, rollouts, strict=True)]
        ratio = f"{values[0] / values[-1]:.2f}x" if values[-1] else "-"
        print(f"| {row} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {ratio} |")


if __name__ == "__main__":
    main()
