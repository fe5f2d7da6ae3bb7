"""Benchmark (not a test): a non-root supervisor's rollout, its worker started cold against forked warm.

A supervisor that is not root makes its cages with bubblewrap's unprivileged user namespaces.
Its workers used to be started cold there (a fresh interpreter and the worker's imports in
every rollout); a warm start now forks them from the pre-imported template into the cage
bubblewrap made, through a go-between that joins its namespaces (:mod:`rollcage.warm`). This
runs the same small rollout (one model call asking for a python cell, the cell, one more
model call, the answer) under ``supervise()`` in a process of the unprivileged user
``rollcage-test`` (made by the tests' helper), rollouts one at a time, cold and warm in turn
(ABAB, after one of each to warm up: the template's start, the bytecode cache, the page
cache), and reads per rollout:

* **start** — from the supervision's start (the receipt's ``started_at``) to the worker's
  first model request reaching the egress proxy (the capture's first ``started_at``);
* **wall** — the whole supervision (the receipt's ``duration_s``);
* **CPU** — of everything but the model server (a root process of its own, started first):
  the user's process and everything it starts (bubblewrap, the template, the worker, its
  executor) sit in a cgroup v1 ``cpuacct`` group of their own, read before and after each
  rollout. Without a writable cpuacct hierarchy the user's process reads its own rusage
  (self and children), a lower bound, and the output says so.

Medians, and warm / cold for each. Run as root (it makes the user and runs the rollouts as
it), with bubblewrap:

    .venv/bin/python bench/nonroot_start.py [--pairs 10]

``--executors BASELINE_PYTHON`` compares the worker's ``python`` executor instead, both workers
warm: forked by the executor template through its go-between (this checkout) against started
by the worker (``BASELINE_PYTHON``: the interpreter of a checkout whose non-root workers start
their executors, e.g. ``git archive 6dea3fc | tar -x -C DIR`` with a venv of its own, made
readable for the user). Each round is one process of the user per side, in turn (ABBA), whose
first rollout warms up (the templates' start) and is not counted; the same reads per rollout,
each with one python execution, so the difference is one executor's start:

    .venv/bin/python bench/nonroot_start.py --executors /tmp/base/.venv/bin/python [--rounds 4 --pairs 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import CpuGroup, ModelServer, cpu_s

CELL = {"tool_calls": [{"name": "python", "arguments": {"code": "print(6 * 7)"}}]}
ENDING = {"tool_calls": [{"name": "python", "arguments": {"code": "import os\nos._exit(0)"}}]}
"""A cell that ends its executor: the next cell's executor is started (or forked) again."""


def _cpu(group: Path | None) -> float:
    if group is not None:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    return cpu_s(resource.getrusage(resource.RUSAGE_SELF)) + cpu_s(
        resource.getrusage(resource.RUSAGE_CHILDREN)
    )


async def _one(mode: str, root: Path, base_url: str, group: Path | None) -> dict[str, Any]:
    from tests.helpers.worker_env import worker_input

    from rollcage.supervisor import BwrapSandbox, ProxyConfig, SupervisorConfig, supervise

    (root / "workspace").mkdir(parents=True)
    (root / "input.json").write_text(json.dumps(worker_input(model_url=base_url, task_id="t")))
    config = SupervisorConfig(deadline_s=120, proxy=ProxyConfig(), sandbox=BwrapSandbox(worker_start=mode))
    before = _cpu(group)
    receipt = await supervise(root, config)
    cpu = _cpu(group) - before
    if receipt.outcome != "completed":
        raise SystemExit(f"a {mode} rollout did not complete: {receipt.outcome}: {receipt.outcome_reason}")
    first = json.loads((root / "model_capture.jsonl").read_text().splitlines()[0])
    return {"start_s": first["started_at"] - receipt.started_at, "wall_s": receipt.duration_s, "cpu_s": cpu}


async def _rounds(
    modes: list[str], pairs: int, base_url: str, group: Path | None, work: Path
) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    try:
        for index, mode in enumerate(modes * (pairs + 1)):
            got = await _one(mode, work / f"{mode}-{index}", base_url, group)
            if index >= len(modes):  # the first of each warms up (the template's start, caches)
                seen[mode].append(got)
    finally:
        from rollcage.supervisor.warm import stop_templates

        stop_templates()  # it sits in the CPU group: the group can be removed once it is gone
    return seen


