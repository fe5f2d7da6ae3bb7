"""The terminal views behind ``rollcage show``: a rollout as a tree of turns, a run as tables.

Every renderer returns a ``rich`` renderable, and ``render_text`` turns one into
plain text, so tests read exactly what a user would see. Data is always placed
in ``Text`` objects, never in markup strings: a model that writes ``[bold]`` or
an escape sequence must not restyle the user's terminal.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from typing import get_args

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from rollcage.protocol import Outcome, RolloutRecord, RunMetrics
from rollcage.viewer._digest import RolloutDigest, ToolDigest, TurnDigest, digest_rollout
from rollcage.viewer._load import RECORDS_NAME, RecordReader, RolloutView, ViewerError, load_metrics
from rollcage.viewer._text import clean_text, clip, format_duration, format_tokens, format_utc

__all__ = ["OUTCOMES", "OUTCOME_STYLES", "render_rollout", "render_run", "render_text"]

OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)
"""Every outcome class, in the design's order."""

OUTCOME_STYLES: dict[str, str] = {
    "completed": "bold green",
    "agent_error": "bold magenta",
    "timeout": "bold yellow",
    "cancelled": "bold cyan",
    "infra_failure": "bold red",
}
"""The colour of each outcome in the terminal."""

PARTIAL_LABEL = "partial — not graded"

_STATUS_STYLES = {
    "completed": "green",
    "incomplete": "yellow",
    "failed": "red",
    "pending": "yellow",
    "cancelled": "cyan",
    "not run": "dim",
}


