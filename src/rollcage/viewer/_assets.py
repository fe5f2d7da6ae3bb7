"""The report's stylesheet and script, inlined into every report.

They are Python strings rather than package data files so the report works from
any install (wheel, editable, zipapp) without finding files at run time.

The script's one rule: data only ever reaches the page through ``textContent``
and ``setAttribute`` on elements it creates, never ``innerHTML``; rollout details
are parsed from their ``<script type="application/json">`` block only when a row
is opened, so a 10,000-rollout report opens as fast as a small one.
"""

from __future__ import annotations

__all__ = ["REPORT_CSS", "REPORT_JS"]

REPORT_CSS = """
:root {
  --bg: #f7f7f5; --fg: #1d1f21; --muted: #6b7075; --card: #ffffff; --line: #e2e2de;
  --accent: #3b6fd8; --code: #f1f1ee;
  --completed: #2f9e5b; --agent_error: #a33fb5; --timeout: #d49a12; --cancelled: #2b9bb3;
  --infra_failure: #d2423b;
}
@media (prefers-color-scheme: dark) {
  :root {
    --bg: #16181b; --fg: #e4e4e2; --muted: #9aa0a6; --card: #1f2226; --line: #33373c;
    --accent: #7aa2ff; --code: #272b30;
  }
}
* { box-sizing: border-box; }
body {
  margin: 0; background: var(--bg); color: var(--fg);
  font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "Liberation Sans", sans-serif;
}
header { padding: 18px 28px 8px; border-bottom: 1px solid var(--line); background: var(--card); }
header h1 { margin: 0; font-size: 20px; }
header .sub { margin: 4px 0 8px; color: var(--muted); word-break: break-all; }
main { padding: 8px 28px 40px; max-width: 1500px; }
h2 { font-size: 16px; margin: 24px 0 10px; }
code, pre, .mono {
  font-family: ui-monospace, "DejaVu Sans Mono", "Liberation Mono", Menlo, monospace;
  font-size: 12.5px;
}
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card {
  background: var(--card); border: 1px solid var(--line); border-radius: 8px; padding: 8px 14px;
  min-width: 118px;
}
.card .label { color: var(--muted); font-size: 12px; }
.card .value { font-size: 20px; font-weight: 600; font-variant-numeric: tabular-nums; }
.card.outcome { border-top: 3px solid var(--line); }
.card.o-completed { border-top-color: var(--completed); }
.card.o-agent_error { border-top-color: var(--agent_error); }
.card.o-timeout { border-top-color: var(--timeout); }
.card.o-cancelled { border-top-color: var(--cancelled); }
.card.o-infra_failure { border-top-color: var(--infra_failure); }
.notice {
  background: #fff4d6; color: #5a4300; border: 1px solid #f0d48a; border-radius: 6px;
  padding: 6px 10px; margin: 8px 0;
}
@media (prefers-color-scheme: dark) {
  .notice { background: #3a3117; color: #f3dc9b; border-color: #6b5a23; }
}
table.health { border-collapse: collapse; margin-top: 10px; background: var(--card); }
table.health td, table.health th {
  border: 1px solid var(--line); padding: 4px 10px; text-align: left;
}
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(380px, 1fr)); gap: 12px; }
svg.chart {
  width: 100%; height: auto; background: var(--card); border: 1px solid var(--line);
  border-radius: 8px;
}
svg .chart-title { font-size: 13px; font-weight: 600; fill: var(--fg); }
svg .axis { stroke: var(--muted); stroke-width: 1; }
svg .tick, svg .axis-label, svg .value { font-size: 10.5px; fill: var(--muted); }
svg .empty { font-size: 12px; fill: var(--muted); }
svg .bar.hist { fill: var(--accent); }
svg .o-completed { fill: var(--completed); }
svg .o-agent_error { fill: var(--agent_error); }
svg .o-timeout { fill: var(--timeout); }
svg .o-cancelled { fill: var(--cancelled); }
svg .o-infra_failure { fill: var(--infra_failure); }
svg .dot { fill-opacity: 0.65; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin-bottom: 8px; }
.controls input[type=search] { width: 320px; max-width: 100%; }
.controls select, .controls input[type=search], .pager button {
  font: inherit; padding: 4px 8px; border: 1px solid var(--line); border-radius: 6px;
  background: var(--card); color: var(--fg);
}
#rc-count { color: var(--muted); }
table.rollouts {
  width: 100%; border-collapse: collapse; background: var(--card); border: 1px solid var(--line);
}
table.rollouts th {
  text-align: left; font-weight: 600; padding: 6px 8px; border-bottom: 2px solid var(--line);
  cursor: pointer;
  user-select: none; white-space: nowrap; position: sticky; top: 0; background: var(--card);
}
table.rollouts th.sorted::after { content: " ▾"; }
table.rollouts th.sorted.asc::after { content: " ▴"; }
table.rollouts td { padding: 5px 8px; border-bottom: 1px solid var(--line); vertical-align: top; }
table.rollouts td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.rc-row { cursor: pointer; }
tr.rc-row:hover, tr.rc-row.open { background: color-mix(in srgb, var(--accent) 8%, transparent); }
tr.rc-row:focus { outline: 2px solid var(--accent); outline-offset: -2px; }
.badge {
  display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; color: #fff;
  background: var(--muted); white-space: nowrap;
}
.badge.o-completed { background: var(--completed); }
.badge.o-agent_error { background: var(--agent_error); }
.badge.o-timeout { background: var(--timeout); }
.badge.o-cancelled { background: var(--cancelled); }
.badge.o-infra_failure { background: var(--infra_failure); }
.badge.partial { background: #e0a800; color: #000; }
.badge.warn { background: #d49a12; }
.pager { display: flex; gap: 10px; align-items: center; margin: 10px 0; }
tr.rc-detail > td { background: var(--bg); padding: 14px 18px; }
section.rollout h3 {
  margin: 0 0 8px; font-size: 16px; display: flex; gap: 8px; align-items: center; flex-wrap: wrap;
}
section.rollout h4 {
  margin: 16px 0 6px; font-size: 13px; text-transform: uppercase; letter-spacing: .04em;
  color: var(--muted);
}
dl.meta { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0; }
dl.meta dt { color: var(--muted); }
dl.meta dd { margin: 0; word-break: break-word; }
.error {
  border-left: 4px solid var(--infra_failure); background: var(--card); padding: 6px 10px;
  margin: 8px 0; white-space: pre-wrap;
}
.conv { display: flex; flex-direction: column; gap: 8px; max-width: 1100px; }
.msg {
  border: 1px solid var(--line); border-radius: 10px; padding: 8px 12px; background: var(--card);
}
.msg .who { font-size: 12px; color: var(--muted); margin-bottom: 4px; }
.msg .body { white-space: pre-wrap; word-break: break-word; }
.msg.system { border-style: dashed; }
.msg.user { border-left: 4px solid var(--accent); }
.msg.assistant { border-left: 4px solid var(--completed); }
.msg.answer {
  border-left: 4px solid var(--completed);
  background: color-mix(in srgb, var(--completed) 8%, var(--card));
}
.turn {
  border: 1px solid var(--line); border-radius: 10px; padding: 8px 12px; background: var(--card);
}
.turn > .head { font-size: 12.5px; color: var(--muted); margin-bottom: 6px; }
.turn > .head b { color: var(--fg); }
.turn .text { white-space: pre-wrap; word-break: break-word; margin: 4px 0; }
details.reasoning summary { cursor: pointer; color: var(--muted); font-style: italic; }
details.reasoning pre { color: var(--muted); }
pre {
  background: var(--code); padding: 8px 10px; border-radius: 6px; overflow: auto;
  max-height: 420px; white-space: pre-wrap; word-break: break-word; margin: 4px 0;
}
.tool { border-left: 3px solid var(--accent); margin: 8px 0 4px 4px; padding-left: 10px; }
.tool .head { font-size: 12.5px; }
.tool .head .name { font-weight: 600; }
.tool .lbl { font-size: 11.5px; color: var(--muted); margin-top: 4px; }
.st-completed { color: var(--completed); }
.st-failed, .st-incomplete { color: var(--infra_failure); }
.st-pending, .st-not-run, .st-cancelled { color: var(--timeout); }
pre.diff .add { color: var(--completed); }
pre.diff .del { color: var(--infra_failure); }
pre.diff .hunk { color: var(--accent); }
ul.findings { margin: 0; padding-left: 18px; }
.muted { color: var(--muted); }
"""

