"""The house's shape: which room may import which, and no module reaching into another's private names.

A *room* is a top-level module or package of ``rollcage`` (``rollcage.supervisor``,
``rollcage.durable``). Rooms are layered as DESIGN.md lists them, with the
shared ground (``errors``, ``procs``, ``cage``) at the bottom: a module imports
its own room and rooms below it, never one above (the protocol is how the upper
rooms speak to the lower). What a module names with a leading underscore is its
own: no other module imports it, and no other room imports a room's private
modules. Imports under ``if TYPE_CHECKING:`` name types only; they are checked
for privacy, not for layering.

The house rules that go with it: every private module declares ``__all__``;
``asyncio.shield`` is spoken only by the cancellation dialect (``procs``); only
``procs`` signals or reaps a process by PID; every public async function says
what a cancellation does; no function is more complex than ruff's C90 bound of 20.

The source is read with ``ast`` (and ruff, for complexity); nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

SRC = REPO / "src" / "rollcage"

LAYERS: tuple[str, ...] = (
    "errors",  # the one exception hierarchy
    "headers",  # values others supply, made into HTTP header bytes
    "procs",  # process lifecycle and the cancellation dialect
    "protocol",  # the artifacts' shapes
    "durable",  # atomic publication, the journal
    "runfiles",  # a run directory's own files: read inside it, never write over it
    "filewatch",  # waiting for a file to appear
    "images",  # the image store and copy-on-write roots (the cage mounts them)
    "cage",  # the containment primitive
    "forkserver",  # the fork servers: their messages and codec, loop and client (warm workers, executors)
    "model",  # the model client
    "tools",  # executor, resource tools
    "trajectory",  # recording and projecting calls
    "checkpoint",  # reading a journal back
    "resume",  # continuing an attempt from its journal
    "agent",  # the loop
    "harness",  # black-box agents (nooa, command) in the loop's place
    "worker",  # the sandbox entrypoint
    "warm",  # the template that forks workers into their cages
    "supervisor",  # one rollout: sandbox, proxy, receipt
    "policy",  # the scripted model server
    "environments",  # bundled resource servers and graders
    "controller",  # a dataset through supervisors
    "export",  # a run's records in other tools' formats
    "viewer",  # show and report
    "commands",  # the CLI verbs
    "cli",  # the entry point
    "__main__",
)
"""Every room, bottom first: a room may import only itself and the rooms before it."""

FACE = "__init__"
"""The package's own face (``rollcage/__init__.py``): it may import any room, and nothing imports
it but for ``__version__``."""


@dataclass(frozen=True)
class Import:
    """One ``rollcage`` import found in a module."""

    module: str
    """The importing module (``rollcage.supervisor.core``)."""
    target: str
    """The imported module (``rollcage.procs``)."""
    names: tuple[str, ...]
    """Names imported from it (``from X import a, b``); empty for ``import X``."""
    line: int
    type_only: bool
    """Under ``if TYPE_CHECKING:``."""

    def __str__(self) -> str:
        what = f"from {self.target} import {', '.join(self.names)}" if self.names else f"import {self.target}"
        return f"{self.module}:{self.line}: {what}"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACE


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _type_checking_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(sub) for sub in ast.walk(child))
    return inside


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] == "rollcage":
                names = tuple(alias.name for alias in node.names)
                found.append(Import(module, target, names, node.lineno, id(node) in type_only))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rollcage":
                    found.append(Import(module, alias.name, (), node.lineno, id(node) in type_only))
    return found


def _all_imports() -> list[Import]:
    return [found for path in sorted(SRC.rglob("*.py")) for found in _imports(path)]


def _trees() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        yield _module_name(path), ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _public_async_functions(body: list[ast.stmt], prefix: str) -> Iterator[tuple[str, ast.AsyncFunctionDef]]:
    """Async functions reachable by a user: module level, or methods of public classes (dunders too)."""
    for node in body:
        if isinstance(node, ast.ClassDef) and not _private(node.name):
            yield from _public_async_functions(node.body, f"{prefix}{node.name}.")
        elif isinstance(node, ast.AsyncFunctionDef) and not _private(node.name):
            yield f"{prefix}{node.name}", node


def test_every_room_has_a_place_in_the_layers() -> None:
    rooms = {_room(_module_name(path)) for path in SRC.rglob("*.py")} - {FACE}
    assert sorted(rooms - set(LAYERS)) == []
    assert sorted(set(LAYERS) - rooms) == []


def test_no_module_imports_a_room_above_its_own() -> None:
    rank = {room: index for index, room in enumerate(LAYERS)}
    upward = []
    for found in _all_imports():
        source, target = _room(found.module), _room(found.target)
        if found.type_only or source == target or source == FACE:
            continue
        if target == FACE:
            if found.names != ("__version__",):
                upward.append(f"{found} (the package face imports the rooms, not the other way)")
        elif rank[target] > rank[source]:
            upward.append(f"{found} ({source} sits below {target})")
    assert upward == []


def test_no_module_imports_another_rooms_private_module() -> None:
    reaching = [
        str(found)
        for found in _all_imports()
        if _room(found.module) != _room(found.target)
        and any(_private(part) for part in found.target.split(".")[2:])
    ]
    assert reaching == []


def test_no_module_imports_another_modules_private_name() -> None:
    reaching = [
        str(found)
        for found in _all_imports()
        if found.target != found.module and any(_private(name) for name in found.names)
    ]
    assert reaching == []


def test_asyncio_shield_is_spoken_only_by_the_cancellation_dialect() -> None:
    # shielded() finishes the work and re-raises a cancellation; wait_shared() waits without
    # cancelling a shared future. A bare asyncio.shield is neither, and loses one or the other.
    speakers = [
        f"{module}:{node.lineno}"
        for module, tree in _trees()
        if module != "rollcage.procs._cancel"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "shield" and ast.unparse(node.value) == "asyncio"
    ]
    assert speakers == []


_PID_CALLS = frozenset(
    {"os.kill", "os.killpg", "os.waitpid", "os.waitid", "os.pidfd_open", "signal.pidfd_send_signal"}
)
"""Calls that signal or reap a process by number: racy with PID reuse unless done the procs way."""


def test_only_procs_signals_or_reaps_a_process_by_pid() -> None:
    # procs checks a pidfd after opening it and keeps children unreaped while their group is
    # signalled; a bare os.kill elsewhere can hit a reused PID, or a group that is no longer ours.
    callers = [
        f"{module}:{node.lineno}: {ast.unparse(node.func)}"
        for module, tree in _trees()
        if _room(module) != "procs"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and ast.unparse(node.func) in _PID_CALLS
    ]
    assert callers == []


def test_every_public_async_function_says_what_a_cancellation_does() -> None:
    silent = [
        f"{module}.{name}:{node.lineno}"
        for module, tree in _trees()
        for name, node in _public_async_functions(tree.body, "")
        if "Cancellation:" not in (ast.get_docstring(node) or "")
    ]
    assert silent == []


def test_no_function_is_more_complex_than_twenty_branches() -> None:
    # Checked apart from pyproject.toml's ruff settings, and through any noqa, so neither a
    # loosened config nor a suppression comment lets a function grow past the bound.
    checked = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--isolated",
            "--no-cache",
            "--ignore-noqa",
            "--select",
            "C901",
            "--config",
            "lint.mccabe.max-complexity = 20",
            "--output-format",
            "concise",
            str(SRC),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    "path", sorted(p for p in SRC.rglob("_*.py") if not p.name.startswith("__")), ids=lambda p: p.name
)
def test_every_private_module_declares_what_it_offers(path: Path) -> None:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    assigned = {
        target.id
        for node in tree.body
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    assert "__all__" in assigned
