"""Benchmark (not a test): ``bench/peers.py`` from two checkouts in ABBA order, rounds pooled.

Compares rollcage at two commits on identical work: each checkout runs its own
``bench/peers.py --system rollcage`` (its own ``.venv``, its own code), the two taking
turns in ABBA order (new old, old new, new old, ...), so that a neighbour's load that
comes and goes falls on both alike. Every run's numbers are printed with the load
average before it; the ratios (new / old) are taken from the rounds pooled: sums of CPU,
controller CPU and tasks for CPU per rollout, sums of tasks and wall for throughput, the
worst peak PSS of each side.

    .venv/bin/python bench/peers_abba.py --new . --old /work/bench/old --rounds 4 \\
        --scenario c256 --scenario instant

Each checkout needs ``.venv`` (``pip install -e '.[dev]'``) and compiled bytecode
(``python -m compileall -q src/rollcage``), as ``make bytecode`` leaves it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _run(tree: Path, scenarios: list[str], out: Path) -> list[dict[str, Any]]:
    argv = [str(tree / ".venv" / "bin" / "python"), str(tree / "bench" / "peers.py")]
    for scenario in scenarios:
        argv += ["--scenario", scenario]
    argv += ["--system", "rollcage", "--alone-runs", "1", "--json", str(out)]
    subprocess.run(argv, cwd=tree, check=True, stdout=subprocess.DEVNULL, timeout=1800)
    runs: list[dict[str, Any]] = json.loads(out.read_text())["runs"]
    return runs


def _commit(tree: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "?"


def _pooled(rows: list[dict[str, Any]]) -> dict[str, float]:
    tasks = sum(r["tasks"] for r in rows)
    return {
        "cpu_ms": 1000 * sum(r["cpu_s"] for r in rows) / tasks,
        "main_ms": 1000 * sum(r["main_cpu_s"] or 0.0 for r in rows) / tasks,
        "throughput": tasks / sum(r["wall_s"] for r in rows),
        "pss": max(r["peak_pss_mb"] for r in rows),
        "infra": sum(r["infra_failures"] for r in rows),
    }


def main() -> None:
    """Run the rounds and print every run, then the pooled ratios."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--new", type=Path, required=True, help="the checkout under test")
    parser.add_argument("--old", type=Path, required=True, help="the baseline checkout")
    parser.add_argument("--rounds", type=int, default=4, help="rounds; each runs both checkouts (default 4)")
    parser.add_argument("--scenario", action="append", help="peers.py scenario (repeatable)")
    parser.add_argument("--json", type=Path, help="also write every run's numbers here")
    args = parser.parse_args()
    scenarios = args.scenario or ["c256", "instant"]
    trees = {"new": args.new.resolve(), "old": args.old.resolve()}
    print(f"new = {trees['new']} ({_commit(trees['new'])}), old = {trees['old']} ({_commit(trees['old'])})")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rollcage-abba-") as work:
        for index in range(args.rounds):
            order = ["new", "old"] if index % 2 == 0 else ["old", "new"]
            for side in order:
                load = " ".join(f"{x:.1f}" for x in os.getloadavg())
                out = Path(work) / f"{index}-{side}.json"
                for row in _run(trees[side], scenarios, out):
                    row.update(side=side, abba_round=index + 1, abba_load=load)
                    runs.append(row)
                    print(
                        f"round {index + 1} {side}: {row['scenario']:8} {row['throughput']:6.2f}/s "
                        f"{1000 * row['cpu_s'] / row['tasks']:6.1f} ms CPU/rollout "
                        f"(controller {1000 * (row['main_cpu_s'] or 0) / row['tasks']:5.1f}) "
                        f"PSS {row['peak_pss_mb']:5.0f} MB infra {row['infra_failures']}  load before {load}",
                        flush=True,
                    )
    print()
    print(
        "| scenario | CPU ms/rollout new/old | controller ms new/old | throughput new/old "
        "| peak PSS new/old | infra |"
    )
    print("|---|---|---|---|---|---|")
    for scenario in scenarios:
        new = _pooled([r for r in runs if r["scenario"] == scenario and r["side"] == "new"])
        old = _pooled([r for r in runs if r["scenario"] == scenario and r["side"] == "old"])
        cells = [scenario] + [
            f"{new[key] / old[key]:.2f}x ({new[key]:.{digits}f} vs {old[key]:.{digits}f})"
            for key, digits in (("cpu_ms", 1), ("main_ms", 1), ("throughput", 2))
        ]
        cells += [f"{new['pss'] / old['pss']:.2f}x", f"{new['infra']:.0f} / {old['infra']:.0f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    sys.exit(main())
