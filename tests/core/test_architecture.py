"""The house's shape: which room may import which, and no module reaching into another's private names.

A *room* is a top-level module or package of ``rollcage`` (``rollcage.supervisor``,
``rollcage.durable``). Rooms are layered as DESIGN.md lists them, with the
shared ground (``errors``, ``procs``, ``budgets``, ``cage``) at the bottom: a module imports
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
import re
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
    "http",  # one HTTP/1.1 server loop, the client transport, the max_policy_calls rule
    "protocol",  # the artifacts' shapes
    "wire",  # what the model endpoint is sent and answers, read without I/O (both sides of the wall)
    "durable",  # atomic publication, the journal
    "runfiles",  # a run directory's own files: read inside it, never write over it
    "filewatch",  # waiting for a file to appear
    "budgets",  # the budgets: cgroup and tmpfs mechanisms, a rollout's budgets planned, made and read
    "images",  # the image store and copy-on-write roots (the cage mounts them)
    "cage",  # the containment primitive
    "forkserver",  # the fork servers: their messages and codec, loop and client (warm workers, executors)
    "model",  # the model client
    "tools",  # executor, resource tools
    "trajectory",  # recording and projecting calls
    "checkpoint",  # the journal: its one writer, and reading it back
    "resume",  # continuing an attempt from its journal
    "agent",  # the loop
    "harness",  # black-box agents (nooa, command) in the loop's place
    "worker",  # the sandbox entrypoint
    "warm",  # the template that forks workers into their cages
    "supervisor",  # one rollout: sandbox, proxy, receipt
    "policy",  # the scripted model server
    "environments",  # bundled resource servers and graders
    "controller",  # a dataset through supervisors
    "gym_sandbox",  # NeMo Gym's sandbox provider on the cage, the image store and image roots
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
    in_function: bool = False
    """Inside a function: run when it is called, not when the module is imported."""

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


def _function_nodes(tree: ast.Module) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            inside.update(id(sub) for sub in ast.walk(node) if sub is not node)
    return inside


def _imports(path: Path) -> list[Import]:
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    type_only = _type_checking_nodes(tree)
    in_function = _function_nodes(tree)
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
                found.append(
                    Import(module, target, names, node.lineno, id(node) in type_only, id(node) in in_function)
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rollcage":
                    lazy = id(node) in in_function
                    found.append(Import(module, alias.name, (), node.lineno, id(node) in type_only, lazy))
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


# --- the sandbox's wall -----------------------------------------------------------------------

WALLED = ("rollcage.supervisor", "rollcage.controller")
"""The processes outside the sandbox: they treat the worker as a black box that speaks files."""

_MODEL_TRANSPORT = frozenset({"rollcage.model"})
"""Of ``rollcage.model``, what the egress proxy shares with the client: the HTTP transport (and the
face, which loads the client only on first use). Everything else there is the client."""


def _behind_the_wall(module: str) -> bool:
    """The worker's side: the agent's loop, the tools, the model client, the worker and its harness runner."""
    if module == "rollcage.model" or module.startswith("rollcage.model."):
        return module not in _MODEL_TRANSPORT
    return any(
        module == side or module.startswith(f"{side}.")
        for side in ("rollcage.agent", "rollcage.tools", "rollcage.worker", "rollcage.harness.worker")
    )


def _modules() -> set[str]:
    return {_module_name(path) for path in SRC.rglob("*.py")}


def _loaded_with(found: Import, modules: set[str]) -> list[str]:
    """The modules an import loads: the target, each package above it, and the submodules it names."""
    parts = found.target.split(".")
    loaded = [".".join(parts[:end]) for end in range(1, len(parts) + 1)]
    loaded += [f"{found.target}.{name}" for name in found.names if f"{found.target}.{name}" in modules]
    return [name for name in loaded if name in modules]


def test_nothing_the_supervisor_or_controller_imports_reaches_behind_the_sandboxs_wall() -> None:
    # What importing a module runs (its module-level imports, not TYPE_CHECKING ones), followed
    # from every module of the supervisor and the controller, together with the imports inside
    # their own functions (those run in the supervisor's and the controller's processes too).
    modules = _modules()
    edges: dict[str, list[Import]] = {}
    for found in _all_imports():
        if not found.type_only:
            edges.setdefault(found.module, []).append(found)
    came_from: dict[str, str | None] = {m: None for m in modules if m.startswith(WALLED)}
    queue = sorted(came_from)
    while queue:
        module = queue.pop()
        walled = module.startswith(WALLED)
        for found in edges.get(module, []):
            if found.in_function and not walled:
                continue
            for loaded in _loaded_with(found, modules):
                if loaded not in came_from:
                    came_from[loaded] = f"{module}:{found.line}"
                    queue.append(loaded)
    crossing = []
    for module in sorted(m for m in came_from if _behind_the_wall(m)):
        chain, at = [module], came_from[module]
        while at is not None:
            chain.append(at)
            at = came_from[at.partition(":")[0]]
        crossing.append(" <- ".join(chain))
    assert crossing == []


@pytest.mark.parametrize("walled", WALLED)
def test_importing_the_supervisor_or_controller_loads_nothing_behind_the_wall(walled: str) -> None:
    # The import as Python runs it (lazy faces, __getattr__, whatever the source says), in a fresh
    # interpreter: the list -X importtime prints is every module the import loaded. Every name of
    # the face is asked for: a lazy face (the controller's) loads its modules only then.
    every_name = f"import {walled} as face; [getattr(face, name) for name in face.__all__]"
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", every_name],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = {
        line.rpartition("|")[2].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert walled in loaded  # the listing is what it claims to be
    assert sorted(name for name in loaded if _behind_the_wall(name)) == []


# --- faces as wide as their use ----------------------------------------------------------------

PUBLIC_API: dict[str, dict[str, str]] = {
    # Names of a room's face that nothing outside the room imports, kept on purpose. Each says why;
    # a name that gains an importer, or leaves the face, must leave this list too.
    "cage": {
        # rollcage.forkserver is handed the cage module and reads these through it (enter=...).
        "PID_NS": "the namespace a fork server joins, read through the module it is given",
        "clone_sibling": "how a fork server forks its parent's child, read through the module likewise",
    },
    "commands": {
        "fail": "the verbs' shared exit with a message, for a verb added outside the package",
        "finite": "the verbs' shared number option parser, likewise",
    },
    "environments": {"ToolInfo": "what EnvironmentInfo.tools holds: a user reading the registry gets it"},
    "export": {
        "ATIF_VERSION": "the ATIF version written, for a reader of the exported files",
        "NG_TRAJECTORY_VERSION": "the NeMo Gym trajectory version written, likewise",
        "ExportFormat": "the type of export_run's format argument",
        "ExportReport": "what export_run returns",
        "default_destination": "where export_run writes when told nothing, for a caller to show",
    },
    "images": {
        # i1..i3 build on the image store this round; these are its documented entry points.
        "CowRoot": "what cow_root returns",
        "ImageConfig": "an image's config as the store read it",
        "ImageEntry": "one image the store lists",
        "PruneReport": "what prune returns",
        "default_store_path": "where the store lives when STORE_ENV is unset",
        "prepare": "pull and unpack an image into the store",
    },
    "policy": {
        "FaultRecord": "what PolicyServer.faults_injected holds",
        "FaultRule": "one rule of a script's faults",
        "PolicyScript": "a script, for a user who builds one in Python (docs/guides/scripted-policy.md)",
        "PolicyState": "what a running server says about itself",
        "RequestRecord": "what PolicyServer.requests holds",
        "ServeOptions": "the options of serve(), for a caller that builds them",
    },
    "http": {"Service": "what a server on rollcage.http's loop implements (the proxy, the forwarder)"},
    "procs": {"ProcessTree": "the type of a process tree procs hands out"},
    "protocol": {
        "RESERVED_REQUEST_FIELDS": "the fields SamplingParams.extra_body may not set (its description says)",
        "CheckpointSettings": "the type of WorkerInput.checkpoint",
        "ErrorKind": "the type of RunnerError.kind",
        "TokenField": "the names of a call's token arrays, as artifacts spell them",
    },
    "supervisor": {
        "SandboxConfig": "the type of SupervisorConfig.sandbox (bwrap | none)",
        "stop_templates": "stops the warm templates a process started: for an embedding program's shutdown",
    },
    "tools": {
        "BridgedTools": "the bridged tools an executor offers, for a caller of make_executor",
        "CellStatus": "the type of CellResult.status",
        "ShellResult": "what ShellSession.run returns",
    },
    "viewer": {
        "CaptureComparison": "what compare_capture returns",
        "CaptureDifference": "one difference it holds",
        "ViewTarget": "what resolve_target returns",
    },
}
"""The documented public names nobody in this repository imports (see :func:`_imported_from_faces`)."""


def _faces() -> dict[str, list[str]]:
    """Each room that is a package, and the names its face's ``__all__`` offers."""
    faces: dict[str, list[str]] = {}
    for init in sorted(SRC.glob("*/__init__.py")):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
            ):
                faces[init.parent.name] = list(ast.literal_eval(node.value))
    return faces


