"""A GRPO-style training loop on ``rollcage.collect``, with the scripted policy: no GPU, no network.

Each step collects ``k`` rollouts of every task (the group), drops what must never
be trained on (infrastructure failures, timeouts, runs the controller stopped,
masked samples, model calls without complete token data), turns the rewards into
group-normalised advantages, ``(r - mean(group)) / (std(group) + eps)``, and
gathers, per model call, the prompt token ids, the sampled token ids and their
log probabilities into a batch: exactly what a policy-gradient update consumes.
The update itself is a stand-in (the REINFORCE surrogate loss is computed, not
applied): plug your trainer in ``train_step``.

The scripted policy plays a real OpenAI-compatible server on loopback, answering
with token ids and logprobs the way vLLM does when asked. Faults make the groups
worth learning from: one sample of each task answers wrongly (reward 0, so
advantages are not all zero), and one attempt fails for infrastructure reasons
(HTTP 503): it is retried by the run and its failed attempt filtered out here.

    .venv/bin/python examples/trainer_loop.py --steps 2 --k 4 [--sandbox none] [--out runs/grpo]

``--tree`` is the tree-structured variant: one rollout of each task (the trunk), then ``k``
branches of it from its last turn (``rollcage.branch``: the trunk's prefix is replayed from its
journal, never sent to the model again), advantages computed against the siblings, and only the
branches' own (live) model calls in the batch: the shared prefix is trained on once, by the trunk's
group elsewhere, not k times.

For a real model: ``model=`` the vLLM server's URL and ``model_name=``; the sampling
settings below ask vLLM for exactly these token fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import rollcage
from rollcage.policy import PolicyServer
from rollcage.protocol import RolloutRecord

TASKS = [("add", "2 + 3", "5"), ("mul", "4 * 5", "20"), ("sub", "9 - 7", "2")]
SAMPLING = {
    "temperature": 1.0,
    "logprobs": True,
    "top_logprobs": 0,
    # vLLM's fields for the prompt's and the completion's token ids.
    "extra_body": {"return_token_ids": True},
}
TRAINABLE = frozenset({"completed", "agent_error"})
"""Outcomes whose reward is the policy's (DESIGN.md's outcome table); the rest never reach the batch."""


def script() -> dict[str, Any]:
    """The scripted policy: compute with Python, then answer."""
    return {
        "model": "scripted-policy",
        "tasks": {
            name: [
                {
                    "reasoning": "Use Python.",
                    "tool_calls": [{"name": "python", "arguments": {"code": f"print({expr})"}}],
                },
                {"text": answer},
            ]
            for name, expr, answer in TASKS
        },
    }


def faults(k: int) -> list[str]:
    """Sample 1 of each task answers nothing (reward 0); one attempt meets an HTTP 503 (infrastructure)."""
    wrong = [f"rollout={name}-s1-t0:call=2:kind=empty" for name, _, _ in TASKS if k > 1]
    return [*wrong, f"rollout={TASKS[0][0]}-s0-t0:call=1:status=503"]


def rows() -> list[dict[str, Any]]:
    """The tasks, as dataset rows in memory."""
    return [
        {
            "id": name,
            "input": f"Compute {expr} with Python and answer with the number only.",
            "tools": ["python"],
            "agent": {"max_policy_calls": 4},
            # One model attempt per call: a 503 then ends the attempt as infra_failure, which the run retries.
            "model": {"sampling": SAMPLING, "max_retries": 0},
            "expected": answer,
            "grader": {"type": "exact"},
        }
        for name, expr, answer in TASKS
    ]


@dataclass(frozen=True)
class Sample:
    """One model call's tokens, as a policy-gradient step consumes them."""

    task_id: str
    rollout_id: str
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    advantage: float


@dataclass
class Batch:
    """A step's training batch and what was left out of it, and why."""

    samples: list[Sample]
    rewards: dict[str, list[float]]
    filtered: dict[str, int]


def advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO's group-normalised advantages."""
    mean = statistics.fmean(rewards)
    std = statistics.pstdev(rewards) if len(rewards) > 1 else 0.0
    return [(reward - mean) / (std + eps) for reward in rewards]


async def collect_batch(url: str, k: int, out: Path, sandbox: str) -> Batch:
    """Collect k rollouts per task and build the batch."""
    groups: dict[str, list[RolloutRecord]] = defaultdict(list)
    filtered: dict[str, int] = defaultdict(int)
    async with rollcage.collect(
        rows(), model=url, model_name="scripted-policy", attempts=k, out=out, sandbox=sandbox, concurrency=4
    ) as rollouts:
        async for record in rollouts:
            if record.outcome not in TRAINABLE or record.reward is None or record.masked:
                filtered[record.outcome] += (
                    1  # infrastructure failures are retried by the run, never trained on
                )
                continue
            groups[record.task_id].append(record)
    samples: list[Sample] = []
    rewards: dict[str, list[float]] = {}
    for task_id, members in groups.items():
        rewards[task_id] = [m.reward or 0.0 for m in members]
        for record, advantage in zip(members, advantages(rewards[task_id]), strict=True):
            result = record.result()
            calls = result.trajectory.model_calls if result is not None else []
            for call in calls:
                tokens = call.tokens
                if tokens.status != "observed" or tokens.scope != "generation":
                    filtered["calls without token data"] += 1
                    continue
                assert tokens.prompt_token_ids is not None and tokens.generation_token_ids is not None
                assert tokens.generation_log_probs is not None
                samples.append(
                    Sample(
                        task_id=task_id,
                        rollout_id=record.rollout_id,
                        prompt_token_ids=tokens.prompt_token_ids,
                        completion_token_ids=tokens.generation_token_ids,
                        logprobs=tokens.generation_log_probs,
                        advantage=advantage,
                    )
                )
    return Batch(samples=samples, rewards=rewards, filtered=dict(filtered))