def _child(args: argparse.Namespace) -> None:
    """As the unprivileged user: the rounds, printed as one JSON line."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    assert os.geteuid() != 0, "the rounds must run as the unprivileged user"
    group = Path(args.group) if args.group else None
    with tempfile.TemporaryDirectory(prefix="rollcage-bench-nonroot-", dir=os.environ["HOME"]) as tmp:
        modes = args.modes.split(",")
        seen = asyncio.run(_rounds(modes, args.pairs, args.base_url, group, Path(tmp)))
    print(json.dumps(seen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=10, help="cold/warm pairs measured (after one to warm up)"
    )
    parser.add_argument(
        "--executors",
        metavar="BASELINE_PYTHON",
        help="compare forked executors (this checkout) with started ones (this interpreter's checkout)",
    )
    parser.add_argument("--rounds", type=int, default=4, help="with --executors: ABBA rounds of each side")
    parser.add_argument(
        "--ending",
        type=int,
        default=0,
        help="cells before the last that each end their executor: N + 1 executor starts per rollout",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--modes", default="cold,warm", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: it makes the unprivileged user and runs the rollouts as it")
    from tests.helpers.unprivileged import make_test_user, user_dir

    user = make_test_user()
    with user_dir(user) as home:
        script = home / "policy.json"
        cells = [ENDING] * args.ending + [CELL]
        script.write_text(json.dumps({"tasks": {"*": [*cells, {"text": "42"}]}}))
        with ModelServer(script, 0.0) as server:
            # Only after the model server is started: its CPU is no rollout's.
            group = CpuGroup.make("nonroot-start")
            try:
                if args.executors:
                    seen = _executor_rounds(args, user, home, server.base_url, group)
                else:
                    seen = _run(
                        user, home, sys.executable, ["--pairs", str(args.pairs)], server.base_url, group
                    )
            finally:
                if group is not None:
                    group.remove()
    if args.executors:
        _print_executors(seen, args, group is not None, user.name)
    else:
        _print(seen, args.pairs, group is not None, user.name)


def _run(
    user: Any, home: Path, python: str, words: list[str], base_url: str, group: CpuGroup | None
) -> dict[str, list[dict[str, Any]]]:
    """One process of the user's (``python`` running this file's rounds): what it read, by mode."""
    from tests.helpers.unprivileged import run_as

    argv = [python, __file__, "--child", *words, "--base-url", base_url]
    argv += ["--group", str(group.path) if group else ""]
    cgroups = [str(group.path / "cgroup.procs")] if group is not None else []
    done = run_as(user, argv, home=home, cgroups=cgroups, timeout_s=3600)
    if done.returncode != 0:
        raise SystemExit(f"the rounds failed:\n{done.stdout[-6000:]}")
    seen: dict[str, list[dict[str, Any]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return seen


def _executor_rounds(
    args: argparse.Namespace, user: Any, home: Path, base_url: str, group: CpuGroup | None
) -> dict[str, list[dict[str, Any]]]:
    """``--executors``: warm rollouts with started executors (the baseline's interpreter) and forked
    ones (this one), a process of each per round, in ABBA order."""
    sides = {"started": args.executors, "forked": sys.executable}
    seen: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for index in range(args.rounds):
        order = ["started", "forked"] if index % 2 == 0 else ["forked", "started"]
        for side in order:
            words = ["--modes", "warm", "--pairs", str(args.pairs)]
            seen[side] += _run(user, home, sides[side], words, base_url, group)["warm"]
    return seen


def _print(seen: dict[str, list[dict[str, Any]]], pairs: int, exact: bool, user: str) -> None:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in seen[mode]) * 1000

    load = os.getloadavg()
    print(
        f"non-root ({user}) rollout under bwrap, cold vs warm worker: {pairs} pairs (ABAB, after one each "
        f"to warm up), one rollout at a time; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print()
    print("| median, ms | cold | warm | warm / cold |")
    print("|---|---:|---:|---:|")
    for key, words in (
        ("start_s", "start to the first model request"),
        ("wall_s", "whole rollout (wall)"),
        ("cpu_s", "CPU per rollout"),
    ):
        cold, warm = median("cold", key), median("warm", key)
        print(f"| {words} | {cold:.1f} | {warm:.1f} | {warm / cold:.2f}x |")
    print()
    spread = {mode: [round(r["cpu_s"] * 1000, 1) for r in seen[mode]] for mode in seen}
    print(f"CPU ms per rollout, each: cold {spread['cold']}, warm {spread['warm']}")
    if not exact:
        print("no writable cgroup v1 cpuacct: CPU is the user's rusage (self + children), a lower bound")


def _print_executors(
    seen: dict[str, list[dict[str, Any]]], args: argparse.Namespace, exact: bool, user: str
) -> None:
    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in seen[side]) * 1000

    load = os.getloadavg()
    print(
        f"non-root ({user}) warm rollouts under bwrap, {args.ending + 1} python executions each, each in "
        f"an executor of its own ({args.ending} end theirs), started vs forked executors: {args.rounds} "
        f"rounds (ABBA) x {args.pairs} rollouts a side, one at a time; "
        f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    print()
    print("| median, ms | started (baseline) | forked | forked / started | saved |")
    print("|---|---:|---:|---:|---:|")
    for key, words in (
        ("start_s", "start to the first model request"),
        ("wall_s", "whole rollout (wall)"),
        ("cpu_s", "CPU per rollout"),
    ):
        started, forked = median("started", key), median("forked", key)
        print(
            f"| {words} | {started:.1f} | {forked:.1f} | {forked / started:.2f}x | {started - forked:.1f} |"
        )
    executions = args.ending + 1
    started, forked = median("started", "cpu_s") / executions, median("forked", "cpu_s") / executions
    print(
        f"| CPU per python execution (per rollout / {executions}) | {started:.1f} | {forked:.1f} | "
        f"{forked / started:.2f}x | {started - forked:.1f} |"
    )
    print()
    spread = {side: [round(r["cpu_s"] * 1000, 1) for r in seen[side]] for side in seen}
    print(f"CPU ms per rollout, each: started {spread['started']}, forked {spread['forked']}")
    if not exact:
        print("no writable cgroup v1 cpuacct: CPU is the user's rusage (self + children), a lower bound")


if __name__ == "__main__":
    main()
