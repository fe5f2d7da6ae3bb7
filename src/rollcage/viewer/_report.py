"""``rollcage report``: one self-contained HTML file for a run.

Layout of the file, in the order it is written::

    <head>   Content-Security-Policy (hashes of the one style and one script), inline CSS
    <body>   <div id="rc-data" hidden>  one <script type="application/json" id="rc-d-N"> per rollout
             header, summary (data-metric="…" on every number), charts (inline SVG),
             rollout table (built by the script from the rows JSON)
             <script type="application/json" id="rc-rows">   one compact row per rollout
             <script>   the viewer

Generation streams ``rollouts.jsonl``: each record's rollout directory is read,
digested, written out as its detail block and dropped, so memory holds only the
compact rows (a few numbers per rollout), not the trajectories. The visible
parts come after the details in the file because the charts and the table need
every row; the details are invisible, so the order does not show.

Safety: all data is embedded as JSON with ``<``, ``>``, ``&``, U+2028 and U+2029
escaped, so no text can close its ``<script>`` block, and the page's script puts
data on the page with ``textContent`` only. The CSP allows exactly the one
inline script and style (by hash) and no network at all, so even a mistake in
escaping could not run injected code or fetch anything.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import IO, Any

import orjson

from rollcage.protocol import RolloutRecord, RunMetrics
from rollcage.runfiles import check_output, locate_rollout
from rollcage.viewer._assets import REPORT_CSS, REPORT_JS
from rollcage.viewer._digest import DEFAULT_TEXT_LIMIT, digest_rollout
from rollcage.viewer._load import (
    RECORDS_NAME,
    RecordReader,
    ViewerError,
    load_metrics,
    load_rollout,
)
from rollcage.viewer._svg import bar_chart, histogram, scatter
from rollcage.viewer._terminal import OUTCOMES

__all__ = ["ROW_FIELDS", "embed_json", "write_report"]

REPORT_NAME = "report.html"

ROW_FIELDS = (
    "index",
    "rollout_id",
    "task_id",
    "sample",
    "try_index",
    "outcome",
    "reward",
    "total_tokens",
    "duration_s",
    "termination_reason",
    "model_calls",
    "tool_calls",
    "findings",
    "partial",
)
"""The columns of one row in the rows JSON (the script indexes them by position)."""

_JSON_ESCAPES = {
    ord("<"): "\\u003c",
    ord(">"): "\\u003e",
    ord("&"): "\\u0026",
    0x2028: "\\u2028",
    0x2029: "\\u2029",
}


def embed_json(value: Any) -> str:
    """JSON text safe inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` only ever occur inside JSON strings, where their
    ``\\u`` escapes mean the same, so the result parses to the same value while
    ``</script>`` and ``<!--`` can no longer appear in it. U+2028/2029 are
    escaped for consumers that treat them as line ends.
    """
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode().translate(_JSON_ESCAPES)


def _csp_hash(source: str) -> str:
    digest = hashlib.sha256(source.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


def write_report(
    run_dir: Path,
    output: Path | None = None,
    *,
    text_limit: int = DEFAULT_TEXT_LIMIT // 2,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write the HTML report of the run in ``run_dir`` and return its path.

    Args:
        run_dir: a run directory (``rollouts.jsonl``, ``metrics.json``, ``rollouts/``).
        output: where to write; default ``run_dir/report.html``. Written to a
            temporary file beside it and renamed, so a reader never sees half a report.
        text_limit: characters kept of one message, argument or tool output.
        progress: called with the number of rollouts written so far, every 500.

    Raises:
        ViewerError: ``run_dir`` is not a run directory.
        ConfigError: ``output`` names something other than a file to (re)place (a
            directory, a device, a FIFO, a socket, a symbolic link) or one of the
            run's own files (``rollcage.runfiles.check_output``). The report is
            published by renaming over ``output``, which would put a plain file in
            place of a device node, so those are refused untouched.
        OSError: the report cannot be written.
    """
    if not run_dir.is_dir():
        raise ViewerError(f"{run_dir}: no such directory")
    records_path = run_dir / RECORDS_NAME
    metrics_problem: str | None = None
    try:
        metrics = load_metrics(run_dir)
    except ViewerError as exc:
        metrics, metrics_problem = None, str(exc)
    if not records_path.is_file() and metrics is None and metrics_problem is None:
        raise ViewerError(f"{run_dir}: not a run directory (no {RECORDS_NAME} or metrics.json)")
    target = output if output is not None else run_dir / REPORT_NAME
    check_output(target, run_dir=run_dir, kind="file", what="the report")
    target.parent.mkdir(parents=True, exist_ok=True)

    fd, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as handle:
            _write(handle, run_dir, records_path, metrics, metrics_problem, text_limit, progress)
        os.chmod(temp_name, 0o644)
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    return target


def _write(
    handle: IO[str],
    run_dir: Path,
    records_path: Path,
    metrics: RunMetrics | None,
    metrics_problem: str | None,
    text_limit: int,
    progress: Callable[[int], None] | None,
) -> None:
    title = f"rollcage report — {run_dir.resolve().name}"
    csp = (
        "default-src 'none'; "
        f"script-src {_csp_hash(REPORT_JS)}; style-src {_csp_hash(REPORT_CSS)}; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    handle.write(
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<meta http-equiv="Content-Security-Policy" content="{escape(csp, quote=False)}">'
        '<meta name="referrer" content="no-referrer">'
        f"<title>{escape(title)}</title><style>{REPORT_CSS}</style></head>\n<body>\n"
        '<div id="rc-data" hidden>\n'
    )

    rows: list[list[Any]] = []
    call_latencies: list[float] = []
    relocated: list[str] = []
    reader = RecordReader(records_path) if records_path.is_file() else None
    for index, record in enumerate(reader or ()):
        rows.append(
            _write_detail(handle, index, record, run_dir, metrics, text_limit, call_latencies, relocated)
        )
        if progress is not None and (index + 1) % 500 == 0:
            progress(index + 1)
    handle.write("</div>\n")

    notices: list[str] = []
    if metrics_problem:
        notices.append(metrics_problem)
    if metrics is None and not metrics_problem:
        notices.append(
            "no metrics.json yet (a run still starting?): the summary is counted from rollouts.jsonl"
        )
    if reader is None:
        notices.append(f"no {RECORDS_NAME}: no rollout has finished yet")
    else:
        if reader.torn_tail:
            notices.append(f"the last line of {RECORDS_NAME} is torn (a crash mid-append) and was skipped")
        if reader.invalid_lines:
            notices.append(f"{RECORDS_NAME}: damaged lines skipped: {reader.invalid_lines[:20]}")
    if relocated:
        notices.append(
            f"{len(relocated)} record(s) name a rollout directory outside this run (a moved or copied run, "
            f"or an edited record), e.g. {relocated[0]}; shown from the run's own rollouts/ instead"
        )
    if metrics is not None and metrics.rollouts != len(rows):
        notices.append(
            f"metrics.json counts {metrics.rollouts} rollouts but {RECORDS_NAME} has {len(rows)} readable "
            "records (a run in progress, or stale metrics)"
        )

    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    handle.write(
        f'<header><h1>{escape(title)}</h1><p class="sub">{escape(str(run_dir.resolve()))}'
        + (f" · dataset {escape(metrics.dataset)}" if metrics else "")
        + f" · generated {generated}</p></header>\n<main>\n"
    )
    handle.write(_summary_html(metrics, rows, notices))
    handle.write(_charts_html(rows, call_latencies))
    handle.write(_table_html(rows))
    handle.write("</main>\n")
    handle.write(f'<script type="application/json" id="rc-rows">{embed_json(rows)}</script>\n')
    handle.write(f"<script>{REPORT_JS}</script>\n</body></html>\n")


def _write_detail(
    handle: IO[str],
    index: int,
    record: RolloutRecord,
    run_dir: Path,
    metrics: RunMetrics | None,
    text_limit: int,
    call_latencies: list[float],
    relocated: list[str],
) -> list[Any]:
    """Write one rollout's detail block, note its model-call latencies, and return its compact row.

    The rollout directory is the run's own ``rollouts/<rollout_id>`` (a record's
    ``rollout_dir`` is never followed); a record that named another is noted in ``relocated``.
    """
    findings = 0
    partial = False
    latencies: list[float] = []
    location = locate_rollout(run_dir, record)
    try:
        if location.directory is None:
            raise ViewerError(location.problem or "no rollout directory")
        if location.relocated:
            relocated.append(record.rollout_dir)
        view = load_rollout(location.directory, record=record, metrics=metrics)
        digest = digest_rollout(view, text_limit=text_limit)
        # Serialised here, so a value JSON cannot carry (an integer beyond 64 bits) is this rollout's error.
        block = embed_json(digest)
        findings, partial = len(digest.findings), digest.partial
        latencies = [turn.latency_s for turn in digest.turns]
    except Exception as exc:  # one unreadable rollout must not cost the report of 10,000
        block = embed_json(
            {"rollout_id": _text(record.rollout_id), "viewer_error": _text(f"{type(exc).__name__}: {exc}")}
        )
        findings = 1
    call_latencies.extend(latencies)
    handle.write(f'<script type="application/json" id="rc-d-{index}">{block}</script>\n')
    return [
        index,
        _text(record.rollout_id),
        _text(record.task_id),
        _json_int(record.sample),
        _json_int(record.try_index),
        record.outcome,
        record.reward,
        _json_int(record.metrics.total_tokens),
        round(record.metrics.duration_s, 3),
        record.termination_reason,
        _json_int(record.metrics.model_calls),
        _json_int(record.metrics.tool_calls),
        findings,
        1 if partial else 0,
    ]


def _json_int(value: int | None) -> int | None:
    """``value`` if JSON (orjson) can carry it, else ``None`` (shown as unknown): an older writer's 2**70."""
    return value if value is None or -(2**63) <= value < 2**64 else None


def _text(value: str) -> str:
    """``value`` with anything UTF-8 cannot encode (a lone surrogate) replaced, so it embeds as JSON."""
    return value.encode("utf-8", "replace").decode("utf-8")


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"


def _metric_card(label: str, key: str, value: float | int | None, css: str = "") -> str:
    raw = "null" if value is None else repr(value)
    return (
        f'<div class="card{" " + css if css else ""}"><div class="label">{escape(label)}</div>'
        f'<div class="value" data-metric="{escape(key)}" data-value="{escape(raw)}">{_fmt(value)}</div></div>'
    )


def _summary_html(metrics: RunMetrics | None, rows: list[list[Any]], notices: list[str]) -> str:
    parts = ['<section id="summary"><h2>Summary</h2>']
    parts.extend(f'<div class="notice">{escape(notice)}</div>' for notice in notices)
    counts = Counter(row[5] for row in rows)
    if metrics is not None:
        cards = [
            _metric_card("rollouts", "rollouts", metrics.rollouts),
            _metric_card("tasks", "tasks", metrics.tasks),
            _metric_card("graded", "graded", metrics.graded),
            _metric_card("mean reward", "mean_reward", metrics.mean_reward),
            _metric_card("pass@1", "pass_at_1", metrics.pass_at_1),
            _metric_card(f"pass@{metrics.k}", "pass_at_k", metrics.pass_at_k),
            _metric_card("k (samples per task)", "k", metrics.k),
            _metric_card("infra retries", "retries", metrics.retries),
            _metric_card("invalid dataset rows", "invalid_rows", metrics.invalid_rows),
            _metric_card("input tokens", "tokens.input_tokens", metrics.tokens.input_tokens),
            _metric_card("output tokens", "tokens.output_tokens", metrics.tokens.output_tokens),
            _metric_card("total tokens", "tokens.total_tokens", metrics.tokens.total_tokens),
            _metric_card("duration mean (s)", "duration_s.mean", metrics.duration_s.mean),
            _metric_card("duration p50 (s)", "duration_s.p50", metrics.duration_s.p50),
            _metric_card("duration p90 (s)", "duration_s.p90", metrics.duration_s.p90),
            _metric_card("duration p99 (s)", "duration_s.p99", metrics.duration_s.p99),
            _metric_card("duration max (s)", "duration_s.max", metrics.duration_s.max),
            _metric_card("wall time (s)", "wall_s", metrics.wall_s),
        ]
        outcome_cards = [
            _metric_card(name, f"outcomes.{name}", metrics.outcomes.get(name, 0), f"outcome o-{name}")
            for name in OUTCOMES
        ]
    else:
        cards = [_metric_card("rollouts (records)", "records", len(rows))]
        outcome_cards = [
            _metric_card(name, f"records.{name}", counts.get(name, 0), f"outcome o-{name}")
            for name in OUTCOMES
        ]
    parts.append(f'<div class="cards">{"".join(outcome_cards)}</div>')
    parts.append(f'<div class="cards">{"".join(cards)}</div>')
    if metrics is not None and metrics.health:
        parts.append('<table class="health"><tr><th>health check</th><th>count</th><th>detail</th></tr>')
        for name, finding in metrics.health.items():
            parts.append(
                f'<tr data-health="{escape(name)}"><td>{escape(name)}</td>'
                f'<td data-metric="health.{escape(name)}" data-value="{finding.count}">{finding.count}</td>'
                f"<td>{escape(finding.detail)}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</section>\n")
    return "".join(parts)


def _charts_html(rows: list[list[Any]], call_latencies: list[float]) -> str:
    counts = Counter(row[5] for row in rows)
    rewards = [float(row[6]) for row in rows if row[6] is not None]
    tokens = [float(row[7]) for row in rows if row[7] is not None]
    durations = [float(row[8]) for row in rows]
    points = [
        (float(row[7]), float(row[8]), f"o-{row[5]}", f"{row[1]}: {row[7]} tokens, {row[8]} s, {row[5]}")
        for row in rows
        if row[7] is not None
    ]
    charts = [
        bar_chart("outcomes", [(name, counts.get(name, 0), f"o-{name}") for name in OUTCOMES]),
        histogram(f"reward distribution ({len(rewards)} graded)", rewards, bins=10, x_label="reward"),
        histogram("tokens per rollout", tokens, x_label="total tokens"),
        histogram("duration per rollout", durations, x_label="seconds"),
        histogram(f"model call latency ({len(call_latencies):,} calls)", call_latencies, x_label="seconds"),
        scatter("tokens vs duration per rollout", points, x_label="total tokens", y_label="seconds"),
    ]
    return '<section id="charts"><h2>Charts</h2><div class="charts">' + "".join(charts) + "</div></section>\n"


def _table_html(rows: list[list[Any]]) -> str:
    present = Counter(row[5] for row in rows)
    options = ['<option value="">all outcomes</option>'] + [
        f'<option value="{name}">{name} ({present.get(name, 0)})</option>' for name in OUTCOMES
    ]
    return (
        '<section id="rollouts"><h2>Rollouts</h2>'
        '<div class="controls">'
        f'<label>outcome <select id="rc-outcome">{"".join(options)}</select></label>'
        '<input id="rc-search" type="search" placeholder="search rollout id, task, outcome, termination" '
        'aria-label="search rollouts">'
        '<label><input id="rc-findings" type="checkbox"> only with health findings</label>'
        '<span id="rc-count" data-count=""></span></div>'
        '<table class="rollouts" id="rc-table"><thead id="rc-head"></thead>'
        '<tbody id="rc-body"></tbody></table>'
        '<div class="pager"><button id="rc-prev" type="button">‹ previous</button><span id="rc-page"></span>'
        '<button id="rc-next" type="button">next ›</button></div>'
        "<noscript><p>The rollout table needs JavaScript; "
        "the data is embedded in this file as JSON.</p></noscript>"
        "</section>\n"
    )
