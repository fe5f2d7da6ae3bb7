"""Benchmark (not a test): what resuming a rollout from its journal saves (issue 19).

A 20-call rollout (19 python cells that build on each other, then the answer) is
interrupted once its 15th model call has completed, while its 16th is in flight,
and retried. Every model request takes ``--latency`` seconds on the scripted
policy (standing in for generation time). Two interruptions are measured, each
retried with and without resuming, against an uninterrupted run in the same process:

* ``worker SIGKILL``: the worker process is SIGKILLed (sandbox none, the worker
  run directly); the retry is a new worker given the journal (``input.json``
  ``resume``), or not;
* ``infra_failure``: through ``rollcage run`` (the controller, the supervisor and
  the sandbox of ``--sandbox``), the model answers the 16th call of the first
  attempt with a 503, the attempt ends ``infra_failure`` and is retried with
  ``resume_rollouts`` on or off; the retry's ``RolloutRecord`` says what it saved.

Target: the resumed retry costs 5 model calls, not 20, and its record says so.

    python bench/resume.py                       # bwrap, 0.2 s per model call
    python bench/resume.py --sandbox none --latency 0.5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CALLS = 20
DONE = 15
TURNS: list[dict[str, Any]] = [
    {"tool_calls": [{"name": "python", "arguments": {"code": "x = 0\nprint(x)"}}]},
    *(
        {"tool_calls": [{"name": "python", "arguments": {"code": f"x = x + {i}\nprint(x)"}}]}
        for i in range(1, CALLS - 1)
    ),
    {"text": "171"},
]
SCRIPT = {"tasks": {"*": TURNS}}


def _worker_input(base_url: str, rollout_id: str, resume: str | None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "rollout_id": rollout_id,
        "task_id": "long",
        "input": "Add up 1..18 one cell at a time.",
        "model": {"base_url": base_url, "model": "scripted", "timeout_s": 60, "max_retries": 0},
        "agent": {"max_policy_calls": CALLS + 5, "tool_timeout_s": 30},
        "tools": [{"type": "python"}],
    }
    if resume is not None:
        data["resume"] = {"previous_rollout_id": resume}
    return data


def _journal_kinds(path: Path) -> list[dict[str, Any]]:
    from rollcage.durable import read_journal

    try:
        return read_journal(path)
    except (OSError, ValueError):
        return []


def _start_worker(directory: Path, data: dict[str, Any]) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "input.json").write_text(json.dumps(data))
    log = (directory / "worker.log").open("ab")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollcage",
            "worker",
            str(directory / "input.json"),
            str(directory / "result.json"),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _worker_scenario(root: Path, latency: float) -> list[dict[str, Any]]:
    from rollcage.policy import PolicyServer
    from rollcage.protocol import WorkerResult

    rows: list[dict[str, Any]] = []
    # The first matching rule applies: the specific one first.
    faults = [f"rollout=w-0:call={DONE + 1}:kind=hang", f"kind=latency:delay={latency}"]
    with PolicyServer(SCRIPT, faults=faults) as server:
        started = time.monotonic()
        base = _start_worker(root / "base", _worker_input(server.base_url, "w-base", None))
        base.wait(timeout=600)
        rows.append(
            _row("worker: uninterrupted", server.requests.get("w-base", 0), time.monotonic() - started)
        )
        first = _start_worker(root / "w-0", _worker_input(server.base_url, "w-0", None))
        journal = root / "w-0" / "checkpoint.jsonl"
        deadline = time.monotonic() + 600
        while not server.faults_injected or not any(
            r.get("kind") == "turn_start" and r["turn"]["index"] == DONE for r in _journal_kinds(journal)
        ):
            if time.monotonic() > deadline or first.poll() is not None:
                raise SystemExit(f"the first attempt did not reach call {DONE + 1}")
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        for resume in (False, True):
            rid = f"w-{'resume' if resume else 'fresh'}"
            directory = root / rid
            directory.mkdir()
            if resume:
                (directory / "resume.jsonl").write_bytes(journal.read_bytes())
            started = time.monotonic()
            proc = _start_worker(directory, _worker_input(server.base_url, rid, "w-0" if resume else None))
            proc.wait(timeout=600)
            result = WorkerResult.model_validate_json((directory / "result.json").read_bytes())
            assert result.response is not None and result.response.output_text == "171", result
            saved = result.trajectory.resumed_from
            rows.append(
                _row(
                    f"worker SIGKILL after call {DONE}: retry {'resumed' if resume else 'from scratch'}",
                    server.requests.get(rid, 0),
                    time.monotonic() - started,
                    said=f"resumed_from: {len(saved.replayed_model_calls)} calls replayed" if saved else "-",
                )
            )
    return rows


async def _controller_run(
    root: Path, base_url: str, sandbox: str, resume: bool
) -> tuple[float, list[Any], Any]:
    from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
    from rollcage.protocol import RolloutRecord

    dataset = root / "dataset.jsonl"
    row: dict[str, Any] = {
        "id": "long",
        "input": "Add up 1..18 one cell at a time.",
        "tools": ["python"],
        "expected": "171",
        "agent": {"max_policy_calls": CALLS + 5},
        "model": {"max_retries": 0, "timeout_s": 60},
    }
    dataset.write_text(json.dumps(row) + "\n")
    out = root / ("out-resume" if resume else "out-fresh")
    config = RunConfig(
        dataset=dataset,
        out=out,
        model=ModelEndpointConfig(base_url=base_url, model_name="scripted"),
        sandbox=sandbox,
        deadline_s=600,
        retry_backoff_s=0,
        resume_rollouts=resume,
    )
    started = time.monotonic()
    summary = await Controller(config).run()
    wall = time.monotonic() - started
    records = [
        RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()
    ]
    return wall, records, summary.metrics


def _controller_scenario(root: Path, latency: float, sandbox: str) -> list[dict[str, Any]]:
    from rollcage.controller._ids import rollout_id
    from rollcage.policy import PolicyServer

    first, retry = rollout_id("long", 0, 0), rollout_id("long", 0, 1)
    rows: list[dict[str, Any]] = []
    for resume in (False, True):
        faults = [f"rollout={first}:call={DONE + 1}:status=503", f"kind=latency:delay={latency}"]
        with PolicyServer(SCRIPT, faults=faults) as server:
            directory = root / f"controller-{resume}"
            directory.mkdir()
            wall, records, metrics = asyncio.run(_controller_run(directory, server.base_url, sandbox, resume))
            attempt, retried = records
            assert attempt.outcome == "infra_failure" and retried.reward == 1.0, records
            link = retried.resume
            said = (
                f"record.resume: resumed={link.resumed}, replayed={link.replayed_model_calls}; metrics: "
                f"resumed_rollouts={metrics.resumed_rollouts}, model_calls_saved={metrics.model_calls_saved}"
                if link is not None
                else "record.resume: None"
            )
            how = "resumed" if resume else "from scratch"
            rows.append(
                _row(
                    f"{sandbox} infra_failure at call {DONE + 1}: retry {how}",
                    server.requests.get(retry, 0),
                    retried.receipt.duration_s,
                    said=said,
                    total=wall,
                    tokens=metrics.tokens.total_tokens,
                )
            )
    return rows


def _row(name: str, calls: int, seconds: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "calls": calls, "seconds": seconds, **extra}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap")
    parser.add_argument("--latency", type=float, default=0.2, help="seconds per model request")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rollcage-bench-resume-") as tmp:
        root = Path(tmp)
        rows = _worker_scenario(root / "worker", args.latency)
        rows += _controller_scenario(root, args.latency, args.sandbox)
    print(f"{CALLS}-call rollout, interrupted after call {DONE}; {args.latency:.2f} s per model request")
    print(f"{'scenario':<58} {'model calls':>11} {'retry s':>8}  what the record says")
    for row in rows:
        print(f"{row['name']:<58} {row['calls']:>11} {row['seconds']:>8.2f}  {row.get('said', '')}")
    fresh = [r for r in rows if "from scratch" in r["name"]]
    resumed = [r for r in rows if "resumed" in r["name"]]
    for a, b in zip(fresh, resumed, strict=True):
        print(
            f"ratio ({b['name'].split(':')[0]}): resumed/fresh model calls {b['calls']}/{a['calls']} = "
            f"{b['calls'] / a['calls']:.2f}, retry time {b['seconds'] / a['seconds']:.2f}x"
        )
    tokens = [r for r in rows if "tokens" in r]
    if tokens:
        print(
            "run token totals (each call counted once): "
            + ", ".join(f"{r['name'].split(':')[1].strip()}: {r['tokens']}" for r in tokens)
        )


if __name__ == "__main__":
    main()
