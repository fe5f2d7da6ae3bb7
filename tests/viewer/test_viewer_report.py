"""``rollcage report``: the HTML file, checked as text and in headless Chromium.

The browser tests drive Debian's ``/usr/bin/chromium`` through the Python
``playwright`` package (never a downloaded browser) and load the report over
``file://``; they are skipped, saying why, only where that chromium is absent.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from typer.testing import CliRunner

from rollcage.cli import _build_app
from rollcage.viewer import write_report
from rollcage.viewer._report import embed_json
from tests.helpers.viewer_fixtures import XSS_IMG, XSS_SCRIPT, RunFixture, write_large_run, write_run

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="Debian's chromium is not installed at /usr/bin/chromium (.ci/run installs it)",
)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> RunFixture:
    fixture = write_run(tmp_path_factory.mktemp("report") / "run")
    write_report(fixture.path)
    return fixture


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    manager = sync_playwright().start()
    try:
        launched = manager.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()
    finally:
        manager.stop()


class Opened:
    """A loaded report page and what it tried to do."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        self.requests: list[str] = []


@pytest.fixture
def open_report(browser: Browser) -> Iterator[Any]:
    pages: list[Page] = []

    def opener(path: Path) -> Opened:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        pages.append(page)
        opened = Opened(page)

        def on_dialog(dialog: Any) -> None:
            opened.dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)
        page.on("pageerror", lambda error: opened.errors.append(str(error)))
        page.on("request", lambda request: opened.requests.append(request.url))
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready='1']")
        return opened

    try:
        yield opener
    finally:
        for page in pages:
            page.close()


def metric_value(metrics: dict[str, Any], dotted: str) -> Any:
    value: Any = metrics
    for part in dotted.split("."):
        value = value[part]
    return value


# ----------------------------------------------------------------------------- the file itself


