"""What ``rollcage run`` shows: a rich progress bar while running, a summary table at the end.

The bar shows finished/total samples, counts per outcome and rollouts per
second; it is off when the output is not a terminal or with ``--quiet``, and the
plain lines (model, output directory, malformed rows) are printed either way.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollcage.protocol import Outcome, RolloutRecord

if TYPE_CHECKING:
    from rollcage.controller import InvalidRow, RunSummary

__all__ = ["RichReporter", "render_summary"]

_STYLE: dict[Outcome, str] = {
    "completed": "green",
    "agent_error": "yellow",
    "timeout": "magenta",
    "cancelled": "dim",
    "infra_failure": "red",
}


class RichReporter:
    """Progress bar and plain notices on a rich console."""

    def __init__(self, console: Console | None = None, *, quiet: bool = False) -> None:
        """Report to ``console`` (default: stdout); no live bar if ``quiet`` or not a terminal."""
        self.console = console if console is not None else Console(highlight=False)
        self._live = not quiet and self.console.is_terminal
        self._quiet = quiet
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._counts: dict[Outcome, int] = dict.fromkeys(_STYLE, 0)
        self._started = time.monotonic()
        self._finished = 0

    def notice(self, message: str) -> None:
        """Print a line (above the bar when it is live)."""
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def invalid_row(self, row: InvalidRow) -> None:
        """Print a malformed row with its line number."""
        ident = f" (id {row.task_id!r})" if row.task_id else ""
        self.console.print(
            f"Malformed row at line {row.line}{ident}: {row.reason}",
            markup=False,
            style="yellow",
            soft_wrap=True,
        )

    def start(self, *, out_dir: Path, pending: int, done: int) -> None:
        """Print where output goes and start the bar."""
        self.console.print(
            f"Output: {out_dir}  ({pending} sample(s) to run, {done} already finished)",
            markup=False,
            soft_wrap=True,
        )
        self._started = time.monotonic()
        if not self._live:
            return
        self._progress = Progress(
            TextColumn("[bold]rollouts"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[counts]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self._task = self._progress.add_task("rollouts", total=pending, counts="", rate="")
        self._progress.start()

    def record(self, record: RolloutRecord, *, sample_done: bool) -> None:
        """Count a finished attempt; advance the bar when its sample is done."""
        self._counts[record.outcome] += 1
        self._finished += 1
        if self._progress is None or self._task is None:
            return
        elapsed = max(time.monotonic() - self._started, 1e-6)
        counts = " ".join(f"[{_STYLE[o]}]{o}={n}[/]" for o, n in self._counts.items() if n)
        self._progress.update(
            self._task,
            advance=1 if sample_done else 0,
            counts=counts,
            rate=f"{self._finished / elapsed:.1f}/s",
        )

    def stop(self) -> None:
        """End the live bar."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_summary(summary: RunSummary, console: Console) -> None:
    """Print the final summary table (outcomes, rewards, pass rates, tokens, latency, health)."""
    m = summary.metrics
    table = Table(title="rollcage run", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row("output", str(summary.out_dir))
    table.add_row("tasks / rollouts", f"{m.tasks} / {m.rollouts} (this run: {summary.attempts_run})")
    table.add_row("outcomes", ", ".join(f"{o}={n}" for o, n in m.outcomes.items()))
    masked = f" (+{m.masked} masked)" if m.masked else ""
    table.add_row("graded / mean reward", f"{m.graded}{masked} / {_fmt(m.mean_reward)}")
    table.add_row(f"pass@1 / pass@{m.k}", f"{_fmt(m.pass_at_1)} / {_fmt(m.pass_at_k)}")
    t = m.tokens
    table.add_row(
        "tokens in / out / total", f"{t.input_tokens or 0} / {t.output_tokens or 0} / {t.total_tokens or 0}"
    )
    d = m.duration_s
    table.add_row(
        "latency s p50 / p90 / p99 / max",
        f"{_fmt(d.p50, 2)} / {_fmt(d.p90, 2)} / {_fmt(d.p99, 2)} / {_fmt(d.max, 2)}",
    )
    table.add_row("infra retries", str(m.retries))
    table.add_row("malformed rows", str(m.invalid_rows))
    for row in summary.invalid_rows[:5]:
        table.add_row("", f"line {row.line}: {row.reason}")
    unhealthy = [f"{name}={f.count}" for name, f in m.health.items() if f.count]
    table.add_row("health", ", ".join(unhealthy) if unhealthy else "no findings")
    table.add_row("wall", f"{m.wall_s:.1f} s")
    console.print(table)
    if summary.error is not None:
        console.print(f"Failed: {summary.error}", style="red", markup=False)
    elif summary.interrupted:
        console.print(
            "Interrupted: unfinished rollouts were stopped and recorded as cancelled; "
            "rerun the same command to resume.",
            style="yellow",
        )
    elif summary.all_infra:
        console.print(
            "Every rollout failed for infrastructure reasons: check the model endpoint, the sandbox "
            "(try --sandbox none to compare) and the receipts under rollouts/.",
            style="red",
        )