def _code_to_read() -> Iterator[tuple[str | None, str]]:
    """Every piece of Python that may use a face: each module with the room it belongs to (``None``
    outside ``src``), and the Python blocks of the docs and the README."""
    for base in ("src", "tests", "bench", "examples", "scripts"):
        for path in sorted((REPO / base).rglob("*.py")):
            room = None
            if base == "src":
                parts = path.relative_to(SRC).parts
                room = parts[0] if len(parts) > 1 else None
            yield room, path.read_text(encoding="utf-8")
    for page in [*sorted((REPO / "docs").rglob("*.md")), REPO / "README.md"]:
        for block in re.findall(r"```(?:python|py)\n(.*?)```", page.read_text(encoding="utf-8"), re.DOTALL):
            yield None, block


def _imported_from_faces() -> set[tuple[str, str]]:
    """``(room, name)`` for each name some code outside the room takes from the room's face:
    ``from rollcage.ROOM import NAME``, ``rollcage.ROOM.NAME``, or a docs page naming it
    (``::: rollcage.ROOM.NAME``, ``rollcage:config rollcage.ROOM:NAME``)."""
    used: set[tuple[str, str]] = set()
    for own, text in _code_to_read():
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue  # a docs block that is a fragment, not a program
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                parts = node.module.split(".")
                if len(parts) == 2 and parts[0] == "rollcage" and parts[1] != own:
                    used.update((parts[1], alias.name) for alias in node.names)
            elif isinstance(node, ast.Attribute):
                named = re.fullmatch(r"rollcage\.(\w+)\.(\w+)", ast.unparse(node))
                if named and named[1] != own:
                    used.add((named[1], named[2]))
    for page in sorted((REPO / "docs").rglob("*.md")):
        used.update(re.findall(r"rollcage\.(\w+)[.:](\w+)", page.read_text(encoding="utf-8")))
    return used


