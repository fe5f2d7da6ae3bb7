"""Benchmark (not a test): a harness rollout's start, its worker started cold against forked warm.

A harness rollout (``agent.harness``: a command or NOOA) relays the boundaries its harness
reports to the supervisor through a pipe; its worker used to be started cold for it (a fresh
interpreter and the worker's imports in every rollout), and is now forked from the warm
template with the relay passed along. This runs the same small command harness (one model
call, one reported tool call, one more model call, an answer) under ``supervise()`` in this
process, rollouts one at a time, cold and warm in turn (ABAB, after one of each to warm up:
the template's start, the bytecode cache, the page cache), and reads per rollout:

* **start** — from the supervision's start (the receipt's ``started_at``) to the harness's
  first model request reaching the egress proxy (the capture's first ``started_at``): the
  sandbox, the worker, its forwarder and the harness's own interpreter;
* **wall** — the whole supervision (the receipt's ``duration_s``);
* **CPU** — of everything but the model server (which runs in a process of its own): this
  process and every process it starts (bubblewrap, the template and the executor template,
  the worker, the harness) sit in a cgroup v1 ``cpuacct`` group of their own, and its
  ``cpuacct.usage`` is read before and after each rollout; the rollouts' own cgroups are
  below it. Without a writable cpuacct hierarchy it is this process's rusage (self and
  children), a lower bound, and the output says so.

Medians, and warm / cold for each. Needs bubblewrap (``--sandbox bwrap``, the default) and the
harness environment the tests install (``tests/helpers/harness_env.py``; ``--harness-env`` to name
another, ``--harness-env none`` for none: the harness is this interpreter).

Three paths, each warm against cold in the same process: bubblewrap as root (the default),
``--sandbox none`` (the worker forked beside a holder, uncaged), and ``--as-user`` (bubblewrap
without root: this script again as the unprivileged test user, ``tests/helpers/unprivileged.py``,
with ``--harness-env none``; CPU is then rusage, a lower bound, since no cgroup is writable there).

    .venv/bin/python bench/harness_start.py [--pairs 10] [--sandbox none] [--as-user]
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
import textwrap
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _measure import CpuGroup, ModelServer, cpu_s

HARNESS = """
import json, os, urllib.request
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
def ask():
    body = {"model": os.environ["ROLLCAGE_MODEL"], "messages": [{"role": "user", "content": "hi"}]}
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        },
        method="POST",
    )
    with OPENER.open(request, timeout=60) as response:
        response.read()
events = int(os.environ["ROLLCAGE_EVENTS_FD"])
def report(**event):
    os.write(events, (json.dumps(event) + "\\n").encode())
