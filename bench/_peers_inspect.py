"""Inspect AI's side of ``bench/peers.py`` (run by the Inspect venv's Python, never by rollcage's).

One ``eval()`` of a task whose samples are the bench's tasks, solved by Inspect's
``react`` agent with its ``python`` tool in the ``local`` sandbox, against the
bench's OpenAI-compatible model server (``openai-api`` provider: Chat Completions).
``react(submit=False)`` ends a sample when the model answers without a tool call,
which is what the scripted model does after its python calls, so both systems are
played the very same turns. The scorer appends one line per scored sample to
``--results`` (``id correct unix-time``): the bench watches that file for the
first result. The last line on stdout is a JSON summary.

    python bench/_peers_inspect.py --base-url URL --tasks 200 --concurrency 8 \
        --log-dir DIR --results FILE
"""

from __future__ import annotations

import argparse
import json
import os
import time
from importlib.metadata import version
from typing import Any

from inspect_ai import Task, eval, task
from inspect_ai.agent import react
from inspect_ai.dataset import Sample
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState
from inspect_ai.tool import python

from _measure import ANSWER, PROMPT


def _samples(count: int) -> list[Sample]:
    return [Sample(id=f"t{i}", input=PROMPT.format(id=f"t{i}"), target=ANSWER) for i in range(1, count + 1)]


def _timed_exact(results: str) -> Any:
    @scorer(metrics=[accuracy()])
    def timed_exact() -> Any:
        handle = open(results, "a", buffering=1)  # one line per sample, open for the eval

        async def score(state: TaskState, target: Target) -> Score:
            correct = state.output.completion.strip() == target.text
            handle.write(f"{state.sample_id} {int(correct)} {time.time():.6f}\n")
            return Score(value=CORRECT if correct else INCORRECT)

        return score

    return timed_exact()


def main() -> None:
    """Run one eval and print its summary as the last line of stdout."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--tasks", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--results", required=True)
    args = parser.parse_args()

    os.environ["BENCH_BASE_URL"] = args.base_url
    os.environ["BENCH_API_KEY"] = "unused"

    @task
    def peers() -> Task:
        return Task(
            dataset=_samples(args.tasks),
            solver=react(tools=[python()], submit=False),
            scorer=_timed_exact(args.results),
            sandbox="local",
        )

    concurrency = args.concurrency
    (log,) = eval(
        peers(),
        model="openai-api/bench/scripted",
        # Inspect's own limits would otherwise cap model connections at 10 and subprocesses at the
        # number of cores: the bench gives both systems the same concurrency.
        max_samples=concurrency,
        max_connections=concurrency,
        max_subprocesses=concurrency,
        max_sandboxes=concurrency,
        display="none",
        log_level="warning",
        log_dir=args.log_dir,
        fail_on_error=False,
    )
    samples = log.samples or []
    errors = sum(1 for sample in samples if sample.error is not None)
    correct = 0
    for sample in samples:
        for value in (sample.scores or {}).values():
            correct += value.value == CORRECT
    print(
        json.dumps(
            {
                "version": version("inspect-ai"),
                "status": log.status,
                "samples": len(samples),
                "errors": errors,
                "correct": correct,
                "error_messages": sorted({str(s.error.message)[:200] for s in samples if s.error})[:5],
            }
        )
    )


if __name__ == "__main__":
    main()
