"""httpx, imported without its command-line tool.

``httpx/__init__`` imports its CLI (click, rich, pygments) whenever those are
installed, as they are for rollcage's own CLI: CPU and memory in every worker
process (``bench/imports.py``), for code the worker never runs. Marking those packages
unimportable for the duration of this one import makes httpx fall back to its
stub ``main``; the marks are removed at once, so a later ``import rich`` works as
usual. Where httpx was already imported, this is a plain import. Every module of
rollcage that uses httpx imports it from here (through :mod:`rollcage.http`).
"""

from __future__ import annotations

import sys

__all__ = ["httpx"]

_blocked = (
    [] if "httpx" in sys.modules else [n for n in ("click", "rich", "pygments") if n not in sys.modules]
)
for _name in _blocked:
    sys.modules[_name] = None  # type: ignore[assignment]
try:
    import httpx
finally:
    for _name in _blocked:
        if _name in sys.modules and sys.modules[_name] is None:
            del sys.modules[_name]