ask()
report(type="tool_start", id="c1", name="probe", arguments="{}")
report(type="tool_end", id="c1", status="completed", output="ok")
ask()
report(type="answer", text="done")
"""


def _input(root: Path, base_url: str, harness_env: dict[str, Any] | None) -> None:
    (root / "workspace").mkdir(parents=True)
    data = {
        "rollout_id": root.name,
        "task_id": "t",
        "input": "go",
        "model": {"base_url": base_url, "model": "m", "max_retries": 0},
        "agent": {
            "max_policy_calls": 4,
            "harness": {
                "type": "command",
                # Without an environment, this interpreter (its directory is on the worker's PATH too).
                "argv": ["python" if harness_env else sys.executable, "-c", textwrap.dedent(HARNESS)],
                "answer": "events",
            },
        },
        **({"harness_env": harness_env} if harness_env else {}),
    }
    (root / "input.json").write_text(json.dumps(data))


def _cpu(group: CpuGroup | None) -> float:
    if group is not None:
        return group.usage_s()
    return cpu_s(resource.getrusage(resource.RUSAGE_SELF)) + cpu_s(
        resource.getrusage(resource.RUSAGE_CHILDREN)
    )


async def _one(
    mode: str,
    root: Path,
    base_url: str,
    harness_env: dict[str, Any] | None,
    group: CpuGroup | None,
    sandbox: str,
) -> dict[str, Any]:
    from rollcage.supervisor import BwrapSandbox, NoSandbox, ProxyConfig, SupervisorConfig, supervise

    _input(root, base_url, harness_env)
    chosen = NoSandbox(worker_start=mode) if sandbox == "none" else BwrapSandbox(worker_start=mode)
    config = SupervisorConfig(deadline_s=120, proxy=ProxyConfig(), sandbox=chosen)
    before = _cpu(group)
    receipt = await supervise(root, config)
    cpu = _cpu(group) - before
    if receipt.outcome != "completed":
        raise SystemExit(f"a {mode} rollout did not complete: {receipt.outcome}: {receipt.outcome_reason}")
    first = json.loads((root / "model_capture.jsonl").read_text().splitlines()[0])
    return {"start_s": first["started_at"] - receipt.started_at, "wall_s": receipt.duration_s, "cpu_s": cpu}


def _harness_env(path: str | None) -> dict[str, Any] | None:
    from rollcage.harness import resolve_environment

    if path == "none":
        return None
    if path is None:
        from tests.helpers.harness_env import prepare_harness_envs

        found = prepare_harness_envs().env
    else:
        found = Path(path)
    env = resolve_environment("command", found)
    if env is None:
        raise SystemExit(f"no harness environment at {found}")
    return env.model_dump()


async def _run(
    args: argparse.Namespace, base_url: str, group: CpuGroup | None, work: Path
) -> dict[str, list[dict[str, Any]]]:
    harness_env = _harness_env(args.harness_env)
    seen: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    order = ["cold", "warm"] * (args.pairs + 1)
    try:
        for index, mode in enumerate(order):
            got = await _one(mode, work / f"{mode}-{index}", base_url, harness_env, group, args.sandbox)
            if index >= 2:  # the first of each warms up (the template's start, caches)
                seen[mode].append(got)
    finally:
        from rollcage.supervisor.warm import stop_templates

        stop_templates()  # they sit in the CPU group: it can be removed once they are gone
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--pairs", type=int, default=10, help="cold/warm pairs measured (after one to warm up)"
    )
    parser.add_argument(
        "--harness-env",
        help="the harness environment (default: the tests' cached one; none: this interpreter)",
    )
    parser.add_argument("--sandbox", choices=("bwrap", "none"), default="bwrap", help="the rollouts' sandbox")
    parser.add_argument(
        "--as-user", action="store_true", help="run as the unprivileged test user (bubblewrap without root)"
    )
    args = parser.parse_args()
    if args.as_user:
        _rerun_as_user(args)
        return
    import logging

    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="rollcage-bench-harness-") as tmp:
        work = Path(tmp)
        script = work / "policy.json"
        script.write_text(json.dumps({"tasks": {"*": [{"text": "again"}, {"text": "again"}]}}))
        with ModelServer(script, 0.0) as server:
            # Only after the model server is started: its CPU is no rollout's.
            group = CpuGroup.make("harness-start")
            if group is not None:
                group.enter()
            try:
                seen = asyncio.run(_run(args, server.base_url, group, work))
            finally:
                if group is not None:
                    with open(CpuGroup.ROOT / "cgroup.procs", "w") as handle:
                        handle.write(str(os.getpid()))
                    group.remove()
    _print(seen, args.pairs, group is not None, args.sandbox)


def _rerun_as_user(args: argparse.Namespace) -> None:
    """This script again, as the unprivileged test user, its table printed here."""
    from tests.helpers.unprivileged import make_test_user, run_as, user_dir

    user = make_test_user()
    with user_dir(user) as home:
        argv = [sys.executable, __file__, "--pairs", str(args.pairs), "--sandbox", args.sandbox]
        done = run_as(user, [*argv, "--harness-env", "none"], home=home, timeout_s=3000)
    print(f"(as {user.name}, uid {user.uid})")
    print(done.stdout, end="")
    if done.returncode != 0:
        raise SystemExit(done.returncode)


def _print(seen: dict[str, list[dict[str, Any]]], pairs: int, exact: bool, sandbox: str) -> None:
    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in seen[mode]) * 1000

    load = os.getloadavg()
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    print(
        f"harness rollout start, cold vs warm worker, --sandbox {sandbox}, {who}: {pairs} pairs "
        "(ABAB, after one each to warm up), "
        f"one rollout at a time; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
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
        print("no writable cgroup v1 cpuacct: CPU is this process's rusage (self + children), a lower bound")


if __name__ == "__main__":
    main()