def test_default_output_is_report_html_in_the_run_dir(run: RunFixture) -> None:
    html = (run.path / "report.html").read_text()
    assert html.startswith("<!doctype html>")
    assert not [p.name for p in run.path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_report_is_self_contained(run: RunFixture) -> None:
    html = (run.path / "report.html").read_text()
    assert "<link" not in html and "@import" not in html and "url(" not in html
    assert not re.search(r"<script[^>]*\ssrc=", html)
    assert "default-src 'none'" in html  # the CSP forbids any fetch at view time


def test_hostile_text_is_embedded_escaped(run: RunFixture) -> None:
    html = (run.path / "report.html").read_text()
    assert XSS_SCRIPT not in html
    assert XSS_IMG not in html
    assert "\\u003cscript\\u003ealert(1)\\u003c/script\\u003e" in html


def test_embed_json_cannot_close_its_script_and_round_trips() -> None:
    value = {"t": "</script><!-- & \u2028\u2029 <img src=x onerror=alert(1)>", "k<": [1, "</SCRIPT>"]}
    text = embed_json(value)
    assert "<" not in text and ">" not in text and "&" not in text
    assert "\u2028" not in text and "\u2029" not in text
    assert json.loads(text) == value


def test_cli_writes_to_the_given_output(run: RunFixture, tmp_path: Path) -> None:
    target = tmp_path / "out" / "custom.html"
    outcome = CliRunner().invoke(_build_app(), ["report", str(run.path), "-o", str(target)])
    assert outcome.exit_code == 0, outcome.output
    assert target.is_file() and str(target) in outcome.output


def test_cli_names_a_directory_that_is_not_a_run_and_exits_2(tmp_path: Path) -> None:
    outcome = CliRunner().invoke(_build_app(), ["report", str(tmp_path)])
    assert outcome.exit_code == 2
    assert str(tmp_path) in outcome.output


# ----------------------------------------------------------------------------- in the browser


@needs_chromium
def test_summary_numbers_equal_metrics_json(run: RunFixture, open_report: Any) -> None:
    metrics = json.loads((run.path / "metrics.json").read_text())
    opened = open_report(run.path / "report.html")
    cells = opened.page.locator("[data-metric]")
    shown = {
        cells.nth(i).get_attribute("data-metric"): (
            cells.nth(i).get_attribute("data-value"),
            cells.nth(i).inner_text(),
        )
        for i in range(cells.count())
    }
    expected_keys = {
        "rollouts", "tasks", "graded", "mean_reward", "pass_at_1", "pass_at_k", "k", "retries",
        "tokens.total_tokens", "duration_s.p50", "wall_s",
        *(f"outcomes.{name}" for name in metrics["outcomes"]),
    }  # fmt: skip
    assert expected_keys <= set(shown)
    for key, (raw, text) in shown.items():
        assert key is not None and raw is not None
        expected = metric_value(metrics, key) if not key.startswith("health.") else None
        if key.startswith("health."):
            assert int(raw) == metrics["health"][key.removeprefix("health.")]["count"]
            continue
        if expected is None:
            assert raw == "null" and text == "—"
            continue
        assert float(raw) == pytest.approx(expected, rel=1e-12), key
        assert float(text.replace(",", "")) == pytest.approx(expected, rel=1e-3), key
    assert opened.errors == []


@needs_chromium
@pytest.mark.parametrize(
    ("outcome", "rows"),
    [("", 6), ("completed", 2), ("infra_failure", 1), ("agent_error", 1), ("timeout", 1), ("cancelled", 1)],
)
def test_filtering_by_outcome_shows_only_those_rows(
    run: RunFixture, open_report: Any, outcome: str, rows: int
) -> None:
    page = open_report(run.path / "report.html").page
    page.select_option("#rc-outcome", outcome)
    visible = page.locator("tr.rc-row")
    assert visible.count() == rows
    if outcome:
        assert {visible.nth(i).get_attribute("data-outcome") for i in range(rows)} == {outcome}
    assert page.get_attribute("#rc-count", "data-count") == str(rows)


@needs_chromium
def test_search_narrows_the_table(run: RunFixture, open_report: Any) -> None:
    page = open_report(run.path / "report.html").page
    page.fill("#rc-search", "calc-1")
    assert page.locator("tr.rc-row").count() == 2
    page.select_option("#rc-outcome", "cancelled")
    assert page.locator("tr.rc-row").count() == 0
    page.fill("#rc-search", "")
    assert page.locator("tr.rc-row").count() == 1


@needs_chromium
def test_agent_html_and_script_are_shown_as_text_and_never_run(run: RunFixture, open_report: Any) -> None:
    opened = open_report(run.path / "report.html")
    page = opened.page
    page.click("tr.rc-row[data-id='calc-1-s1-t0']")
    section = page.locator("section.rollout[data-rollout-id='calc-1-s1-t0']")
    assert section.get_by_text(f"{XSS_SCRIPT} 4", exact=True).is_visible()  # the tool output
    assert section.get_by_text(f"{XSS_IMG} The answer is 5.", exact=True).first.is_visible()
    assert page.locator("img").count() == 0
    assert section.locator("script").count() == 0
    # Any late handler would have fired by the time a round trip through the page completes.
    assert page.evaluate("() => document.readyState") == "complete"
    assert opened.dialogs == []
    assert opened.errors == []


@needs_chromium
def test_rollout_section_shows_the_conversation_timings_and_receipt(
    run: RunFixture, open_report: Any
) -> None:
    page = open_report(run.path / "report.html").page
    page.click("tr.rc-row[data-id='calc-1-s0-t0']")
    section = page.locator("section.rollout[data-rollout-id='calc-1-s0-t0']")
    text = section.inner_text()
    assert "You are a careful calculator. Use tools." in text
    assert "Let me compute that with Python." in text
    assert "print(2+2)" in text
    assert "turn 0" in text and "120 in → 30 out" in text and "800 ms" in text
    assert "agrees: 2 model exchange(s) captured" in text
    assert "exit 0" in text
    reasoning = section.locator("details.reasoning")
    assert reasoning.count() == 1 and reasoning.get_attribute("open") is None  # folded until asked


@needs_chromium
def test_partial_rollout_and_capture_diff_are_shown(run: RunFixture, open_report: Any) -> None:
    page = open_report(run.path / "report.html").page
    page.click("tr.rc-row[data-id='calc-3-s0-t0']")
    partial = page.locator("section.rollout[data-rollout-id='calc-3-s0-t0']")
    assert partial.get_by_text("partial — not graded", exact=True).is_visible()
    page.click("tr.rc-row[data-id='calc-5-s0-t0']")
    mismatch = page.locator("section.rollout[data-rollout-id='calc-5-s0-t0']")
    assert "DISAGREES" in mismatch.inner_text()
    assert mismatch.locator("pre.diff .add", has_text='"temperature": 0.7').count() == 1
    assert "trajectory_capture_accounting" in mismatch.inner_text()


@needs_chromium
def test_the_page_makes_no_network_request(run: RunFixture, open_report: Any) -> None:
    opened = open_report(run.path / "report.html")
    opened.page.click("tr.rc-row[data-id='calc-1-s1-t0']")
    assert [url for url in opened.requests if not url.startswith("file://")] == []


@needs_chromium
def test_ten_thousand_rollouts_generate_and_load(tmp_path: Path, open_report: Any) -> None:
    metrics = write_large_run(tmp_path / "big", 10_000)
    report = write_report(tmp_path / "big")
    html = report.read_text()
    assert html.count('<script type="application/json" id="rc-d-') == 10_000
    page = open_report(report).page
    assert page.get_attribute("#rc-count", "data-count") == "10000"
    assert page.locator("tr.rc-row").count() == 100  # one page of the table, not 10,000 rows
    page.select_option("#rc-outcome", "timeout")
    assert page.get_attribute("#rc-count", "data-count") == str(metrics.outcomes["timeout"])
    page.locator("tr.rc-row").first.click()  # details are parsed only now
    assert page.locator("section.rollout").count() == 1
