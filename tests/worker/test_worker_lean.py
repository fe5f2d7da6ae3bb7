"""What the warm template does once so that each worker it forks does not: the command line, logging.

Each check runs in a fresh interpreter (``python -I``) after the template's own warm-up
(:func:`rollcage.worker.warm_up`), as the template does before it forks: the process's logging and
caches are its own, not pytest's.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from rollcage.supervisor import BwrapSandbox, RolloutLayout, default_worker_command
from rollcage.supervisor.sandbox import BwrapLauncher, BwrapTools
from rollcage.worker import _SANDBOX_ARGV

TOOLS = BwrapTools(
    bwrap="/usr/bin/bwrap", prlimit="/usr/bin/prlimit", setpriv="/usr/bin/setpriv", disable_userns=True
)

_LOGGING_STATE = (
    "import json, logging\n"
    "root, noisy = logging.getLogger(), logging.getLogger('httpx')\n"
    "[handler] = root.handlers\n"
    "print(json.dumps({'root': root.level, 'httpx': noisy.level, 'handler': type(handler).__name__,\n"
    "    'stream': handler.stream is sys.stderr, 'format': handler.formatter._fmt,\n"
    "    'sweeps': sweeps}))\n"
)


def _run(script: str, *, warm: bool, env: dict[str, str] | None = None) -> str:
    """What ``script`` prints in a fresh interpreter, after the template's warm-up if ``warm``."""
    prefix = "import sys\n" + ("from rollcage.worker import warm_up\nwarm_up()\n" if warm else "")
    return subprocess.run(
        [sys.executable, "-I", "-c", prefix + script],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=env,
    ).stdout


_COUNT_SWEEPS = (
    "sweeps = 0\n"
    "clear = logging.Manager._clear_cache\n"
    "def counted(self):\n"
    "    global sweeps\n"
    "    sweeps += 1\n"
    "    clear(self)\n"
    "logging.Manager._clear_cache = counted\n"
)
"""Script lines that count logging's sweeps of every logger's cache (each ``setLevel`` makes one)."""


def _configured(level: str, *, warm: bool) -> dict[str, object]:
    """The logging a worker sets up at ``ROLLCAGE_LOG_LEVEL=level`` (and how many logger sweeps it made)."""
    configure = (
        "name = os.environ['ROLLCAGE_LOG_LEVEL'].upper()\n"
        "worker._configure_logging(logging.getLevelNamesMapping().get(name, logging.INFO))\n"
    )
    script = "import logging, os\nfrom rollcage import worker\n" + _COUNT_SWEEPS + configure
    out = _run(script + _LOGGING_STATE, warm=warm, env={"ROLLCAGE_LOG_LEVEL": level})
    result: dict[str, object] = json.loads(out)
    return result


def _basic_config(level: str) -> dict[str, object]:
    """The logging the worker set up before (``logging.basicConfig``), in a cold process."""
    script = (
        "import logging\n"
        "sweeps = None\n"
        f"level = {level.upper()!r}\n"
        "logging.basicConfig(\n"
        "    level=level if level in logging.getLevelNamesMapping() else 'INFO',\n"
        "    format='%(asctime)s %(levelname)s %(name)s: %(message)s',\n"
        "    stream=sys.stderr,\n"
        ")\n"
        "if logging.getLogger().level > logging.DEBUG:\n"
        "    logging.getLogger('httpx').setLevel(logging.WARNING)\n"
    )
    result: dict[str, object] = json.loads(_run(script + _LOGGING_STATE, warm=False))
    return result


def test_a_forked_worker_logs_as_basic_config_did_without_sweeping_the_templates_loggers() -> None:
    # Every setLevel clears the cache of each logger the process has: in a fork, a page copied for each
    # of the template's loggers. The template sets the default levels; its forks find them set.
    for level in ("info", "WARNING", "debug", "bogus"):
        expected = _basic_config(level)
        for warm in (True, False):
            got = _configured(level, warm=warm)
            sweeps = got.pop("sweeps")
            expected.pop("sweeps", None)
            assert got == expected, (level, warm)
            if warm and level.upper() in ("INFO", "BOGUS"):
                assert sweeps == 0, level  # the default: nothing to set after the fork


def test_the_sandboxs_command_line_is_the_one_the_template_parsed(tmp_path: Path) -> None:
    # The warm worker's command line is the sandbox's, the same for every rollout: the template parses it.
    launcher = BwrapLauncher(BwrapSandbox(executor_cage="shared"))
    launcher._tools = TOOLS  # the command line only: no bubblewrap is run
    plan = launcher.plan(
        RolloutLayout(tmp_path / "r"),
        worker_command=default_worker_command(None),
        worker_env={},
        token_env={},
        warm_cgroups=[],
    )
    assert plan.warm is not None
    assert tuple(plan.warm.argv) == _SANDBOX_ARGV


def test_a_worker_given_the_sandboxs_command_line_does_not_parse_it_again() -> None:
    out = _run(
        "import argparse\n"
        "from rollcage import worker\n"
        "fresh = vars(argparse.ArgumentParser.parse_args(worker._parser(), list(worker._SANDBOX_ARGV)))\n"
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError('parsed again')\n"
        "argparse.ArgumentParser.parse_args = refuse\n"
        "first = worker._parse_args(list(worker._SANDBOX_ARGV))\n"
        "first.checkpoint = None  # a worker's own copy: the next one is the template's again\n"
        "second = worker._parse_args(list(worker._SANDBOX_ARGV))\n"
        "print(vars(second) == fresh, second.checkpoint)\n",
        warm=True,
    )
    assert out.split() == ["True", "/rollout/checkpoint.jsonl"]


def test_any_other_command_line_is_parsed_as_before() -> None:
    out = _run(
        "from rollcage import worker\n"
        "args = worker._parse_args(['in.json', 'out/result.json', '--workspace', 'w'])\n"
        "print(args.input, args.result, args.workspace, args.checkpoint)\n",
        warm=True,
    )
    assert out.split() == ["in.json", "out/result.json", "w", "None"]


def test_a_warm_worker_starts_without_parsing_or_sweeping_loggers() -> None:
    # The whole worker_main, in a fork's place: given the sandbox's command line (no /rollout here:
    # its input cannot be read, which ends it as an invalid input), it neither parses the command
    # line again nor sets a logging level the template set already.
    start = (
        "def refuse(*args, **kwargs):\n"
        "    raise AssertionError('parsed again')\n"
        "argparse.ArgumentParser.parse_args = refuse\n"
        "code = worker.worker_main(list(worker._SANDBOX_ARGV))\n"
        "print(code, sweeps, logging.getLogger().level, logging.getLogger('httpx').level)\n"
    )
    out = _run(
        "import argparse, logging\nfrom rollcage import worker\n" + _COUNT_SWEEPS + start,
        warm=True,
        env={"ROLLCAGE_LOG_LEVEL": "INFO"},
    )
    assert out.split() == ["2", "0", str(logging.INFO), str(logging.WARNING)]