def _samples(task_id: str, record: RolloutRecord, advantage: float, filtered: dict[str, int]) -> list[Sample]:
    """The record's model calls with complete token data, each with the record's advantage.

    A branch's calls answered from its source's journal (``resumed_from``) are the shared prefix: left out.
    """
    result = record.result()
    if result is None:
        return []
    resumed = result.trajectory.resumed_from
    replayed = set(resumed.replayed_model_calls) if record.branched_from and resumed else set()
    samples: list[Sample] = []
    for call in result.trajectory.model_calls:
        if call.id in replayed:
            continue
        tokens = call.tokens
        if tokens.status != "observed" or tokens.scope != "generation":
            filtered["calls without token data"] += 1
            continue
        assert tokens.prompt_token_ids is not None and tokens.generation_token_ids is not None
        assert tokens.generation_log_probs is not None
        samples.append(
            Sample(
                task_id=task_id,
                rollout_id=record.rollout_id,
                prompt_token_ids=tokens.prompt_token_ids,
                completion_token_ids=tokens.generation_token_ids,
                logprobs=tokens.generation_log_probs,
                advantage=advantage,
            )
        )
    return samples


async def collect_tree_batch(url: str, k: int, out: Path, sandbox: str) -> Batch:
    """One trunk per task, k branches of each from its last turn; advantages against the siblings."""
    from rollcage.controller import plan_branches

    filtered: dict[str, int] = defaultdict(int)
    trunks: list[RolloutRecord] = []
    async with rollcage.collect(
        rows(), model=url, model_name="scripted-policy", out=out / "trunks", sandbox=sandbox, concurrency=4
    ) as rollouts:
        async for record in rollouts:
            if record.outcome in TRAINABLE and record.reward is not None:
                trunks.append(record)
            else:
                filtered[record.outcome] += 1
    groups: dict[str, list[RolloutRecord]] = defaultdict(list)
    contained: Literal["bwrap", "none"] = "none" if sandbox == "none" else "bwrap"
    for trunk in trunks:
        where = out / f"branches-{trunk.task_id}"
        # The branches' live part on a server of its own, whose faults know their ids: branch 1 of each
        # trunk answers nothing (reward 0), so the siblings' advantages are not all zero.
        plan = await asyncio.to_thread(plan_branches, trunk, at="last-turn", k=k, out=where, tasks=rows())
        wrong = [f"rollout={p.rollout_id}:call=1:kind=empty" for p in plan.prepared if p.sample == 1]
        server = await asyncio.to_thread(PolicyServer(script(), faults=wrong).start)
        try:
            async for record in rollcage.branch(
                trunk, at="last-turn", k=k, out=where, tasks=rows(), model=server.base_url, sandbox=contained
            ):
                if record.outcome not in TRAINABLE or record.reward is None or record.masked:
                    filtered[record.outcome] += 1
                    continue
                groups[trunk.task_id].append(record)
        finally:
            await asyncio.to_thread(server.stop)
    samples: list[Sample] = []
    rewards: dict[str, list[float]] = {}
    for task_id, members in groups.items():
        rewards[task_id] = [m.reward or 0.0 for m in members]
        for record, advantage in zip(members, advantages(rewards[task_id]), strict=True):
            samples += _samples(task_id, record, advantage, filtered)
    return Batch(samples=samples, rewards=rewards, filtered=dict(filtered))


def train_step(batch: Batch) -> float:
    """The REINFORCE surrogate loss, ``-mean(A * sum(logprobs))`` (a stand-in for a real update)."""
    if not batch.samples:
        return 0.0
    return -statistics.fmean(sample.advantage * math.fsum(sample.logprobs) for sample in batch.samples)


async def main(argv: list[str]) -> dict[str, Any]:
    """Run the loop; return what each step saw."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--steps", type=int, default=2, help="training steps")
    parser.add_argument("--k", type=int, default=4, help="rollouts per task (the group size)")
    parser.add_argument("--sandbox", choices=["bwrap", "none"], default="bwrap")
    parser.add_argument(
        "--tree", action="store_true", help="k branches of one trunk per task (rollcage.branch)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/trainer-loop"), help="one run directory per step"
    )
    args = parser.parse_args(argv)
    steps: list[dict[str, Any]] = []
    for step in range(args.steps):
        # A fresh server per step, as a trainer serves each step's weights (and its faults count afresh);
        # it starts and stops on a thread, off the event loop.
        server = await asyncio.to_thread(PolicyServer(script(), faults=faults(args.k)).start)
        try:
            collect_fn = collect_tree_batch if args.tree else collect_batch
            batch = await collect_fn(server.base_url, args.k, args.out / f"step-{step}", args.sandbox)
        finally:
            await asyncio.to_thread(server.stop)
        loss = train_step(batch)
        steps.append(
            {
                "step": step,
                "samples": len(batch.samples),
                "rewards": batch.rewards,
                "filtered": batch.filtered,
                "loss": loss,
                "completion_tokens": sum(len(s.completion_token_ids) for s in batch.samples),
                "aligned": all(len(s.completion_token_ids) == len(s.logprobs) for s in batch.samples),
                "group_advantage_sums": {
                    task: math.fsum(s.advantage for s in batch.samples if s.task_id == task)
                    for task in batch.rewards
                },
            }
        )
        print(
            f"step {step}: {len(batch.samples)} samples, mean reward "
            f"{statistics.fmean(r for rs in batch.rewards.values() for r in rs):.3f}, "
            f"filtered {batch.filtered}, loss {loss:.4f}",
            file=sys.stderr,
        )
    return {"steps": steps}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1:]))))
