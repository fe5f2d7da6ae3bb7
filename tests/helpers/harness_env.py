"""The harness tests' Python environment: NOOA installed once, cached across runs, shared by xdist workers.

``rollcage harness install nooa`` makes it (the product's own installer) under a test cache
keyed by NOOA's version (``$ROLLCAGE_TEST_CACHE``, default ``~/.cache/rollcage-tests``), so a
machine pays the install once (about 40 s with PyPI reachable) and every later run reuses it.
Two command-line agents are added to the same environment: ``cli-agent``
(``examples/command-agent/agent.py``, on the openai SDK that NOOA's litellm already brings)
and, where it installs, mini-swe-agent (without its dataset and TUI extras, which its ``mini``
command does not import).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rollcage.harness import NOOA_VERSION, install_harness

__all__ = ["MINI_VERSION", "HarnessEnvs", "prepare_harness_envs"]

REPO = Path(__file__).resolve().parents[2]
MINI_VERSION = "2.4.6"
_MINI = [
    f"mini-swe-agent=={MINI_VERSION}",
    "platformdirs",
    "prompt_toolkit",
    "rich",
    "tenacity",
    "typer",
    "shellingham",
    "annotated-doc",
    "markdown-it-py",
    "mdurl",
    "pygments",
    "wcwidth",
]


@dataclass(frozen=True)
class HarnessEnvs:
    """Where the harness tests' environment is.

    Attributes:
        home: A ``ROLLCAGE_HARNESS_HOME`` holding ``nooa-<version>`` (what ``rollcage run`` finds).
        env: The environment itself (``--harness-env``).
        mini: ``None`` when mini-swe-agent is installed in it; else why not.
    """

    home: Path
    env: Path
    mini: str | None


def _cache() -> Path:
    explicit = os.environ.get("ROLLCAGE_TEST_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rollcage-tests"


def prepare_harness_envs() -> HarnessEnvs:
    """Install (once) and return the environment; blocking, under a lock shared by every process."""
    home = _cache() / "harness"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        env = install_harness("nooa", target=home / f"nooa-{NOOA_VERSION}", log=False)
        agent = env / "bin" / "cli-agent"
        staged = agent.with_suffix(".new")
        shutil.copyfile(REPO / "examples" / "command-agent" / "agent.py", staged)
        staged.chmod(0o755)
        os.replace(staged, agent)
        return HarnessEnvs(home=home, env=env, mini=_install_mini(env))


def _install_mini(env: Path) -> str | None:
    marker = env / f".mini-swe-agent-{MINI_VERSION}"
    if marker.exists():
        return None
    pip = [
        str(env / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--disable-pip-version-check",
        "--no-deps",
    ]
    done = subprocess.run([*pip, *_MINI], capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        return f"mini-swe-agent does not install here: {done.stderr.strip().splitlines()[-1:]}"
    check = [str(env / "bin" / "python"), "-c", "import minisweagent.run.mini"]
    quiet = {**os.environ, "HOME": str(env / ".home"), "MSWEA_CONFIGURED": "true"}
    done = subprocess.run(check, capture_output=True, text=True, timeout=300, check=False, cwd="/", env=quiet)
    if done.returncode != 0:
        return f"mini-swe-agent does not import here: {done.stderr.strip().splitlines()[-1:]}"
    marker.write_text(sys.version)
    return None
