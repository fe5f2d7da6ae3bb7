"""What one model-call boundary costs the worker: compaction, serialisation and bytes, as a rollout grows.

Simulates the worker's side of N turns: each turn a chat model call whose request
repeats the conversation, whose Responses-shaped input repeats it too, and (with
token data) whose prompt token ids repeat the previous prompt's, then a tool
output. Every call goes through the worker's ``CallCompactor`` and is serialised
as the journal line it becomes, next to the same call serialised whole (what a
journal without deltas would write). Prints microseconds of CPU and bytes per
boundary at several N: the compacted line must stay flat as N grows.

    .venv/bin/python bench/boundaries.py [--turns 10,100,500]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson

from rollcage.checkpoint import CallCompactor
from rollcage.protocol import BoundaryRecord, CallAttempt, CallTokens, ModelCall, TurnStart

_TEXT = "x" * 400  # one tool output / answer of ~100 tokens
_TOKENS_PER_TURN = 150


def _calls(turns: int, *, tokens: bool) -> list[tuple[TurnStart, ModelCall]]:
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "task " + _TEXT}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "task " + _TEXT}]
    prompt: list[int] = list(range(_TOKENS_PER_TURN))
    out = []
    for index in range(turns):
        generation = list(range(index * 1000, index * 1000 + _TOKENS_PER_TURN // 3))
        start = TurnStart(
            index=index, id=f"r:t{index}", model_call_id=f"r:m{index}", started_at=0.0, input=items[-1:]
        )
        call = ModelCall(
            id=f"r:m{index}",
            index=index,
            turn=index,
            api="chat",
            request={"model": "m", "messages": list(messages)},
            input=list(items),
            response={"id": f"c{index}", "choices": [{"message": {"content": _TEXT}}]},
            status="completed",
            output=[
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": _TEXT}]}
            ],
            tokens=CallTokens(
                prompt_token_ids=list(prompt),
                generation_token_ids=generation,
                generation_log_probs=[-0.5] * len(generation),
            )
            if tokens
            else CallTokens(),
            attempts=[
                CallAttempt(index=0, status="completed", http_status=200, started_at=0.0, ended_at=1.0)
            ],
            started_at=0.0,
            ended_at=1.0,
        )
        out.append((start, call))
        answer = {"role": "assistant", "content": _TEXT}
        feedback = {"type": "message", "role": "user", "content": _TEXT}
        messages = [*messages, answer, {"role": "user", "content": _TEXT}]
        items = [*items, *call.output, feedback]
        prompt = [*prompt, *generation, *range(_TOKENS_PER_TURN // 3)]
    return out


def measure(turns: int, *, tokens: bool) -> tuple[float, float, float]:
    """CPU µs per boundary (turn start + model call), and bytes per model-call line compacted and whole."""
    calls = _calls(turns, tokens=tokens)
    compactor = CallCompactor()
    started = time.process_time()
    written = 0
    for start, call in calls:
        line = BoundaryRecord(kind="turn_start", at=0.0, turn=start).model_dump(
            mode="json", exclude_none=True
        )
        orjson.dumps(line)
        compacted, deltas = compactor.compact(call)
        record = BoundaryRecord(kind="model_call", at=0.0, model_call=compacted, deltas=deltas)
        written += len(orjson.dumps(record.model_dump(mode="json", exclude_none=True)))
    cpu = time.process_time() - started
    whole = sum(
        len(orjson.dumps(BoundaryRecord(kind="model_call", at=0.0, model_call=c).model_dump(mode="json")))
        for _, c in calls[-10:]
    )
    return cpu / turns * 1e6, written / turns, whole / min(10, turns)


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--turns", default="10,100,500", help="comma-separated N")
    args = parser.parse_args()
    print(
        f"{'turns':>6} {'token data':>10} {'cpu us/turn':>12} {'bytes/line':>11} {'whole line (last 10)':>21}"
    )
    for turns in (int(n) for n in args.turns.split(",")):
        for tokens in (False, True):
            cpu, line, whole = measure(turns, tokens=tokens)
            print(f"{turns:>6} {'yes' if tokens else 'no':>10} {cpu:>12.0f} {line:>11,.0f} {whole:>21,.0f}")


if __name__ == "__main__":
    main()