def test_every_name_a_face_offers_is_used_outside_its_room_or_listed_as_public_api() -> None:
    # A face is what other rooms and users may depend on: a name there that nobody takes is a
    # promise kept for no one, and one more thing to read before the room's real entry points.
    used = _imported_from_faces()
    unused, stale = [], []
    for room, names in _faces().items():
        listed = PUBLIC_API.get(room, {})
        unused += [
            f"rollcage.{room}.{name}" for name in names if (room, name) not in used and name not in listed
        ]
        stale += [
            f"PUBLIC_API[{room!r}][{name!r}]" for name in listed if name not in names or (room, name) in used
        ]
    assert unused == []
    assert stale == []


# --- process lifecycle and tasks, in their rooms --------------------------------------------------

_REAP_ANY = frozenset({"os.wait", "os.wait3", "os.wait4"})
"""Calls that reap whichever child ended first: only the process that forked every child may."""

FORK_SERVERS: dict[str, str] = {}
"""Programs of their own allowed to reap any child, each with why (none: the fork servers reap through
``rollcage.procs``' ``reap_children``, loaded by path)."""

_STOPS = frozenset({"kill", "terminate", "send_signal"})
_SPAWNS = frozenset({"subprocess.Popen", "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell"})

UNOWNED_STOPS: dict[str, str] = {}
"""Modules allowed to stop a process they spawned by hand, each with why (none: procs stops them all)."""


