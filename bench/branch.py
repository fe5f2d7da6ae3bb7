"""Benchmark (not a test): what branching a rollout saves over fresh rollouts (issue 42).

A 20-call source rollout (19 python cells that build on each other, then the answer) is run
once through ``rollcage run``. Then, on the same scripted policy (every model request takes
``--latency`` seconds, standing in for generation time) and the same sandbox:

* ``fresh``: 8 new rollouts of the task (``attempts=8``) from turn 1;
* ``branch``: ``rollcage.branch(source, at="turn:T", k=8)``: 8 branches that replay the first
  ``T`` model calls from the source's journal (their cells re-run) and make the rest live.

Reported: model calls the server answered, tokens those calls cost (the records' metrics, which
count only calls made live), and wall time. Goal: model calls and tokens in proportion to the
suffix only, ``(20 - T) / 20`` of the fresh runs'. For wall time the issue's goal, that share of
the fresh runs' wall plus the replay, is printed, and beside it the one a branch can meet: a
branch is a rollout of its own and pays a rollout's fixed cost (sandbox and executor start,
grading, workspace diff) in full, as each fresh rollout does, so only the fresh runs' time *beyond*
that fixed cost shrinks to the suffix's share. The fixed cost ``F`` is measured in the same
process: the same 8 fresh rollouts against a policy that answers at once.

    python bench/branch.py                        # bwrap, T=10, 0.1 s per model call
    python bench/branch.py --turn 15 --latency 0.5 --out bench/results/2026-12-06-branch.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CALLS = 20
K = 8
TURNS: list[dict[str, Any]] = [
    {"tool_calls": [{"name": "python", "arguments": {"code": "x = 0\nprint(x)"}}]},
    *(
        {"tool_calls": [{"name": "python", "arguments": {"code": f"x = x + {i}\nprint(x)"}}]}
        for i in range(1, CALLS - 1)
    ),
    {"text": "171"},
]
SCRIPT = {"tasks": {"*": TURNS}}


def _dataset(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    row = {
        "id": "long",
        "input": "Add up 1..18 one cell at a time.",
        "tools": ["python"],
        "model": {"max_retries": 0, "timeout_s": 60},
        "agent": {"max_policy_calls": CALLS + 5, "tool_timeout_s": 30},
        "expected": "171",
    }
    path = directory / "dataset.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


async def _run(data: Path, out: Path, base_url: str, sandbox: str, attempts: int) -> list[Any]:
    from rollcage.controller import Controller, ModelEndpointConfig, RunConfig
    from rollcage.protocol import RolloutRecord

    config = RunConfig(
        dataset=data,
        out=out,
        model=ModelEndpointConfig(base_url=base_url, model_name="scripted"),
        sandbox=sandbox,
        attempts=attempts,
        concurrency=K,
        deadline_s=600,
        max_infra_retries=0,
    )
    await Controller(config).run()
    return [RolloutRecord.model_validate_json(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]


def _asked(server: Any) -> int:
    """Model requests the server has answered so far (the source's, fresh ones and branches' share ids)."""
    return sum(server.requests.values())


def _suffix_tokens(records: list[Any], turn: int) -> int:
    """Tokens of the fresh rollouts' model calls from ``turn`` on: what the branches' live calls repeat."""
    total = 0
    for record in records:
        result = record.result()
        if result is not None:
            total += sum(c.usage.total_tokens or 0 for c in result.trajectory.model_calls if c.index >= turn)
    return total


def _replay_s(records: list[Any]) -> float:
    """Mean time a branch took from its journal's start to the end of its replay (its ``resumed`` marker)."""
    from rollcage.durable import read_journal

    spans: list[float] = []
    for record in records:
        journal = read_journal(Path(record.rollout_dir) / "checkpoint.jsonl")
        start = next(r["at"] for r in journal if r["kind"] == "start")
        spans += [r["at"] - start for r in journal if r["kind"] == "resumed"]
    return sum(spans) / len(spans) if spans else 0.0


def _row(name: str, calls: int, records: list[Any], wall: float) -> dict[str, Any]:
    tokens = sum(r.metrics.total_tokens or 0 for r in records)
    rewards = [r.reward for r in records]
    return {"scenario": name, "model_calls": calls, "tokens": tokens, "wall_s": wall, "rewards": rewards}


