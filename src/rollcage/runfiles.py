"""A run directory's own files, and the two rules every verb that reads or writes beside them keeps.

The layout ``rollcage run`` makes::

    RUN/rollouts.jsonl          one record per finished attempt (the evidence)
    RUN/metrics.json            the run's aggregates
    RUN/.lock                   held while a controller runs
    RUN/rollouts/<rollout_id>/  each attempt's artifacts
    RUN/interrupted/            attempts a killed run left unfinished

**Reading.** A record's rollout directory is ``RUN/rollouts/<rollout_id>``, found
by the id, inside the run. The ``rollout_dir`` field a record carries says where
the attempt ran (absolute, or relative to the controller's working directory):
a moved run makes it stale, a copied run makes it name the *original's*
artifacts, and an edited record can make it name any directory at all, so it is
never followed. ``locate_rollout`` says when a record named somewhere else
(``RolloutLocation.relocated``), so readers can tell the user; it refuses ids
that are not a plain file name (``..``, ``/``, NUL) and rollout directories that
are symbolic links (they could lead out of the run).

**Writing.** ``check_output`` is asked before a verb writes a file or a
directory of its own (``export``, ``report``). It refuses, with a
``ConfigError`` naming the path:

* anything that is not what the verb publishes in place: a device, FIFO or
  socket (publication renames over the path, which would put a plain file where
  a device node was), a directory where a file is meant or a file where a
  directory is meant;
* a symbolic link, whatever it points at: renaming over it replaces the link,
  writing through it writes wherever it leads, and neither is what a user who
  named the link meant;
* any path that is, or resolves (through links in its parents) to, the run's own
  records and artifacts (``RUN_OWN_NAMES`` at the top of the run, and anything
  under ``rollouts/`` or ``interrupted/``), the run directory itself, or a
  directory that contains the run (a directory output replaces its target whole).

Outputs elsewhere in the run directory (the default ``RUN/export/``,
``RUN/report.html``) are allowed. The checks are made before writing; the
writing itself is atomic (``rollcage.durable``), so a failure leaves nothing.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollcage.errors import ConfigError
from rollcage.protocol import RolloutRecord

__all__ = [
    "ROLLOUTS_DIR",
    "RUN_OWN_NAMES",
    "RolloutLayout",
    "RolloutLocation",
    "check_output",
    "file_name_problem",
    "locate_rollout",
]

ROLLOUTS_DIR = "rollouts"
"""The run's directory of rollout directories, one per attempt, named by rollout id."""

RUN_OWN_NAMES = frozenset({"rollouts.jsonl", "metrics.json", ".lock", ROLLOUTS_DIR, "interrupted"})
"""Names at the top of a run directory that belong to the run: no verb's output lands on or under them."""

_RUN_OWN_DIRS = frozenset({ROLLOUTS_DIR, "interrupted"})
_NAME_MAX = 255
"""The longest file name (bytes) Linux file systems take."""


@dataclass(frozen=True, slots=True)
class RolloutLocation:
    """Where a record's rollout directory is, inside its run."""

    directory: Path | None
    """``RUN/rollouts/<rollout_id>``; ``None`` when refused (``problem`` says why)."""
    problem: str | None = None
    """Why the record's artifacts are not read at all, in words."""
    relocated: bool = False
    """The record's ``rollout_dir`` names another directory (a moved or copied run, or an edited record)."""