def _spawned(tree: ast.Module) -> set[str]:
    """The expressions (``proc``, ``self._process``) a module binds to a process it spawned, as text,
    followed through plain and tuple assignments."""
    bound: set[str] = set()
    assigns = [node for node in ast.walk(tree) if isinstance(node, ast.Assign | ast.AnnAssign)]
    grew = True
    while grew:
        grew = False
        for node in assigns:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            pairs: list[tuple[ast.expr, ast.expr | None]] = []
            for target in targets:
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
                    pairs += list(zip(target.elts, value.elts, strict=False))
                else:
                    pairs.append((target, value))
            for target, source in pairs:
                if source is None:
                    continue
                call = source.value if isinstance(source, ast.Await) else source
                spawns = isinstance(call, ast.Call) and ast.unparse(call.func) in _SPAWNS
                name = ast.unparse(target)
                if (spawns or ast.unparse(source) in bound) and name not in bound:
                    bound.add(name)
                    grew = True
    return bound


def test_only_procs_reaps_whichever_child_ended() -> None:
    # os.wait3 and its kin reap a child the caller may not own (the procs table's, a tool's):
    # that child's owner then waits for a PID that is gone, or reused.
    callers, listed = [], set()
    for module, tree in _trees():
        if _room(module) == "procs":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in _REAP_ANY:
                if module in FORK_SERVERS:
                    listed.add(module)
                else:
                    callers.append(f"{module}:{node.lineno}: {ast.unparse(node.func)}")
    assert callers == []
    assert sorted(set(FORK_SERVERS) - listed) == []  # a listed module that no longer does it leaves the list


def test_only_procs_stops_a_process_it_spawned_by_hand() -> None:
    # Popen.kill and its kin signal one PID and leave the group, the grace and the wait to the
    # caller; procs stops the whole tree, shielded, SIGTERM then SIGKILL, and always waits.
    stops, listed = [], set()
    for module, tree in _trees():
        if _room(module) == "procs":
            continue
        spawned = _spawned(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in _STOPS
                and ast.unparse(node.func.value) in spawned
            ):
                if module in UNOWNED_STOPS:
                    listed.add(module)
                else:
                    stops.append(f"{module}:{node.lineno}: {ast.unparse(node.func)}()")
    assert stops == []
    assert sorted(set(UNOWNED_STOPS) - listed) == []  # a listed module that no longer does it leaves the list


_WAIT_FOR_SPEAKERS: dict[str, str] = {}


def test_asyncio_wait_for_is_spoken_only_by_the_cancellation_dialect() -> None:
    # A timeout is procs.within (quiet) or asyncio.timeout (raising), the pair trio offers.
    # asyncio.wait_for wraps its work in a task of its own, and before 3.12 could swallow a
    # cancellation that arrived as the work finished.
    speakers, listed = [], set()
    for module, tree in _trees():
        if _room(module) == "procs":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "asyncio.wait_for":
                if module in _WAIT_FOR_SPEAKERS:
                    listed.add(module)
                else:
                    speakers.append(f"{module}:{node.lineno}")
    assert speakers == []
    assert sorted(set(_WAIT_FOR_SPEAKERS) - listed) == []


def test_no_task_is_created_without_an_owner() -> None:
    # A task nobody keeps is cancelled by nobody, its exception read by nobody, and the garbage
    # collector may drop it mid-flight. A TaskGroup's create_task is owned by the group.
    orphans = [
        f"{module}:{node.lineno}: {ast.unparse(node.value.func)}"
        for module, tree in _trees()
        if _room(module) != "procs"
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and (
            ast.unparse(node.value.func) in ("asyncio.create_task", "asyncio.ensure_future")
            or (
                isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "create_task"
                and "loop" in ast.unparse(node.value.func.value)
            )
        )
    ]
    assert orphans == []


# --- what the templates' heaps hold -------------------------------------------------------------


def test_importing_the_warm_template_builds_no_pydantic_model() -> None:
    # Every warm worker is forked from the template's heap. Building a pydantic model at import
    # loads pydantic's plugin loader (importlib.metadata, the email package, zipfile: ~40 modules)
    # into it; the models the template imports are built on first use (defer_build).
    done = subprocess.run(
        [sys.executable, "-I", "-B", "-c", "import sys, rollcage.warm; print(sorted(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    loaded = set(ast.literal_eval(done.stdout.strip()))
    assert "rollcage.warm" in loaded  # the listing is what it claims to be
    assert sorted(loaded & {"pydantic.plugin._loader", "importlib.metadata"}) == []
