"""Cost of one worker process: start to first model request, CPU, and peak memory.

Runs the real ``rollcage worker`` subprocess against the scripted policy on
loopback, for a one-turn rollout and for a CodeAct rollout with three cells, with
each executor backend, next to a bare ``python -c pass`` in the same run.

Targets (issue 4): first model request within 200 ms of process start; the worker
plus a ``repl`` executor under 60 MB together.

    .venv/bin/python bench/worker.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rollcage.policy import PolicyServer

# The last cell reports the peak RSS of the executor (itself) and of the worker (its parent).
_MEASURE = (
    "import os\n"
    "def _hwm(pid):\n"
    "    for line in open(f'/proc/{pid}/status'):\n"
    "        if line.startswith('VmHWM'):\n"
    "            return int(line.split()[1])\n"
    "submit(f'{_hwm(os.getpid())},{_hwm(os.getppid())}')"
)
SCRIPT: dict[str, Any] = {
    "tasks": {
        "one-turn": [{"text": "done"}],
        "codeact": [
            {"code": "x = sum(range(1000))\nx"},
            {"code": "y = [i * i for i in range(100)]\nlen(y)"},
            {"code": _MEASURE},
        ],
    }
}


def _input(base_url: str, task: str, backend: str, root: Path) -> Path:
    data = {
        "rollout_id": f"{task}-{backend}",
        "task_id": task,
        "input": "go",
        "model": {"base_url": base_url, "model": "scripted", "max_retries": 0},
        "agent": {"mode": "codeact" if task == "codeact" else "function_calling"},
        "executor": {"backend": backend},
        "tools": [{"type": "python"}] if task == "codeact" else [],
        "checkpoint": {"enabled": True},
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "input.json"
    path.write_text(json.dumps(data))
    return path


def _run_worker(
    server: PolicyServer, task: str, backend: str, root: Path, *, caged: bool = False
) -> dict[str, float]:
    inp = _input(server.base_url, task, backend, root)
    # A caged executor runs in a nested bwrap, as under the supervisor (rollcage.cage).
    env = {**os.environ, "ROLLCAGE_EXECUTOR_CAGE": "bwrap" if caged else "none"}
    seen = len(server.request_log)
    started = time.time()
    before = os.times()
    proc = subprocess.run(
        [sys.executable, "-m", "rollcage", "worker", str(inp), str(root / "result.json")],
        capture_output=True,
        timeout=120,
        env=env,
    )
    after = os.times()
    wall = time.time() - started
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({proc.returncode}):\n{proc.stderr.decode()[-2000:]}")
    first = server.request_log[seen].at - started
    row = {
        "first_request_ms": first * 1000,
        "wall_ms": wall * 1000,
        "cpu_s": (after.children_user - before.children_user)
        + (after.children_system - before.children_system),
    }
    if task == "codeact":
        result = json.loads((root / "result.json").read_text())
        executor_kb, worker_kb = (int(v) for v in result["response"]["output_text"].split(","))
        row["executor_rss_mb"] = executor_kb / 1024
        if not caged:  # in the cage the executor's parent is the cage's init, not the worker
            row["worker_rss_mb"] = worker_kb / 1024
            row["together_mb"] = (worker_kb + executor_kb) / 1024
    return row


def _bare(runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per row (medians are printed)")
    args = parser.parse_args()
    backends = ["repl"]
    try:
        import ipykernel  # noqa: F401
        import jupyter_client  # noqa: F401

        backends.append("jupyter")
    except ImportError:
        print("jupyter extra not installed: the jupyter rows are skipped")
    bare = _bare(args.runs)
    rows: list[tuple[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp, PolicyServer(SCRIPT) as server:
        cases = [("one-turn", "repl", False)]
        cases += [("codeact", backend, caged) for backend in backends for caged in (False, True)]
        for task, backend, caged in cases:
            name = f"{task} ({backend}{', caged' if caged else ''})"
            samples = [
                _run_worker(server, task, backend, Path(tmp) / f"{name}-{i}", caged=caged)
                for i in range(args.runs)
            ]
            med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
            rows.append((name, med))
    print(f"\nbare `python -c pass`: {bare:.0f} ms (median of {args.runs})\n")
    header = f"{'rollout':<28}{'first req ms':>14}{'x bare':>8}{'wall ms':>10}{'cpu s':>8}"
    header += f"{'worker MB':>11}{'executor MB':>13}{'together MB':>13}"
    print(header)
    print("-" * len(header))
    for name, r in rows:
        line = f"{name:<28}{r['first_request_ms']:>14.0f}{r['first_request_ms'] / bare:>8.1f}"
        line += f"{r['wall_ms']:>10.0f}{r['cpu_s']:>8.2f}"
        if "together_mb" in r:
            line += f"{r['worker_rss_mb']:>11.1f}{r['executor_rss_mb']:>13.1f}{r['together_mb']:>13.1f}"
        elif "executor_rss_mb" in r:
            line += f"{'-':>11}{r['executor_rss_mb']:>13.1f}{'-':>13}"
        print(line)
    print("\ntargets: first model request <= 200 ms; worker + repl executor < 60 MB")


if __name__ == "__main__":
    main()