def render_text(renderable: RenderableType, *, width: int = 120) -> str:
    """Render to plain text as a terminal ``width`` columns wide would show it (no colour codes)."""
    console = Console(record=True, width=width, file=io.StringIO(), color_system=None, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def render_rollout(view: RolloutView, *, excerpt: int = 600) -> RenderableType:
    """One rollout as a tree of turns: model calls, tool calls, outcome, reward, receipt.

    Args:
        view: the rollout's artifacts (``load_rollout``).
        excerpt: characters shown of one text, argument or output; reasoning is
            folded to a fifth of that.
    """
    digest = digest_rollout(view)
    parts: list[RenderableType] = []
    if digest.partial:
        seq = (
            "empty journal" if digest.checkpoint_seq is None else f"journal up to seq {digest.checkpoint_seq}"
        )
        parts.append(
            Text.assemble(
                (f" {PARTIAL_LABEL} ", "bold black on yellow"),
                f"  shown from checkpoint.jsonl ({seq}): evidence of an interrupted rollout, never a result",
            )
        )
    tree = Tree(_headline(digest))
    _add_task(tree, digest, excerpt)
    for turn in digest.turns:
        _add_turn(tree, turn, excerpt)
    if digest.orphan_tools:
        orphans = tree.add(Text("tool calls of no recorded model call", style="yellow"))
        for tool in digest.orphan_tools:
            _add_tool(orphans, tool, excerpt)
    if digest.answer is not None:
        tree.add(Text.assemble(("answer ", "bold"), clip(digest.answer, excerpt)))
    _add_outcome(tree, digest)
    _add_receipt(tree, digest)
    _add_capture(tree, digest)
    if digest.findings:
        node = tree.add(Text("health findings", style="bold yellow"))
        for finding in digest.findings:
            node.add(Text.assemble((finding.name, "yellow"), f": {finding.detail}"))
    if digest.problems:
        node = tree.add(Text("problems reading artifacts", style="bold red"))
        for problem in digest.problems:
            node.add(Text(problem, style="red"))
    if digest.log_tail and (digest.error is not None or digest.outcome not in (None, "completed")):
        lines = digest.log_tail.rstrip("\n").splitlines()[-8:]
        node = tree.add(Text("worker.log (last lines)", style="bold"))
        for line in lines:
            node.add(Text(clip(line, 200), style="dim"))
    if digest.workspace_diff:
        _add_diff(tree, digest.workspace_diff)
    parts.append(tree)
    return Group(*parts)


_DIFF_LINES = 400
_DIFF_STYLES = (
    ("+++", "bold"),
    ("---", "bold"),
    ("diff ", "bold"),
    ("@@", "cyan"),
    ("+", "green"),
    ("-", "red"),
)


def _add_diff(tree: Tree, diff: str) -> None:
    """``workspace.diff``'s first lines, coloured as a diff (the file holds the rest)."""
    lines = diff.rstrip("\n").splitlines()
    node = tree.add(Text("workspace.diff", style="bold"))
    body = Text()
    for line in lines[:_DIFF_LINES]:
        style = next(
            (s for prefix, s in _DIFF_STYLES if line.startswith(prefix)), "dim" if line[:1] == "#" else ""
        )
        body.append(clip(line, 400) + "\n", style=style)
    if len(lines) > _DIFF_LINES:
        body.append(f"… {len(lines) - _DIFF_LINES} more lines in workspace.diff\n", style="dim")
    node.add(body)


def _headline(digest: RolloutDigest) -> Text:
    head = Text.assemble(("rollout ", "bold"), (digest.rollout_id, "bold"))
    if digest.task_id:
        head.append(f"  task {digest.task_id}")
    head.append("  ")
    if digest.partial:
        head.append(PARTIAL_LABEL, style="bold black on yellow")
        if digest.outcome:
            head.append("  ")
    if digest.outcome:
        head.append(digest.outcome, style=OUTCOME_STYLES.get(digest.outcome, "bold"))
    elif not digest.partial:
        head.append("outcome unknown (no receipt)", style="dim")
    head.append("  ")
    head.append(_reward_text(digest))
    head.append(f"  started {format_utc(digest.started_at)}", style="dim")
    return head


def _reward_text(digest: RolloutDigest) -> Text:
    if digest.partial:
        return Text("reward — (checkpoints are never graded)", style="dim")
    if digest.graded is None:
        return Text("reward — (not in a run)", style="dim")
    if not digest.graded or digest.reward is None:
        return Text("reward — (not graded)", style="dim")
    return Text(f"reward {digest.reward:g}", style="bold")


def _add_task(tree: Tree, digest: RolloutDigest, excerpt: int) -> None:
    if digest.instructions is None and digest.task_input is None:
        return
    node = tree.add(Text("task", style="bold blue"))
    if digest.instructions is not None:
        node.add(Text.assemble(("instructions ", "dim"), clip(digest.instructions, excerpt)))
    if digest.task_input is not None:
        node.add(Text.assemble(("input ", "dim"), clip(digest.task_input, excerpt)))


def _add_turn(tree: Tree, turn: TurnDigest, excerpt: int) -> None:
    label = Text.assemble(
        (f"turn {turn.index}", "bold blue"),
        " model call ",
        (turn.status, _STATUS_STYLES.get(turn.status, "")),
    )
    if turn.incomplete_reason:
        label.append(f" ({turn.incomplete_reason})", style="yellow")
    tokens = f"{format_tokens(turn.input_tokens)} in → {format_tokens(turn.output_tokens)} out"
    if turn.reasoning_tokens:
        tokens += f" ({turn.reasoning_tokens:,} reasoning)"
    label.append(f" · {tokens} tokens · {format_duration(turn.latency_s)}")
    if turn.ttfb_s is not None:
        label.append(f" (first byte {format_duration(turn.ttfb_s)})")
    label.append(f" · +{turn.offset_s:.2f} s", style="dim")
    if turn.attempts > 1:
        label.append(f" · {turn.attempts} attempts", style="yellow")
    if turn.token_data != "unobserved":
        label.append(f" · token ids {turn.token_data}", style="dim")
    if turn.http_status is not None and turn.http_status >= 400:
        label.append(f" · HTTP {turn.http_status}", style="red")
    node = tree.add(label)
    if turn.error is not None:
        node.add(Text(f"error ({turn.error.kind}) {turn.error.type}: {turn.error.message}", style="red"))
    for item in turn.items:
        if item.kind == "reasoning":
            # Folded: reasoning is often long and rarely what one is looking for first.
            folded = clip(" ".join(item.text.split()), max(40, excerpt // 5))
            node.add(
                Text.assemble(
                    (f"reasoning ({len(item.text):,} chars, folded) ", "dim italic"), (folded, "dim")
                )
            )
        elif item.kind == "text":
            node.add(Text.assemble(("text ", "bold"), clip(item.text, excerpt)))
        else:
            node.add(Text.assemble((f"{item.kind} ", "bold yellow"), clip(item.text, excerpt)))
    for tool in turn.tools:
        _add_tool(node, tool, excerpt)


def _add_tool(parent: Tree, tool: ToolDigest, excerpt: int) -> None:
    label = Text.assemble(
        ("tool ", "bold"),
        (tool.name, "bold cyan"),
        f" [{tool.call_id}] ",
        (tool.status, _STATUS_STYLES.get(tool.status, "")),
    )
    if tool.duration_s is not None:
        label.append(f" · {format_duration(tool.duration_s)}")
    node = parent.add(label)
    node.add(Text.assemble(("arguments ", "dim"), clip(_compact_arguments(tool), excerpt)))
    if tool.output is None:
        node.add(Text("output — (none yet)" if tool.status == "pending" else "output —", style="dim"))
    else:
        node.add(Text.assemble(("output ", "dim"), clip(tool.output, excerpt)))


def _compact_arguments(tool: ToolDigest) -> str:
    """Short JSON arguments on one line, as the model wrote them; long ones and code as they are."""
    if tool.arguments_kind != "json":
        return tool.arguments
    try:
        compact = json.dumps(json.loads(tool.arguments), ensure_ascii=False)
    except ValueError:
        return tool.arguments  # clipped by the digest, so no longer valid JSON
    return compact if len(compact) <= 100 else tool.arguments


def _add_outcome(tree: Tree, digest: RolloutDigest) -> None:
    label = Text("outcome ", style="bold")
    if digest.outcome:
        label.append(digest.outcome, style=OUTCOME_STYLES.get(digest.outcome, ""))
        if digest.outcome_reason:
            label.append(f" — {digest.outcome_reason}")
    else:
        label.append(
            "unknown: no receipt" + (" (partial — not graded)" if digest.partial else ""), style="dim"
        )
    node = tree.add(label)
    if digest.termination:
        node.add(Text(f"termination {digest.termination}"))
    if digest.error is not None:
        node.add(
            Text(f"error ({digest.error.kind}) {digest.error.type}: {digest.error.message}", style="red")
        )
    node.add(_reward_text(digest))
    if digest.grader:
        node.add(Text(f"grader {clip(digest.grader, 300)}", style="dim"))
    tokens = f"tokens {format_tokens(digest.input_tokens)} in → {format_tokens(digest.output_tokens)} out"
    node.add(Text(f"{tokens} · duration {format_duration(digest.duration_s)}"))


def _add_receipt(tree: Tree, digest: RolloutDigest) -> None:
    receipt = digest.receipt
    if receipt is None:
        tree.add(
            Text("receipt — none (the supervisor did not finish, or this is not a supervised rollout)", "dim")
        )
        return
    label = Text.assemble(
        ("receipt ", "bold"),
        f"sandbox {receipt.sandbox} · {receipt.exit} · {format_duration(receipt.duration_s)} "
        f"of {format_duration(receipt.deadline_s)} deadline",
    )
    node = tree.add(label)
    flags = Text()
    flags.append(
        "deadline fired" if receipt.deadline_fired else "deadline not fired",
        style="yellow" if receipt.deadline_fired else "",
    )
    if receipt.stop_requested:
        flags.append(" · stop requested", style="cyan")
    flags.append(" · ")
    flags.append(
        "cleanup confirmed" if receipt.cleanup_confirmed else "cleanup NOT confirmed",
        style="green" if receipt.cleanup_confirmed else "bold red",
    )
    if receipt.descendants_killed:
        flags.append(f" · {receipt.descendants_killed} stray descendant(s) killed", style="yellow")
    if receipt.temp_files_swept:
        flags.append(f" · {receipt.temp_files_swept} temp file(s) swept", style="yellow")
    node.add(flags)
    result = "valid" if receipt.result_valid else "invalid" if receipt.result_present else "missing"
    seq = "none" if receipt.last_checkpoint_seq is None else str(receipt.last_checkpoint_seq)
    node.add(Text(f"result.json {result} · last checkpoint seq {seq}"))
    for signal in receipt.signals:
        node.add(Text(f"sent {signal}", style="yellow"))


def _add_capture(tree: Tree, digest: RolloutDigest) -> None:
    capture = digest.capture
    if capture is None:
        return
    counts = (
        f"{capture.captured} model exchange(s) captured, {capture.trajectory_attempts} attempt(s) "
        f"in {capture.trajectory_calls} trajectory call(s)"
    )
    if capture.agrees:
        tree.add(Text.assemble(("capture ", "bold"), ("agrees", "green"), f" · {counts}"))
        return
    node = tree.add(Text.assemble(("capture ", "bold"), ("DISAGREES", "bold red"), f" · {counts}"))
    for difference in capture.differences[:10]:
        entry = node.add(Text(difference.summary, style="red"))
        for line in difference.diff.splitlines()[:12]:
            style = "green" if line.startswith("+") else "red" if line.startswith("-") else "dim"
            entry.add(Text(clip(line, 160), style=style))
    if len(capture.differences) > 10:
        node.add(Text(f"… {len(capture.differences) - 10} more difference(s)", style="dim"))


def render_run(run_dir: Path, *, outcome: str | None = None, limit: int = 200) -> RenderableType:
    """A run: the summary from ``metrics.json`` and the list of rollouts from ``rollouts.jsonl``.

    Args:
        run_dir: the run directory.
        outcome: show only rollouts with this outcome.
        limit: show at most this many rollouts (0: all); the rest are counted.

    Raises:
        ViewerError: ``outcome`` is not an outcome class.
    """
    if outcome is not None and outcome not in OUTCOMES:
        raise ViewerError(f"unknown outcome {outcome!r}; choose from {', '.join(OUTCOMES)}")
    parts: list[RenderableType] = [Text.assemble(("run ", "bold"), (clean_text(str(run_dir)), "bold"))]
    try:
        metrics = load_metrics(run_dir)
    except ViewerError as exc:
        metrics = None
        parts.append(Text(str(exc), style="red"))
    if metrics is None:
        parts.append(
            Text("no metrics.json yet: the summary below is counted from rollouts.jsonl", style="yellow")
        )
    else:
        parts.append(_summary_table(metrics))

    records_path = run_dir / RECORDS_NAME
    if not records_path.is_file():
        parts.append(Text(f"no {RECORDS_NAME}: no rollout has finished yet", style="yellow"))
        return Group(*parts)
    table = Table(title="rollouts" + (f" with outcome {outcome}" if outcome else ""), title_justify="left")
    for column, justify in (
        ("rollout", "left"),
        ("task", "left"),
        ("sample", "right"),
        ("try", "right"),
        ("outcome", "left"),
        ("reward", "right"),
        ("tokens", "right"),
        ("duration", "right"),
        ("termination", "left"),
    ):
        # Ids fold rather than being cut with an ellipsis: a user copies them into the next command.
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    counts: Counter[str] = Counter()
    shown = 0
    reader = RecordReader(records_path)
    for record in reader:
        counts[record.outcome] += 1
        if outcome is not None and record.outcome != outcome:
            continue
        if limit and shown >= limit:
            continue
        shown += 1
        table.add_row(*_record_cells(record))
    matching = counts[outcome] if outcome else sum(counts.values())
    parts.append(table)
    footer = Text(f"showing {shown} of {matching} rollout(s)")
    if outcome:
        footer.append(f" with outcome {outcome} ({sum(counts.values())} in the run)")
    if shown < matching:
        footer.append(" · --limit 0 shows all", style="dim")
    parts.append(footer)
    tally = Text("records by outcome: ")
    for index, name in enumerate(OUTCOMES):
        if index:
            tally.append(" · ")
        tally.append(f"{name} {counts[name]}", style=OUTCOME_STYLES[name] if counts[name] else "dim")
    parts.append(tally)
    if reader.torn_tail:
        parts.append(
            Text(f"the last line of {RECORDS_NAME} is torn (a crash mid-append) and was skipped", "yellow")
        )
    if reader.invalid_lines:
        parts.append(Text(f"{RECORDS_NAME}: damaged lines skipped: {reader.invalid_lines[:20]}", style="red"))
    if metrics is not None and metrics.rollouts != sum(counts.values()):
        parts.append(
            Text(
                f"metrics.json counts {metrics.rollouts} rollouts but {RECORDS_NAME} has "
                f"{sum(counts.values())} readable records (a run in progress, or stale metrics)",
                style="yellow",
            )
        )
    return Group(*parts)


def _record_cells(record: RolloutRecord) -> list[Text]:
    reward = "—" if record.reward is None else f"{record.reward:g}"
    return [
        Text(clean_text(record.rollout_id)),
        Text(clean_text(record.task_id)),
        Text(str(record.sample)),
        Text(str(record.try_index)),
        Text(record.outcome, style=OUTCOME_STYLES.get(record.outcome, "")),
        Text(reward),
        Text(format_tokens(record.metrics.total_tokens)),
        Text(format_duration(record.metrics.duration_s)),
        Text(record.termination_reason or "—"),
    ]


def _summary_table(metrics: RunMetrics) -> Table:
    table = Table(title="summary (metrics.json)", title_justify="left", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value")

    def ratio(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    table.add_row("dataset", Text(clean_text(metrics.dataset)))
    table.add_row("tasks", str(metrics.tasks))
    table.add_row("rollouts", str(metrics.rollouts))
    for name in OUTCOMES:
        count = metrics.outcomes.get(name, 0)
        table.add_row(f"  {name}", Text(str(count), style=OUTCOME_STYLES[name] if count else "dim"))
    table.add_row("graded", str(metrics.graded))
    table.add_row("mean reward", ratio(metrics.mean_reward))
    table.add_row("pass@1", ratio(metrics.pass_at_1))
    table.add_row(f"pass@{metrics.k}", ratio(metrics.pass_at_k))
    table.add_row("retries", str(metrics.retries))
    if metrics.invalid_rows:
        table.add_row("invalid dataset rows", Text(str(metrics.invalid_rows), style="red"))
    tokens = metrics.tokens
    table.add_row(
        "tokens",
        f"{format_tokens(tokens.input_tokens)} in · {format_tokens(tokens.output_tokens)} out · "
        f"{format_tokens(tokens.total_tokens)} total",
    )
    duration = metrics.duration_s
    table.add_row(
        "rollout duration",
        f"mean {format_duration(duration.mean)} · p50 {format_duration(duration.p50)} · "
        f"p90 {format_duration(duration.p90)} · p99 {format_duration(duration.p99)} · "
        f"max {format_duration(duration.max)}",
    )
    table.add_row("wall time", format_duration(metrics.wall_s))
    for check, finding in metrics.health.items():
        if finding.count:
            table.add_row(
                Text(f"health: {clean_text(check)}", style="yellow"),
                Text(f"{finding.count} — {clean_text(finding.detail)}"),
            )
    return table