def file_name_problem(name: str, *, suffix: str = "") -> str | None:
    """Why ``name`` (plus ``suffix``) cannot be used as one file name in a directory; ``None`` if it can.

    Ids come from datasets and records a user or an older version wrote, and
    become file names (a rollout directory, an exported ``<id>.json``): only a
    single, non-empty path component that encodes as UTF-8 within the file
    system's name limit is taken.
    """
    if not name:
        return "is empty"
    if name in (".", ".."):
        return f"is {name!r}"
    if "/" in name or "\0" in name:
        return "contains '/' or NUL"
    try:
        size = len((name + suffix).encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if size > _NAME_MAX:
        return f"is longer than a file name may be ({size} bytes, at most {_NAME_MAX})"
    return None


def locate_rollout(run_dir: Path, record: RolloutRecord) -> RolloutLocation:
    """The record's rollout directory inside ``run_dir``: ``RUN/rollouts/<rollout_id>``, never elsewhere.

    The directory is not required to exist (a reader reports what is missing);
    it is refused when the id is not one plain file name or when it, or
    ``RUN/rollouts``, is a symbolic link. Blocking (it looks at the file system).
    """
    problem = file_name_problem(record.rollout_id)
    if problem is not None:
        return RolloutLocation(
            None, f"rollout id {record.rollout_id!r} {problem}; its artifacts are not read"
        )
    rollouts = run_dir / ROLLOUTS_DIR
    directory = rollouts / record.rollout_id
    for path in (rollouts, directory):
        if path.is_symlink():
            return RolloutLocation(
                None, f"{path} is a symbolic link; rollout directories are read only inside the run"
            )
    return RolloutLocation(directory, relocated=not _names(record.rollout_dir, directory, record.rollout_id))


def _names(recorded: str, directory: Path, rollout_id: str) -> bool:
    """Whether the recorded ``rollout_dir`` names ``directory`` (as a run that was never moved writes it)."""
    path = Path(recorded)
    if ".." in path.parts or path.parts[-2:] != (ROLLOUTS_DIR, rollout_id):
        return False
    if not path.is_absolute():
        return True  # relative to the controller's working directory: only its shape can be checked
    try:
        return os.path.samestat(os.stat(path), os.stat(directory))
    except (OSError, ValueError):
        return False  # the recorded place is gone (a moved run) or unreadable: not this directory


def check_output(target: Path, *, run_dir: Path, kind: Literal["file", "directory"], what: str) -> None:
    """Refuse an output path a verb must not write (see the module docstring); blocking.

    Args:
        target: The file or directory the verb is about to publish.
        run_dir: The run the verb reads.
        kind: ``file``: ``target`` is replaced by one regular file; ``directory``:
            by one directory.
        what: The output in words, for messages (``the export``, ``the report``).

    Raises:
        ConfigError: ``target`` may not be written; the message names it and why.
    """
    _check_overlap(target, run_dir, what)
    try:
        mode: int | None = os.lstat(target).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None  # a parent that is no directory is named below
    except OSError as exc:
        raise ConfigError(f"cannot write {what} to {target}: {exc.strerror or exc}") from exc
    if mode is not None:
        if stat.S_ISLNK(mode):
            raise ConfigError(
                f"{target} is a symbolic link; {what} never writes through or over a link: "
                "give the path it should write"
            )
        if kind == "file" and stat.S_ISDIR(mode):
            raise ConfigError(f"{target} is a directory; give {what} a file name inside it")
        if kind == "file" and not stat.S_ISREG(mode):
            raise ConfigError(f"{target} exists and is a {_kind(mode)}; {what} replaces only a regular file")
        if kind == "directory" and not stat.S_ISDIR(mode):
            raise ConfigError(
                f"{target} exists and is a {_kind(mode)}, not a directory; {what} is a directory"
            )
    _check_ancestor(target, what)


def _check_ancestor(target: Path, what: str) -> None:
    """The nearest existing ancestor of ``target`` must be a directory (else nothing can be made there)."""
    parent = target.absolute().parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{parent} is not a directory; cannot write {what} to {target}")


def _check_overlap(target: Path, run_dir: Path, what: str) -> None:
    real_target = Path(os.path.realpath(target))
    real_run = Path(os.path.realpath(run_dir))
    if real_target == real_run or real_target in real_run.parents:
        raise ConfigError(
            f"{target} is or contains the run directory {run_dir}; {what} would replace the run: "
            "give a path outside it"
        )
    if real_run in real_target.parents:
        first = real_target.relative_to(real_run).parts[0]
        if first in RUN_OWN_NAMES:
            raise ConfigError(
                f"{target} is the run's own {first}{'/' if first in _RUN_OWN_DIRS else ''} (in {run_dir}); "
                f"{what} never writes over a run's records or artifacts: "
                "give a path outside them"
            )


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISREG, "regular file"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    )
    return next((name for test, name in kinds if test(mode)), "special file")


@dataclass(frozen=True)
class RolloutLayout:
    """Where one rollout's files live on the host (the sandbox's view: :mod:`rollcage.supervisor.sandbox`).

    Attributes:
        root: The rollout directory ``R``.
        proxy_socket: The egress proxy's socket on the host; ``None`` without a proxy.
        view: Where the worker's view (its ``input.json`` and ``/rollout``) is staged: the
            supervisor's private directory; ``None``: the staging area in ``R``.
    """

    root: Path
    proxy_socket: Path | None = None
    view: Path | None = None

    @property
    def input(self) -> Path:
        """The controller's ``input.json`` (never visible in the sandbox)."""
        return self.root / "input.json"

    @property
    def staging(self) -> Path:
        """The supervisor's staging area, removed at the end."""
        return self.root / ".sandbox"

    @property
    def token(self) -> Path:
        """This rollout's supervision token, for finding its processes after a supervisor died."""
        return self.staging / "token"

    @property
    def worker_input(self) -> Path:
        """The input as rewritten for the worker's view."""
        return (self.view or self.staging) / "input.json"

    @property
    def worker_root(self) -> Path:
        """The writable directory mounted as ``/rollout`` (bwrap only)."""
        return (self.view or self.staging) / "root"

    @property
    def workspace(self) -> Path:
        """The agent's working directory."""
        return self.root / "workspace"

    @property
    def checkpoint(self) -> Path:
        """The checkpoint journal."""
        return self.root / "checkpoint.jsonl"

    @property
    def resume_journal(self) -> Path:
        """An earlier attempt's journal the controller copied in to be resumed from (may not exist)."""
        return self.root / "resume.jsonl"

    @property
    def result(self) -> Path:
        """Where ``result.json`` ends up."""
        return self.root / "result.json"

    @property
    def receipt(self) -> Path:
        """``receipt.json``, written last."""
        return self.root / "receipt.json"

    @property
    def capture(self) -> Path:
        """The egress proxy's ``model_capture.jsonl``."""
        return self.root / "model_capture.jsonl"

    @property
    def log(self) -> Path:
        """The worker's stdout and stderr."""
        return self.root / "worker.log"

    @property
    def stop(self) -> Path:
        """The external stop file."""
        return self.root / "stop"