async def _main(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rollcage.controller import branch
    from rollcage.policy import PolicyServer

    with tempfile.TemporaryDirectory(prefix="rollcage-bench-branch-") as tmp:
        root = Path(tmp)
        data = _dataset(root / "data")
        with PolicyServer(SCRIPT, faults=[f"kind=latency:delay={args.latency}"]) as server:
            (source,) = await _run(data, root / "source", server.base_url, args.sandbox, 1)
            with PolicyServer(SCRIPT) as instant:
                started = time.perf_counter()
                await _run(data, root / "fixed", instant.base_url, args.sandbox, K)
                fixed_wall = time.perf_counter() - started
            assert source.outcome == "completed", source.receipt.outcome_reason
            asked = _asked(server)
            started = time.perf_counter()
            fresh = await _run(data, root / "fresh", server.base_url, args.sandbox, K)
            fresh_wall = time.perf_counter() - started
            fresh_calls, asked = _asked(server) - asked, _asked(server)
            started = time.perf_counter()
            branches = [
                r
                async for r in branch(
                    source,
                    at=f"turn:{args.turn}",
                    k=K,
                    out=root / "branches",
                    tasks=data,
                    sandbox=args.sandbox,
                    deadline_s=600,
                )
            ]
            branch_wall = time.perf_counter() - started
            branch_calls = _asked(server) - asked
            rows = [
                _row("fresh x8", fresh_calls, fresh, fresh_wall),
                _row(f"branch k=8 at turn {args.turn}", branch_calls, branches, branch_wall),
            ]
            rows[0]["suffix_tokens"] = await asyncio.to_thread(_suffix_tokens, fresh, args.turn)
            rows[1]["replayed_model_calls"] = sum(r.metrics.replayed_model_calls for r in branches)
            rows[1]["replay_s"] = await asyncio.to_thread(_replay_s, branches)
            rows[0]["fixed_s"] = fixed_wall
    return rows


def _met_goal(fresh: dict[str, Any], branched: dict[str, Any], share: float) -> float:
    """F + share x (fresh wall - F) + replay: the suffix's share of everything but the fixed cost."""
    fixed = float(fresh["fixed_s"])
    return fixed + share * (float(fresh["wall_s"]) - fixed) + float(branched["replay_s"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turn", type=int, default=10, help="the branches' first live model call (T)")
    parser.add_argument("--latency", type=float, default=0.1, help="seconds per model request")
    parser.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap")
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args()
    rows = asyncio.run(_main(args))
    fresh, branched = rows
    share = (CALLS - args.turn) / CALLS
    lines = [
        f"{CALLS}-call rollout, k={K} from turn {args.turn} vs {K} fresh rollouts; "
        f"{args.latency:.2f} s per model request; sandbox {args.sandbox}",
        "",
        "| scenario | model calls | tokens | wall s | rewards |",
        "|---|---:|---:|---:|---|",
        *(
            f"| {r['scenario']} | {r['model_calls']} | {r['tokens']} | {r['wall_s']:.1f} | "
            f"{sorted(set(r['rewards']), key=str)} |"
            for r in rows
        ),
        "",
        f"branch / fresh: model calls {branched['model_calls'] / max(fresh['model_calls'], 1):.3f}, "
        f"tokens {branched['tokens'] / max(fresh['tokens'], 1):.3f} "
        f"(the fresh runs' calls from turn {args.turn} on cost {fresh['suffix_tokens']} tokens: every later "
        "prompt repeats the prefix), "
        f"wall {branched['wall_s'] / max(fresh['wall_s'], 1e-9):.3f} (suffix share {share:.3f}); "
        f"{branched['replayed_model_calls']} model calls answered from the source's journal",
        "",
        f"goal: branch wall <= {share:.3f} x fresh wall + replay = {share * fresh['wall_s']:.2f} + "
        f"{branched['replay_s']:.2f} s (mean replay: a branch's journal start to its resumed marker, the "
        f"prefix's {args.turn} cells re-run) = {share * fresh['wall_s'] + branched['replay_s']:.2f} s; "
        f"measured {branched['wall_s']:.2f} s",
        "",
        f"fixed cost F (the same {K} fresh rollouts, the policy answering at once): "
        f"{fresh['fixed_s']:.2f} s; "
        f"goal a branch can meet: F + {share:.3f} x (fresh wall - F) + replay = "
        f"{_met_goal(fresh, branched, share):.2f} s; measured {branched['wall_s']:.2f} s "
        f"({'met' if branched['wall_s'] <= _met_goal(fresh, branched, share) else 'NOT met'})",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
