"""Every command-line error a user can make, on every verb: one line on stderr, exit 2, no traceback.

Table-driven: each row is a command line (with the files it needs made first)
and words its one line must contain. All rows run as real ``rollcage``
processes, concurrently, once; the table's tests read the results.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

ROOT = REPO
DATASET = ROOT / "examples" / "calc-weather" / "dataset.jsonl"
ALIAS_BOMB = "\n".join(
    [
        'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]',
        *(
            f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]"
            for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
        ),
        'tasks: {"*": [{"text": "hi"}]}',
    ]
)


@dataclass(frozen=True)
class Row:
    """One error case: the command line (``{tmp}`` is the case's directory) and words of its message."""

    name: str
    argv: tuple[str, ...]
    says: str
    verb: str = ""


def _make_files(tmp: Path) -> None:
    (tmp / "bomb.yaml").write_text(ALIAS_BOMB)
    (tmp / "not-utf8.yaml").write_bytes(b'tasks:\n  "*": [{text: "\xff\xfe"}]\n')
    os.mkfifo(tmp / "fifo.yaml")
    (tmp / "rollout").mkdir()
    (tmp / "rollout" / "input.json").write_text("{}")
    (tmp / "run").mkdir()
    (tmp / "run" / "rollouts.jsonl").write_text("")
    (tmp / "a-file").write_text("x")


ROWS = [
    # run
    Row("run-no-dataset", ("run", "{tmp}/missing.jsonl", "--out", "{tmp}/o"), "cannot read dataset"),
    Row("run-model-not-a-url", ("run", str(DATASET), "--model", "not a url", "--model-name", "m"), "--model"),
    Row(
        "run-unset-key",
        (
            "run",
            str(DATASET),
            "--model",
            "http://127.0.0.1:9/v1",
            "--model-name",
            "m",
            "--api-key-env",
            "ROLLCAGE_TEST_SURELY_UNSET",
        ),
        "ROLLCAGE_TEST_SURELY_UNSET is not set",
    ),
    Row("run-deadline-inf", ("run", str(DATASET), "--deadline", "inf"), "finite"),
    Row("run-grace-nan", ("run", str(DATASET), "--grace", "nan"), "--grace"),
    Row("run-concurrency-0", ("run", str(DATASET), "--concurrency", "0"), "--concurrency"),
    Row(
        "run-budget-without-sandbox",
        ("run", str(DATASET), "--sandbox", "none", "--memory-budget", "1G", "--out", "{tmp}/o"),
        "--memory-budget needs --sandbox bwrap",
    ),
    Row(
        "supervise-budget-without-sandbox",
        ("supervise", "{tmp}/rollout", "--sandbox", "none", "--workspace-inodes", "100"),
        "--workspace-inodes needs --sandbox bwrap",
    ),
    Row(
        "run-policy-alias-bomb",
        ("run", str(DATASET), "--policy", "{tmp}/bomb.yaml", "--out", "{tmp}/o", "--quiet"),
        "aliases",
    ),
    Row(
        "run-policy-not-utf8",
        ("run", str(DATASET), "--policy", "{tmp}/not-utf8.yaml", "--out", "{tmp}/o", "--quiet"),
        "not UTF-8",
    ),
    # supervise
    Row("supervise-no-dir", ("supervise", "{tmp}/missing"), "missing"),
    Row("supervise-deadline-inf", ("supervise", "{tmp}/rollout", "--deadline", "inf"), "finite"),
    Row("supervise-grace-nan", ("supervise", "{tmp}/rollout", "--grace", "nan"), "finite"),
    Row(
        "supervise-bad-worker-command",
        ("supervise", "{tmp}/rollout", "--worker-command", 'a "b'),
        "--worker-command",
    ),
    # serve-policy
    Row(
        "serve-policy-port-out-of-range",
        ("serve-policy", "--script", "{tmp}/bomb.yaml", "--port", "99999"),
        "--port",
    ),
    Row("serve-policy-alias-bomb", ("serve-policy", "--script", "{tmp}/bomb.yaml", "--port", "0"), "aliases"),
    Row(
        "serve-policy-not-utf8",
        ("serve-policy", "--script", "{tmp}/not-utf8.yaml", "--port", "0"),
        "not UTF-8",
    ),
    Row("serve-policy-fifo", ("serve-policy", "--script", "{tmp}/fifo.yaml", "--port", "0"), "FIFO"),
    Row("serve-policy-no-script", ("serve-policy", "--script", "{tmp}/missing.yaml"), "No such file"),
    Row(
        "serve-policy-bad-fault",
        ("serve-policy", "--script", "{tmp}/x.yaml", "--fault", "call=x:kind=nope"),
        "fault",
    ),
    Row(
        "serve-policy-rate-nan",
        ("serve-policy", "--script", "{tmp}/x.yaml", "--fault-rate", "nan"),
        "--fault-rate",
    ),
    # show
    Row("show-missing", ("show", "{tmp}/missing"), "no such file"),
    Row("show-negative-limit", ("show", "{tmp}/run", "--limit", "-1"), "--limit"),
    Row("show-unknown-file", ("show", "{tmp}/a-file"), "not a file the viewer knows"),
    # report
    Row("report-missing", ("report", "{tmp}/missing"), "no such directory"),
    Row("report-to-a-directory", ("report", "{tmp}/run", "-o", "{tmp}"), "contains the run directory"),
    Row("report-to-a-fifo", ("report", "{tmp}/run", "-o", "{tmp}/fifo.yaml"), "is a FIFO"),
    Row("report-under-a-file", ("report", "{tmp}/run", "-o", "{tmp}/a-file/r.html"), "is not a directory"),
    # schema, worker, and the entry point itself
    Row("schema-unknown", ("schema", "Nope"), "unknown artifact"),
    Row("worker-no-arguments", ("worker",), "required"),
    Row("worker-unknown-option", ("worker", "a", "b", "--frobnicate"), "unrecognized"),
    Row("unknown-verb", ("frobnicate",), "No such command"),
]


@dataclass
class Outcome:
    code: int | None
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    procs: dict[str, tuple[subprocess.Popen[str], Path]] = {}
    env = {key: value for key, value in os.environ.items() if key != "ROLLCAGE_TEST_SURELY_UNSET"}
    for row in ROWS:
        tmp = tmp_path_factory.mktemp(row.name)
        _make_files(tmp)
        argv = [arg.replace("{tmp}", str(tmp)) for arg in row.argv]
        procs[row.name] = (
            subprocess.Popen(
                [sys.executable, "-m", "rollcage", *argv],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            tmp,
        )
    done: dict[str, Outcome] = {}
    # One bound for all (a command that hangs must not stack up), generous: 30-odd interpreters start
    # at once, and on a busy machine each may take a minute to import and exit.
    deadline = time.monotonic() + 240
    for name, (proc, _) in procs.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            done[name] = Outcome(proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            done[name] = Outcome(None, out, err + "\n[hung: killed by the test]")
    return done


@pytest.mark.timeout(420)
@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_a_usage_error_is_one_line_and_exit_2(outcomes: dict[str, Outcome], row: Row) -> None:
    outcome = outcomes[row.name]
    lines = outcome.stderr.strip().splitlines()
    assert "Traceback" not in outcome.stderr + outcome.stdout
    assert outcome.code == 2, (outcome.code, outcome.stderr[-800:])
    assert len(lines) == 1, outcome.stderr
    (line,) = lines
    verb = row.argv[0]
    assert line.startswith(f"rollcage {verb}: "), line
    assert row.says in line, line


@pytest.mark.timeout(120)
def test_report_never_replaces_a_device_node(tmp_path: Path) -> None:
    """``-o /dev/full`` as root once put a regular file in place of the device: here on a node of our own."""
    node = tmp_path / "full"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
    except PermissionError:
        pytest.skip("creating a device node needs CAP_MKNOD")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rollouts.jsonl").write_text("")
    done = subprocess.run(
        [sys.executable, "-m", "rollcage", "report", str(tmp_path / "run"), "-o", str(node)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert stat.S_ISCHR(node.lstat().st_mode), "the device node was replaced"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".full.")], "a temporary file was left"
