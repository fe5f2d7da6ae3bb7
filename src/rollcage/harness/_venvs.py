"""A harness's own Python: found on the machine, installed once, mounted read-only in every sandbox.

NOOA needs Python >= 3.12 (< 3.14) and its own packages (litellm, ...), which
rollcage's interpreter need not have. ``rollcage harness install nooa`` makes a
virtual environment for it from an interpreter already on the machine (``--python``,
else the newest suitable one on ``PATH``, under pyenv or uv, or in ``/usr``), installs
the pinned NOOA into it with pip, and marks it complete last; a half-made
environment is never taken for one. ``rollcage run`` never downloads anything: it
finds the installed environment (or the one ``--harness-env PATH`` names), checks it
once, and refuses with one line if it is missing or lacks what the harness needs.

The environment lives in ``$ROLLCAGE_HARNESS_HOME`` (default
``$XDG_CACHE_HOME/rollcage/harness``, else ``~/.cache/rollcage/harness``), one
directory per harness and version (``nooa-0.0.10``). Every sandbox mounts it, and
the interpreter it was made from, read-only at the same paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from rollcage.cage import outermost
from rollcage.errors import ConfigError, HarnessUnavailableError
from rollcage.protocol import HarnessEnvironment

__all__ = [
    "COMMAND_SYSTEM_PATH",
    "NOOA_PYTHONS",
    "NOOA_VERSION",
    "command_search_path",
    "default_environment_dir",
    "find_python",
    "harness_home",
    "install_harness",
    "missing_program",
    "resolve_environment",
]

NOOA_VERSION = "0.0.10"
"""The NOOA release the adapter is written and tested against (``rollcage harness install nooa``)."""

NOOA_PYTHONS: tuple[tuple[int, int], ...] = ((3, 12), (3, 13))
"""Interpreters NOOA supports (its ``Requires-Python``: >= 3.12, < 3.14), preferred first."""

_MARKER = ".rollcage-harness.json"
_PROBE_TIMEOUT_S = 60.0
_PIP_TIMEOUT_S = 1800.0
_PROBE = (
    "import importlib.util, json, sys; "
    "print(json.dumps({'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'exec_prefix': sys.exec_prefix, "
    "'base_exec_prefix': sys.base_exec_prefix, 'executable': sys.executable, "
    "'version': list(sys.version_info[:2]), 'nooa': importlib.util.find_spec('nooa') is not None}))"
)


COMMAND_SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
"""Where a command harness's program is looked up after its environment's bin (the sandbox's PATH)."""


def command_search_path(environment: HarnessEnvironment | None) -> str:
    """The PATH a command harness runs with: its environment's bin first, then the system's programs."""
    return f"{environment.bin}:{COMMAND_SYSTEM_PATH}" if environment is not None else COMMAND_SYSTEM_PATH


def missing_program(program: str, environment: HarnessEnvironment | None) -> str | None:
    """Why a command harness's ``argv[0]`` cannot be started, or ``None`` when it can (or cannot be told).

    A bare name is looked up as the sandbox looks it up (:func:`command_search_path`); an
    absolute path must be an executable file; a relative path with a slash names a file in
    the task's workspace, which does not exist before the rollout, so it is not checked.
    """
    if "/" not in program:
        if shutil.which(program, path=command_search_path(environment)) is None:
            return f"{program!r} is not on the harness's PATH ({command_search_path(environment)})"
        return None
    if os.path.isabs(program) and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        return f"{program} is not an executable file"
    return None


def harness_home() -> Path:
    """Where installed harness environments live (see the module docstring)."""
    explicit = os.environ.get("ROLLCAGE_HARNESS_HOME")
    if explicit:
        return Path(explicit)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "rollcage" / "harness"


def default_environment_dir(kind: Literal["nooa"] = "nooa", version: str = NOOA_VERSION) -> Path:
    """The directory ``rollcage harness install`` makes for ``kind`` at ``version``."""
    return harness_home() / f"{kind}-{version}"


def _candidates() -> Iterator[str]:
    names = [f"python{major}.{minor}" for major, minor in NOOA_PYTHONS] + ["python3"]
    for name in names:
        found = shutil.which(name)
        if found:
            yield found
    pyenv = os.environ.get("PYENV_ROOT") or os.path.join(os.path.expanduser("~"), ".pyenv")
    for major, minor in NOOA_PYTHONS:
        yield from sorted(glob.glob(os.path.join(pyenv, "versions", f"{major}.{minor}*", "bin", "python3")))
        uv = os.path.join(os.path.expanduser("~"), ".local", "share", "uv", "python")
        yield from sorted(glob.glob(os.path.join(uv, f"cpython-{major}.{minor}*", "bin", "python3")))
        for prefix in ("/usr/local/bin", "/usr/bin"):
            yield os.path.join(prefix, f"python{major}.{minor}")


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [python, "-I", "-S", "-c", "import sys; print(*sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = out.stdout.split()
    if out.returncode != 0 or len(parts) != 2 or not all(part.isdigit() for part in parts):
        return None
    return int(parts[0]), int(parts[1])


def find_python(supported: tuple[tuple[int, int], ...] = NOOA_PYTHONS) -> str | None:
    """An interpreter on this machine of a supported version (the first listed preferred); blocking.

    Looks on ``PATH``, under pyenv (``$PYENV_ROOT``, ``~/.pyenv``), uv's managed
    interpreters and ``/usr``; ``None`` if there is none.
    """
    found: dict[tuple[int, int], str] = {}
    seen: set[str] = set()
    for candidate in _candidates():
        real = os.path.realpath(candidate)
        if real in seen or not os.access(candidate, os.X_OK):
            continue
        seen.add(real)
        version = _version(candidate)
        if version in supported and version not in found:
            found[version] = candidate
    return next((found[version] for version in supported if version in found), None)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _installed(target: Path, version: str) -> bool:
    try:
        marker = json.loads((target / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(marker, dict) and marker.get("version") == version and (target / "bin" / "python").exists()
    )


def install_harness(
    kind: Literal["nooa"] = "nooa",
    *,
    python: str | None = None,
    target: Path | None = None,
    version: str = NOOA_VERSION,
    log: bool = True,
) -> Path:
    """Make ``kind``'s environment (once: an installed one is kept), and return its directory; blocking.

    A lock makes concurrent installs of the same directory wait for each other; a
    directory without the completion marker (an install that was interrupted) is
    made again from scratch.

    Args:
        kind: The harness (``nooa``).
        python: The interpreter to make it from; ``None``: :func:`find_python`.
        target: Where; ``None``: :func:`default_environment_dir`.
        version: The NOOA release.
        log: Print what is done on stderr.

    Raises:
        ConfigError: No suitable interpreter (the message says which versions and how to give one).
        HarnessUnavailableError: The environment could not be made (pip failed: its last lines
            are in the message).
    """
    target = (target or default_environment_dir(kind, version)).absolute()
    with _locked(target):
        if _installed(target, version):
            return target
        interpreter = python or find_python()
        wanted = " or ".join(f"{major}.{minor}" for major, minor in NOOA_PYTHONS)
        if interpreter is None:
            raise ConfigError(
                f"no Python {wanted} found on this machine (PATH, pyenv, uv, /usr) for NOOA: install one, "
                "or pass --python PATH"
            )
        found = _version(interpreter)
        if found not in NOOA_PYTHONS:
            raise ConfigError(f"{interpreter} is Python {found or 'unknown'}; NOOA needs Python {wanted}")
        if target.exists():
            shutil.rmtree(target)
        started = time.monotonic()
        if log:
            print(f"rollcage harness install: making {target} from {interpreter}", file=sys.stderr)
        _run([interpreter, "-m", "venv", str(target)], "making the virtual environment")
        pip = [str(target / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        _run([*pip, f"nooa=={version}"], f"installing nooa=={version}")
        probe = _probe(str(target / "bin" / "python"))
        if probe is None or not probe.get("nooa"):
            raise HarnessUnavailableError(f"nooa was installed into {target} but cannot be found there")
        (target / _MARKER).write_text(
            json.dumps({"harness": kind, "version": version, "python": interpreter, "made_at": time.time()})
        )
        if log:
            print(
                f"rollcage harness install: nooa {version} ready in {time.monotonic() - started:.0f}s",
                file=sys.stderr,
            )
    return target


def _run(argv: list[str], what: str) -> None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HarnessUnavailableError(f"{what} failed: {exc}") from exc
    if out.returncode != 0:
        tail = " | ".join(line for line in (out.stderr or out.stdout).strip().splitlines()[-3:])
        raise HarnessUnavailableError(f"{what} failed (exit code {out.returncode}): {tail}")


def _probe(python: str) -> dict[str, object] | None:
    try:
        out = subprocess.run(
            [python, "-I", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
            check=False,
        )
        value = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    return value if isinstance(value, dict) else None


def resolve_environment(kind: Literal["nooa", "command"], path: Path | None) -> HarnessEnvironment | None:
    """The environment ``kind`` runs with, checked; blocking (one interpreter start).

    Args:
        kind: ``nooa`` (an environment is required: ``path``, else the installed one) or
            ``command`` (``path`` if given, else none: the system's programs).
        path: A virtual environment (``PATH/bin/python``) given with ``--harness-env``.

    Returns:
        The environment as the sandbox sees it, or ``None`` (a command without one).

    Raises:
        ConfigError: It is missing, is not a virtual environment, or (nooa) lacks NOOA; one line
            that says what to do.
    """
    if path is None:
        if kind == "command":
            return None
        path = default_environment_dir()
        if not _installed(path, NOOA_VERSION):
            raise ConfigError(
                f"the nooa harness is not installed (no {path}): run 'rollcage harness install nooa' once, "
                "or give --harness-env PATH (a virtualenv with nooa)"
            )
    path = path.absolute()
    python = path / "bin" / "python"
    if not python.exists():
        raise ConfigError(f"--harness-env {path}: not a virtual environment (no {python})")
    probe = _probe(str(python))
    if probe is None:
        raise ConfigError(f"--harness-env {path}: its interpreter {python} does not run")
    raw = probe.get("version")
    version = tuple(int(part) for part in raw) if isinstance(raw, list) else ()
    if kind == "nooa" and (version not in NOOA_PYTHONS or not probe.get("nooa")):
        has = "found" if probe.get("nooa") else "missing"
        raise ConfigError(
            f"{path} cannot run the nooa harness (Python {'.'.join(map(str, version)) or '?'}, nooa {has}): "
            "make one with 'rollcage harness install nooa'"
        )
    roots = [str(probe.get(key)) for key in ("prefix", "base_prefix", "exec_prefix", "base_exec_prefix")]
    roots += [os.path.dirname(os.path.realpath(str(python))), os.path.realpath(str(probe.get("base_prefix")))]
    mounts = outermost(os.path.abspath(root) for root in roots if root and root != "None")
    return HarnessEnvironment(python=str(python), bin=str(path / "bin"), mounts=mounts)
