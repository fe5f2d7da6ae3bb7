"""The worker's compiled bytecode: compiled once on the host, read by every rollout, never stale.

The worker runs ``python -I -B`` and its environment sets ``PYTHONDONTWRITEBYTECODE=1``,
so a rollout never writes bytecode (the sandbox could not keep it anyway). With an
editable install nothing else compiles ``src/rollcage`` either, so every rollout used to
compile the package from source (a large share of its CPU, ``bench/profile.py``).

Instead the supervisor compiles, once, everything the worker imports (its modules,
the whole packages they belong to, so lazy imports are covered, and the standard
library's top level) into a cache directory outside the sandbox's reach, and starts
the worker with ``-X pycache_prefix=CACHE``; under bubblewrap the cache is mounted
read-only. ``pycache_prefix`` makes Python look for bytecode *only* there, which is
why the priming covers whole packages.

Never stale: each ``.pyc`` records its source's modification time and size, and
Python checks them at every import; a source that changed since is compiled from
source in memory (a slower import, never old code). A fingerprint of the sources
(their paths, sizes and modification times) is kept beside the cache; when it no
longer matches, the next supervisor to start compiles again (only what changed).

The cache directory must belong to this user and be writable by nobody else (it is
code every rollout runs); otherwise, or if it cannot be made, the worker runs as
before, without a prefix. ``ROLLCAGE_BYTECODE_CACHE`` names another directory, or
``off``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import subprocess
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["BYTECODE_ENV", "WORKER_MODULES", "prime_bytecode", "worker_bytecode"]

logger = logging.getLogger("rollcage.supervisor")

BYTECODE_ENV = "ROLLCAGE_BYTECODE_CACHE"
"""A directory for the cache instead of the default (under ``$XDG_CACHE_HOME``), or ``off``."""

WORKER_MODULES = (
    "rollcage.cli",
    "rollcage.worker",
    "rollcage.model._client",  # the client itself: rollcage.model's face loads it on first use
    "rollcage.tools",
    "rollcage.environments",
    "asyncio",
    "json",
    # What the model client's first request imports (httpx's transport).
    "httpcore",
    "h11",
    "anyio",
    "sniffio",
    "certifi",
)
"""What the worker imports (one missing is skipped); their packages are compiled whole."""

_PRIME_TIMEOUT_S = 300.0
_STAMP = "sources.json"
_lock = threading.Lock()
_memo: dict[str, str | None] = {}

# Run by this interpreter with -X pycache_prefix=CACHE: import (so the exact modules are
# compiled as imported), then compile every package they belong to and the standard
# library's top level; print the directories whose sources the fingerprint covers.
_PRIME = r"""
import compileall, importlib, json, os, sys, sysconfig
os.umask(0o022)
paths, names = json.loads(sys.argv[1]), sys.argv[2:]
sys.path[:0] = paths
for name in names:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
roots = set()
for name, module in list(sys.modules.items()):
    paths = getattr(module, "__path__", None)
    if "." not in name and paths is not None:
        roots.update(os.path.realpath(p) for p in paths if os.path.isdir(p))
stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
for root in sorted(roots):
    compileall.compile_dir(root, quiet=2, workers=1)
compileall.compile_dir(stdlib, maxlevels=0, quiet=2)
files = set()
for module in list(sys.modules.values()):
    source = getattr(module, "__file__", None)
    if isinstance(source, str) and source.endswith(".py"):
        source = os.path.realpath(source)
        if not any(source.startswith(root + os.sep) for root in roots):
            files.add(source)
print(json.dumps({"recursive": sorted(roots), "flat": [stdlib], "files": sorted(files)}))
"""


def worker_bytecode() -> str | None:
    """The bytecode cache for the default worker, compiled if needed; ``None`` when unusable.

    Once per process (later calls return the same answer at once); blocking, run it
    in a thread. Concurrent callers wait for the one compiling.
    """
    choice = os.environ.get(BYTECODE_ENV, "")
    with _lock:
        if choice not in _memo:
            _memo[choice] = _resolve(choice)
        return _memo[choice]


def _resolve(choice: str) -> str | None:
    if choice.lower() == "off":
        return None
    if choice:
        cache = Path(choice)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        key = hashlib.sha256(
            "\0".join([os.path.realpath(sys.executable), sys.version, _package_root()]).encode()
        ).hexdigest()[:16]
        cache = base / "rollcage" / "bytecode" / key
    try:
        return str(prime_bytecode(cache, WORKER_MODULES))
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        logger.warning("no compiled bytecode for the worker (%s); every rollout compiles from source", exc)
        return None


def prime_bytecode(cache: Path, modules: Iterable[str], *, paths: Iterable[str] = ()) -> Path:
    """Compile ``modules`` (and their whole packages) into ``cache`` unless its fingerprint matches.

    Blocking. Returns the cache directory (absolute). ``paths`` go in front of the
    compiling interpreter's ``sys.path`` (which is this interpreter's, isolated mode).

    Raises:
        OSError: The directory cannot be made, or is not this user's alone.
        subprocess.SubprocessError: The compiling interpreter failed or took too long.
        ValueError: The compiling interpreter's report is not what it should be.
    """
    cache = cache.absolute()
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    info = os.lstat(cache)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise OSError(f"{cache} is not a directory that only this user can write")
    stamp = cache / _STAMP
    names = sorted(modules)
    extra = [os.path.abspath(path) for path in paths]
    try:
        recorded = json.loads(stamp.read_text())
        if (
            recorded.get("modules") == names
            and recorded.get("paths") == extra
            and recorded.get("sources") == _fingerprint(recorded)
        ):
            return cache
    except (OSError, ValueError, AttributeError):
        pass
    done = subprocess.run(
        [sys.executable, "-I", "-X", f"pycache_prefix={cache}", "-c", _PRIME, json.dumps(extra), *names],
        capture_output=True,
        text=True,
        timeout=_PRIME_TIMEOUT_S,
        check=True,
    )
    lines = done.stdout.splitlines()
    report = json.loads(lines[-1]) if lines else None
    if not isinstance(report, dict) or set(report) != {"recursive", "flat", "files"}:
        raise ValueError(f"unexpected report from the bytecode compiler: {done.stdout[-200:]!r}")
    report["modules"] = names
    report["paths"] = extra
    report["sources"] = _fingerprint(report)
    temp = cache / f".{_STAMP}.{os.getpid()}"
    temp.write_text(json.dumps(report))
    os.replace(temp, stamp)
    return cache


def _fingerprint(report: dict[str, Any]) -> str:
    """A digest of the path, size and modification time of every source the report covers."""
    digest = hashlib.sha256()
    for path in report["files"]:
        _digest_file(digest, path)
    for key, recursive in (("recursive", True), ("flat", False)):
        for root in report[key]:
            for directory, subdirs, files in os.walk(root):
                subdirs.sort()
                if not recursive:
                    subdirs.clear()
                for name in sorted(files):
                    if name.endswith(".py"):
                        _digest_file(digest, os.path.join(directory, name))
    return digest.hexdigest()


def _digest_file(digest: Any, path: str) -> None:
    try:
        info = os.stat(path)
    except OSError:
        digest.update(f"{path}\0missing\n".encode())
        return
    digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n".encode())


def _package_root() -> str:
    """The ``rollcage`` package directory (this module is in its ``supervisor`` room)."""
    return os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
