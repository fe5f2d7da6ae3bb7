"""Benchmark: checkpointing a growing transcript, naively vs. with CheckpointJournal.

A simulated agent produces N boundaries, alternating a model response and a
tool completion whose output is 4 KiB. At every boundary it checkpoints:

* naive: rebuild the whole trajectory, serialise it, write, fsync and rename it
  (``publish_json``) on the event loop, as the original PR did;
* journal: ``await CheckpointJournal.append(boundary)``, one line per boundary;
* floor: no checkpoint at all, for as long as the journal run took: what the
  machine itself (other tenants, the hypervisor) does to the loop.

Meanwhile a ticker coroutine wakes every millisecond and records how late it
was: its worst lateness is the longest the event loop was stalled. Bytes per
boundary is what each approach wrote to disk divided by N.

The ticker cannot see much below a millisecond: the event loop waits in epoll,
whose timeouts are whole milliseconds, so a wake-up can be up to ~1 ms late
with nothing blocking the loop at all. A worst stall under ~1 ms means "no
stall this ticker can resolve".

Every (approach, N) runs REPEATS times; the table shows the median run's worst
stall (and the worst of all runs), so one scheduler hiccup on a busy machine
does not decide the ratio.

Run: ``.venv/bin/python bench/checkpoint.py`` (about 20 seconds; set BENCH_DIR
to measure on another filesystem than the default temporary directory).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollcage.durable import CheckpointJournal, publish_json
from rollcage.protocol import BoundaryRecord, CallAttempt, ModelCall, ToolCall, Trajectory

SIZES = (10, 100, 1000)
TOOL_OUTPUT_BYTES = 4096
MODEL_TEXT_BYTES = 1024
TICK_S = 0.001
REPEATS = 5


@dataclass(frozen=True)
class Measurement:
    """What one approach did for one transcript length."""

    approach: str
    n: int
    worst_stall_ms: float
    p99_stall_ms: float
    bytes_per_boundary: float
    seconds: float


def make_boundaries(n: int) -> list[BoundaryRecord]:
    """N boundaries: model call (requesting one tool call), tool completion, model call, ..."""
    boundaries: list[BoundaryRecord] = []
    at = 1_700_000_000.0
    for i in range(n):
        turn = i // 2
        call_id = f"call_{turn}"
        at += 0.5
        if i % 2 == 0:
            pending = ToolCall(
                call_id=call_id,
                name="python",
                arguments='{"code": "print(1)"}',
                turn=turn,
                status="pending",
                started_at=at,
            )
            model_call = ModelCall(
                id=f"r:m{turn}",
                index=turn,
                turn=turn,
                attempts=[
                    CallAttempt(
                        index=0, status="completed", http_status=200, started_at=at - 0.4, ended_at=at
                    )
                ],
                api="responses",
                request={"model": "m", "input": f"step {turn}"},
                response={
                    "id": f"resp_{turn}",
                    "output": [
                        {
                            "type": "message",
                            "content": [{"type": "output_text", "text": "m" * MODEL_TEXT_BYTES}],
                        },
                        {"type": "function_call", "call_id": call_id},
                    ],
                },
                status="completed",
                started_at=at - 0.4,
                ended_at=at,
            )
            boundaries.append(
                BoundaryRecord(kind="model_call", at=at, model_call=model_call, tool_calls=[pending])
            )
        else:
            done = ToolCall(
                call_id=call_id,
                name="python",
                arguments='{"code": "print(1)"}',
                turn=turn,
                status="completed",
                output="o" * TOOL_OUTPUT_BYTES,
                started_at=at - 0.3,
                ended_at=at,
                duration_s=0.3,
            )
            boundaries.append(BoundaryRecord(kind="tool_call", at=at, tool_calls=[done]))
    return boundaries


async def measure(
    approach: str, n: int, checkpoint: Callable[[BoundaryRecord], Awaitable[int]]
) -> Measurement:
    """Run the simulated agent with a ticker beside it; checkpoint returns bytes written."""
    loop = asyncio.get_running_loop()
    boundaries = make_boundaries(n)
    stop = asyncio.Event()
    lateness: list[float] = []

    async def ticker() -> None:
        while not stop.is_set():
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            lateness.append(loop.time() - due)

    async def agent() -> int:
        written = 0
        for boundary in boundaries:
            written += await checkpoint(boundary)
            await asyncio.sleep(0)  # the agent's next model or tool call would await here
        stop.set()
        return written

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        group.create_task(ticker())
        agent_task = group.create_task(agent())
    seconds = time.perf_counter() - started
    lateness.sort()
    return Measurement(
        approach=approach,
        n=n,
        worst_stall_ms=lateness[-1] * 1000,
        p99_stall_ms=lateness[int(len(lateness) * 0.99)] * 1000,
        bytes_per_boundary=agent_task.result() / n,
        seconds=seconds,
    )


async def naive(directory: str, n: int) -> Measurement:
    """Rebuild, serialise and publish the whole trajectory at every boundary, on the loop."""
    path = os.path.join(directory, f"naive-{n}.json")
    model_calls: list[ModelCall] = []
    tool_calls: dict[str, ToolCall] = {}

    async def checkpoint(boundary: BoundaryRecord) -> int:
        if boundary.model_call is not None:
            model_calls.append(boundary.model_call)
        for call in boundary.tool_calls:
            tool_calls[call.call_id] = call
        trajectory = Trajectory(model_calls=list(model_calls), tool_calls=list(tool_calls.values()))
        publish_json(path, trajectory)
        return os.stat(path).st_size

    return await measure("naive", n, checkpoint)


async def journal(directory: str, n: int) -> Measurement:
    """Append one journal line per boundary."""
    path = os.path.join(directory, f"journal-{n}.jsonl")
    async with CheckpointJournal(path) as writer:

        async def checkpoint(boundary: BoundaryRecord) -> int:
            before = writer.seq
            await writer.append(boundary.model_dump(mode="json"))
            assert writer.seq > before
            return 0  # counted from the file below: the journal writes each line once

        result = await measure("journal", n, checkpoint)
    size = os.stat(path).st_size
    return Measurement(
        result.approach, n, result.worst_stall_ms, result.p99_stall_ms, size / n, result.seconds
    )


async def floor(n: int, seconds: float) -> Measurement:
    """No checkpoint, only the agent's own work, for as long as the journal run took.

    Its worst stall is what this machine does to any process in that much time
    (other tenants, the hypervisor): the floor no checkpointing scheme can beat.
    """
    loop = asyncio.get_running_loop()
    pause = seconds / n
    due: float | None = None

    async def checkpoint(boundary: BoundaryRecord) -> int:
        nonlocal due
        boundary.model_dump(mode="json")
        # Keep to a schedule rather than sleeping `pause` each time: the loop's
        # timers are coarser than one boundary's share of the journal's time.
        due = (due or loop.time()) + pause
        if due > loop.time():
            await asyncio.sleep(due - loop.time())
        return 0

    return await measure("floor", n, checkpoint)


@dataclass(frozen=True)
class Row:
    """REPEATS measurements of one approach at one N, summarised."""

    approach: str
    n: int
    median_worst_ms: float
    max_worst_ms: float
    median_p99_ms: float
    bytes_per_boundary: float
    median_seconds: float

    @classmethod
    def of(cls, runs: list[Measurement]) -> Row:
        """Summarise repeated runs."""
        return cls(
            approach=runs[0].approach,
            n=runs[0].n,
            median_worst_ms=statistics.median(m.worst_stall_ms for m in runs),
            max_worst_ms=max(m.worst_stall_ms for m in runs),
            median_p99_ms=statistics.median(m.p99_stall_ms for m in runs),
            bytes_per_boundary=statistics.median(m.bytes_per_boundary for m in runs),
            median_seconds=statistics.median(m.seconds for m in runs),
        )


async def main() -> None:
    """Run both approaches for every N and print the table and the ratios."""
    rows: list[tuple[Row, Row, Row]] = []
    with tempfile.TemporaryDirectory(prefix="rollcage-bench-", dir=os.environ.get("BENCH_DIR")) as directory:
        for n in SIZES:
            naive_runs: list[Measurement] = []
            journal_runs: list[Measurement] = []
            floor_runs: list[Measurement] = []
            for _ in range(REPEATS):
                # Interleaved, so both see the same machine; each starts from a fresh file.
                journal_runs.append(await journal(directory, n))
                floor_runs.append(await floor(n, journal_runs[-1].seconds))
                naive_runs.append(await naive(directory, n))
                for name in os.listdir(directory):
                    os.unlink(os.path.join(directory, name))
            rows.append((Row.of(naive_runs), Row.of(journal_runs), Row.of(floor_runs)))

    print(f"worst stall: the ticker's largest lateness, median of {REPEATS} runs (max of the runs)")
    print("floor: the same agent with no checkpoint, as long as the journal run: this machine's own noise")
    header = (
        f"{'N':>5}  {'approach':<8}  {'worst stall ms':>18}  {'p99 stall ms':>12}  "
        f"{'bytes/boundary':>14}  {'time s':>7}"
    )
    print(header)
    print("-" * len(header))
    for pair in rows:
        for row in pair:
            worst = f"{row.median_worst_ms:.2f} ({row.max_worst_ms:.2f})"
            print(
                f"{row.n:>5}  {row.approach:<8}  {worst:>18}  {row.median_p99_ms:>12.2f}  "
                f"{row.bytes_per_boundary:>14,.0f}  {row.median_seconds:>7.2f}"
            )
    print()
    print(f"{'N':>5}  {'worst stall naive/journal':>26}  {'bytes/boundary naive/journal':>29}")
    for naive_row, journal_row, _ in rows:
        stall_ratio = naive_row.median_worst_ms / max(journal_row.median_worst_ms, 1e-6)
        bytes_ratio = naive_row.bytes_per_boundary / journal_row.bytes_per_boundary
        print(f"{naive_row.n:>5}  {stall_ratio:>25.1f}x  {bytes_ratio:>28.1f}x")
    journal_bytes = [journal_row.bytes_per_boundary for _, journal_row, _ in rows]
    spread = (max(journal_bytes) - min(journal_bytes)) / statistics.mean(journal_bytes)
    print()
    listed = ", ".join(f"{b:,.0f}" for b in journal_bytes)
    print(f"journal bytes/boundary across N: {listed} (spread {spread:.1%})")
    last_naive, last_journal, last_floor = rows[-1]
    final_ratio = last_naive.median_worst_ms / max(last_journal.median_worst_ms, 1e-6)
    verdict = "meets" if final_ratio >= 20 else "MISSES"
    print(
        f"N={SIZES[-1]}: the journal's worst stall is {final_ratio:.1f}x smaller ({verdict} the 20x target)"
    )
    journal_ms, floor_ms = last_journal.median_worst_ms, last_floor.median_worst_ms
    print(
        f"N={SIZES[-1]}: worst stall journal {journal_ms:.2f} ms, floor {floor_ms:.2f} ms; "
        "where they are close, the journal's stall is the machine's noise, not the journal's"
    )


if __name__ == "__main__":
    asyncio.run(main())
