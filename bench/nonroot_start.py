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
    pairs: int, base_url: str, group: Path | None, work: Path
) -> dict[str, list[dict[str, Any]]]:
    seen: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    try:
        for index, mode in enumerate(["cold", "warm"] * (pairs + 1)):
            got = await _one(mode, work / f"{mode}-{index}", base_url, group)
            if index >= 2:  # the first of each warms up (the template's start, caches)
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
        seen = asyncio.run(_rounds(args.pairs, args.base_url, group, Path(tmp)))
    print(json.dumps(seen))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=10, help="cold/warm pairs measured (after one to warm up)"
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return
    if os.geteuid() != 0:
        raise SystemExit("run as root: it makes the unprivileged user and runs the rollouts as it")
    from tests.helpers.unprivileged import make_test_user, run_as, user_dir

    user = make_test_user()
    with user_dir(user) as home:
        script = home / "policy.json"
        script.write_text(json.dumps({"tasks": {"*": [CELL, {"text": "42"}]}}))
        with ModelServer(script, 0.0) as server:
            # Only after the model server is started: its CPU is no rollout's.
            group = CpuGroup.make("nonroot-start")
            try:
                argv = [sys.executable, __file__, "--child", "--pairs", str(args.pairs)]
                argv += ["--base-url", server.base_url, "--group", str(group.path) if group else ""]
                cgroups = [str(group.path / "cgroup.procs")] if group is not None else []
                done = run_as(user, argv, home=home, cgroups=cgroups, timeout_s=3600)
            finally:
                if group is not None:
                    group.remove()
    if done.returncode != 0:
        raise SystemExit(f"the rounds failed:\n{done.stdout[-6000:]}")
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    _print(seen, args.pairs, group is not None, user.name)


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


if __name__ == "__main__":
    main()
