"""The documentation's runnable shell blocks run, and pass, as written.

A block is runnable when the line before its opening fence is ``<!-- runnable -->`` (an HTML
comment: invisible on the site). Every runnable block of one page runs in order in one fresh
directory that holds a link to the repository's ``examples/``, with this environment's
``bin/`` first on ``PATH`` (so ``rollcage`` and ``python`` are the ones under test), under
``bash -euo pipefail``: a failing command fails the test, naming the page and the block.
Blocks are meant to take seconds: the embedded scripted policy, no network.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import EXAMPLES, REPO

DOCS = REPO / "docs"
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(?P<lang>[\w-]*)")
BLOCK_TIMEOUT_S = 300


def runnable_blocks(page: Path) -> list[str]:
    """The runnable blocks of a page, in order; a marker not followed by a shell fence is an error."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[str] = []
    for index, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        opening = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
        if opening is None or opening["lang"] not in ("bash", "sh", "shell"):
            raise ValueError(f"{page}:{index + 1}: {MARKER} must be followed by a ```bash block")
        end = next((k for k in range(index + 2, len(lines)) if lines[k].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{index + 2}: the runnable block is never closed")
        blocks.append("\n".join(lines[index + 2 : end]))
    return blocks


def pages_with_blocks() -> list[Path]:
    return sorted(page for page in DOCS.rglob("*.md") if runnable_blocks(page))


def run_block(
    block: str, cwd: Path, *, timeout_s: float = BLOCK_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run one block under bash in its own session; on timeout its whole process group is killed."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    process = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n(killed after {timeout_s} s)"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


def run_page(page: Path, workdir: Path) -> None:
    """Run a page's runnable blocks in order in ``workdir``; the first that fails fails the test."""
    label = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    (workdir / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    for number, block in enumerate(runnable_blocks(page), start=1):
        done = run_block(block, workdir)
        assert done.returncode == 0, (
            f"{label}, runnable block {number} exited {done.returncode}:\n"
            f"{block}\n--- output (last 4000 characters) ---\n{done.stdout[-4000:]}"
        )


@pytest.mark.parametrize("page", pages_with_blocks(), ids=lambda page: str(page.relative_to(DOCS)))
def test_runnable_blocks_of_a_page_succeed(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path)


def test_the_quick_start_and_the_guides_have_runnable_blocks() -> None:
    pages = {str(page.relative_to(DOCS)) for page in pages_with_blocks()}
    assert "getting-started.md" in pages
    assert len([page for page in pages if page.startswith("guides/")]) >= 6, pages


def test_a_failing_block_fails_its_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```bash\ntrue\nrollcage show no-such-run\necho unreachable\n```\n")
    workdir = tmp_path / "work"
    workdir.mkdir()
    with pytest.raises(AssertionError, match="runnable block 1 exited"):
        run_page(page, workdir)


def test_a_marker_without_a_shell_block_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n\n```bash\ntrue\n```\n")
    with pytest.raises(ValueError, match="must be followed by"):
        runnable_blocks(page)