REPORT_JS = r"""
(function () {
  "use strict";
  // Row layout, kept in step with _report.py's ROW_FIELDS.
  const I = 0, ID = 1, TASK = 2, SAMPLE = 3, TRY = 4, OUTCOME = 5, REWARD = 6, TOKENS = 7, DUR = 8,
    TERM = 9, TURNS = 10, TOOLS = 11, FINDINGS = 12, PARTIAL = 13;
  const COLUMNS = [
    [ID, "rollout", "text"], [TASK, "task", "text"], [SAMPLE, "sample", "num"], [TRY, "try", "num"],
    [OUTCOME, "outcome", "outcome"], [REWARD, "reward", "num"], [TOKENS, "tokens", "num"],
    [DUR, "duration (s)", "num"], [TURNS, "model calls", "num"], [TOOLS, "tool calls", "num"],
    [TERM, "termination", "text"], [FINDINGS, "findings", "num"]
  ];
  const PAGE_SIZE = 100;
  const rows = JSON.parse(document.getElementById("rc-rows").textContent);
  const haystack = rows.map(function (r) {
    return [r[ID], r[TASK], r[OUTCOME], r[TERM] || ""].join("\u0000").toLowerCase();
  });
  const state = { outcome: "", query: "", findings: false, page: 0, sort: -1, asc: true, open: new Set() };
  const cache = new Map();
  let visible = rows;

  const select = document.getElementById("rc-outcome");
  const search = document.getElementById("rc-search");
  const onlyFindings = document.getElementById("rc-findings");
  const thead = document.getElementById("rc-head");
  const tbody = document.getElementById("rc-body");
  const count = document.getElementById("rc-count");
  const pageLabel = document.getElementById("rc-page");
  const prev = document.getElementById("rc-prev");
  const next = document.getElementById("rc-next");

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function fmtNum(v, digits) {
    if (v === null || v === undefined) return "—";
    return Number.isInteger(v) ? v.toLocaleString("en-US") : v.toFixed(digits === undefined ? 3 : digits);
  }
  function fmtDur(s) {
    if (s === null || s === undefined) return "?";
    if (s < 1) return Math.round(s * 1000) + " ms";
    return s.toFixed(2) + " s";
  }
  function fmtTok(v) { return v === null || v === undefined ? "?" : v.toLocaleString("en-US"); }
  function badge(outcome) { return el("span", "badge o-" + outcome, outcome); }

  function apply() {
    const q = state.query.trim().toLowerCase();
    visible = [];
    for (let k = 0; k < rows.length; k++) {
      const r = rows[k];
      if (state.outcome && r[OUTCOME] !== state.outcome) continue;
      if (state.findings && !r[FINDINGS]) continue;
      if (q && haystack[k].indexOf(q) < 0) continue;
      visible.push(r);
    }
    if (state.sort >= 0) {
      const key = state.sort, dir = state.asc ? 1 : -1;
      visible.sort(function (a, b) {
        const x = a[key], y = b[key];
        if (x === y) return a[I] - b[I];
        if (x === null || x === undefined) return 1;
        if (y === null || y === undefined) return -1;
        return (x < y ? -1 : 1) * dir;
      });
    }
    const pages = Math.max(1, Math.ceil(visible.length / PAGE_SIZE));
    if (state.page >= pages) state.page = pages - 1;
    render(pages);
  }

  function render(pages) {
    const start = state.page * PAGE_SIZE;
    const slice = visible.slice(start, start + PAGE_SIZE);
    const frag = document.createDocumentFragment();
    for (const r of slice) {
      const tr = el("tr", "rc-row");
      tr.tabIndex = 0;
      tr.setAttribute("data-index", String(r[I]));
      tr.setAttribute("data-id", r[ID]);
      tr.setAttribute("data-outcome", r[OUTCOME]);
      for (const col of COLUMNS) {
        const v = r[col[0]];
        let td;
        if (col[2] === "outcome") {
          td = el("td");
          td.append(badge(v));
          if (r[PARTIAL]) { td.append(" "); td.append(el("span", "badge partial", "partial")); }
        } else if (col[2] === "num") {
          const text = col[0] === DUR ? (v === null ? "—" : v.toFixed(2)) : fmtNum(v);
          td = el("td", "num", text);
        } else {
          td = el("td", col[0] === ID ? "mono" : "", v === null ? "—" : v);
        }
        tr.append(td);
      }
      if (state.open.has(r[I])) tr.classList.add("open");
      frag.append(tr);
      if (state.open.has(r[I])) frag.append(detailRow(r[I]));
    }
    tbody.replaceChildren(frag);
    count.textContent =
      visible.length.toLocaleString("en-US") + " of " + rows.length.toLocaleString("en-US") + " rollouts";
    count.setAttribute("data-count", String(visible.length));
    pageLabel.textContent = "page " + (state.page + 1) + " of " + pages;
    prev.disabled = state.page === 0;
    next.disabled = state.page >= pages - 1;
  }

  function load(index) {
    if (cache.has(index)) return cache.get(index);
    const node = document.getElementById("rc-d-" + index);
    const value = node ? JSON.parse(node.textContent) : null;
    cache.set(index, value);
    return value;
  }

  function detailRow(index) {
    const tr = el("tr", "rc-detail");
    const td = el("td");
    td.colSpan = COLUMNS.length;
    const d = load(index);
    if (!d) td.append(el("p", "muted", "no details were recorded for this rollout"));
    else if (d.viewer_error) {
      td.append(errorBox({ kind: "viewer", type: d.rollout_id, message: d.viewer_error }));
    }
    else td.append(renderRollout(d));
    tr.append(td);
    return tr;
  }

  function meta(pairs) {
    const dl = el("dl", "meta");
    for (const p of pairs) {
      if (p[1] === null || p[1] === undefined || p[1] === "") continue;
      dl.append(el("dt", "", p[0]), el("dd", "", p[1]));
    }
    return dl;
  }

  function errorBox(e) { return el("div", "error", "error (" + e.kind + ") " + e.type + ": " + e.message); }

  function message(kind, who, text) {
    const box = el("div", "msg " + kind);
    box.append(el("div", "who", who), el("div", "body", text));
    return box;
  }

  function tool(t) {
    const box = el("div", "tool");
    const head = el("div", "head");
    head.append(el("span", "name", t.name), " ", el("span", "mono muted", "[" + t.call_id + "]"), " ",
      el("span", "st-" + t.status.replace(" ", "-"), t.status));
    if (t.duration_s !== null) head.append(" · " + fmtDur(t.duration_s));
    if (t.offset_s !== null) head.append(el("span", "muted", " · +" + t.offset_s.toFixed(2) + " s"));
    box.append(head);
    box.append(el("div", "lbl", t.arguments_kind === "json" ? "arguments" : "code"));
    const args = el("pre");
    args.append(el("code", t.arguments_kind === "json" ? "lang-json" : "lang-code", t.arguments));
    box.append(args);
    box.append(el("div", "lbl", "output"));
    box.append(t.output === null ? el("div", "muted", t.status === "pending" ? "(no output yet)" : "(none)")
      : el("pre", "out", t.output));
    return box;
  }

  function turn(t) {
    const box = el("div", "turn");
    const head = el("div", "head");
    head.append(el("b", "", "turn " + t.index), " · model call ", el("span", "st-" + t.status, t.status));
    if (t.incomplete_reason) head.append(" (" + t.incomplete_reason + ")");
    let line = " · " + fmtTok(t.input_tokens) + " in → " + fmtTok(t.output_tokens) + " out";
    if (t.reasoning_tokens) line += " (" + t.reasoning_tokens.toLocaleString("en-US") + " reasoning)";
    line += " · " + fmtDur(t.latency_s);
    if (t.ttfb_s !== null) line += " (first byte " + fmtDur(t.ttfb_s) + ")";
    line += " · +" + t.offset_s.toFixed(2) + " s";
    if (t.attempts > 1) line += " · " + t.attempts + " attempts";
    if (t.http_status !== null && t.http_status >= 400) line += " · HTTP " + t.http_status;
    head.append(line);
    box.append(head);
    if (t.error) box.append(errorBox(t.error));
    for (const item of t.items) {
      if (item.kind === "reasoning") {
        const det = el("details", "reasoning");
        const size = item.text.length.toLocaleString("en-US");
        det.append(el("summary", "", "reasoning (" + size + " characters)"));
        det.append(el("pre", "", item.text));
        box.append(det);
      } else {
        box.append(el("div", "text", item.kind === "text" ? item.text : item.kind + ": " + item.text));
      }
    }
    for (const t2 of t.tools) box.append(tool(t2));
    return box;
  }

  function diffBlock(text) {
    const pre = el("pre", "diff");
    for (const line of text.split("\n")) {
      let cls = "";
      if (line.startsWith("+++") || line.startsWith("---")) cls = "hunk";
      else if (line.startsWith("+")) cls = "add";
      else if (line.startsWith("-")) cls = "del";
      else if (line.startsWith("@@")) cls = "hunk";
      pre.append(el("span", cls, line + "\n"));
    }
    return pre;
  }

  function renderRollout(d) {
    const sec = el("section", "rollout");
    sec.setAttribute("data-rollout-id", d.rollout_id);
    const h = el("h3");
    h.append(el("span", "mono", d.rollout_id));
    if (d.partial) h.append(el("span", "badge partial", "partial — not graded"));
    if (d.outcome) h.append(badge(d.outcome));
    if (d.reward !== null) h.append(el("span", "badge", "reward " + fmtNum(d.reward)));
    else if (d.graded === false) h.append(el("span", "badge", "not graded"));
    sec.append(h);
    sec.append(meta([
      ["task", d.task_id], ["outcome reason", d.outcome_reason], ["termination", d.termination],
      ["started", d.started_at ? new Date(d.started_at * 1000).toISOString() : null],
      ["duration", d.duration_s === null ? null : fmtDur(d.duration_s)],
      ["tokens", fmtTok(d.input_tokens) + " in → " + fmtTok(d.output_tokens) + " out"],
      ["source", d.source === "checkpoint"
        ? "checkpoint.jsonl (seq " + d.checkpoint_seq + ") — partial, never graded"
        : d.source === "result" ? "result.json" : "no trajectory"],
      ["grader", d.grader]
    ]));
    if (d.error) sec.append(errorBox(d.error));
    if (d.problems.length) {
      sec.append(el("h4", "", "problems reading artifacts"));
      const ul = el("ul", "findings");
      for (const p of d.problems) ul.append(el("li", "", p));
      sec.append(ul);
    }

    sec.append(el("h4", "", "conversation"));
    const conv = el("div", "conv");
    if (d.instructions !== null) conv.append(message("system", "instructions", d.instructions));
    if (d.task_input !== null) conv.append(message("user", "task input", d.task_input));
    for (const t of d.turns) conv.append(turn(t));
    if (d.orphan_tools.length) {
      const box = el("div", "turn");
      box.append(el("div", "head", "tool calls of no recorded model call"));
      for (const t of d.orphan_tools) box.append(tool(t));
      conv.append(box);
    }
    if (d.answer !== null) conv.append(message("answer", "final answer", d.answer));
    if (!d.turns.length) conv.append(el("div", "muted", "no model call recorded"));
    sec.append(conv);

    sec.append(el("h4", "", "health findings"));
    if (d.findings.length) {
      const ul = el("ul", "findings");
      for (const f of d.findings) {
        const li = el("li");
        li.append(el("b", "", f.name), ": " + f.detail);
        ul.append(li);
      }
      sec.append(ul);
    } else {
      sec.append(el("div", "muted", "none"));
    }

    if (d.capture) {
      const c = d.capture;
      sec.append(el("h4", "", "model capture vs trajectory"));
      sec.append(el("div", c.agrees ? "st-completed" : "st-failed",
        (c.agrees ? "agrees: " : "DISAGREES: ") + c.captured + " model exchange(s) captured, " +
        c.trajectory_attempts + " attempt(s) in " + c.trajectory_calls + " trajectory call(s)" +
        (c.other_exchanges ? "; " + c.other_exchanges + " non-model exchange(s)" : "") +
        (c.unreadable_lines ? "; " + c.unreadable_lines + " unreadable line(s)" : "")));
      for (const diff of c.differences) {
        sec.append(el("div", "lbl", diff.summary));
        sec.append(diffBlock(diff.diff));
      }
    }

    sec.append(el("h4", "", "receipt"));
    if (d.receipt) {
      const r = d.receipt;
      sec.append(meta([
        ["outcome", r.outcome + " — " + r.outcome_reason], ["sandbox", r.sandbox], ["exit", r.exit],
        ["duration", fmtDur(r.duration_s) + " of " + fmtDur(r.deadline_s) + " deadline" +
          (r.deadline_fired ? " (deadline fired)" : "")],
        ["stop requested", r.stop_requested ? "yes" : "no"],
        ["cleanup", (r.cleanup_confirmed ? "confirmed" : "NOT confirmed") +
          (r.descendants_killed ? ", " + r.descendants_killed + " stray descendant(s) killed" : "") +
          (r.temp_files_swept ? ", " + r.temp_files_swept + " temp file(s) swept" : "")],
        ["result.json", r.result_valid ? "valid" : r.result_present ? "invalid" : "missing"],
        ["last checkpoint seq", r.last_checkpoint_seq === null ? "none" : String(r.last_checkpoint_seq)],
        ["captured exchanges", r.model_calls_captured === null ? null : String(r.model_calls_captured)],
        ["signals", r.signals.length ? r.signals.join("; ") : "none"]
      ]));
    } else {
      sec.append(el("div", "muted", "no receipt"));
    }
    if (d.log_tail) {
      const det = el("details");
      det.append(el("summary", "", "worker.log (end)"));
      det.append(el("pre", "", d.log_tail));
      sec.append(det);
    }
    if (d.workspace_diff) {
      const det = el("details", "diff");
      det.append(el("summary", "", "workspace.diff (what the rollout changed)"));
      det.append(el("pre", "", d.workspace_diff));
      sec.append(det);
    }
    return sec;
  }

  function toggle(tr) {
    const index = Number(tr.getAttribute("data-index"));
    if (state.open.has(index)) state.open.delete(index); else state.open.add(index);
    apply();
  }

  // Header cells are built here so their order always matches COLUMNS.
  const headRow = el("tr");
  COLUMNS.forEach(function (col) {
    const th = el("th", "", col[1]);
    th.setAttribute("data-key", String(col[0]));
    th.addEventListener("click", function () {
      if (state.sort === col[0]) {
        state.asc = !state.asc;
      } else {
        state.sort = col[0];
        state.asc = col[2] !== "num";
      }
      for (const other of headRow.children) other.classList.remove("sorted", "asc");
      th.classList.add("sorted");
      if (state.asc) th.classList.add("asc");
      apply();
    });
    headRow.append(th);
  });
  thead.append(headRow);

  tbody.addEventListener("click", function (ev) {
    const tr = ev.target.closest("tr.rc-row");
    if (tr) toggle(tr);
  });
  tbody.addEventListener("keydown", function (ev) {
    const tr = ev.target.closest("tr.rc-row");
    if (tr && (ev.key === "Enter" || ev.key === " ")) { ev.preventDefault(); toggle(tr); }
  });
  select.addEventListener("change", function () { state.outcome = select.value; state.page = 0; apply(); });
  search.addEventListener("input", function () { state.query = search.value; state.page = 0; apply(); });
  onlyFindings.addEventListener("change", function () {
    state.findings = onlyFindings.checked;
    state.page = 0;
    apply();
  });
  prev.addEventListener("click", function () { if (state.page > 0) { state.page--; apply(); } });
  next.addEventListener("click", function () { state.page++; apply(); });

  // "#rollout=<id>" opens that rollout: links to one rollout can be shared.
  const hash = decodeURIComponent(location.hash || "");
  if (hash.startsWith("#rollout=")) {
    const id = hash.slice(9);
    const hit = rows.find(function (r) { return r[ID] === id; });
    if (hit) { search.value = id; state.query = id; state.open.add(hit[I]); }
  }
  apply();
  document.body.setAttribute("data-ready", "1");
})();
"""
