"""The executor's cage inside the worker's: where the trust boundary inside a rollout runs.

Why a cage inside the cage
==========================

The worker is rollcage's code; the cells it runs are the agent's. Both run in
the rollout's sandbox, but they must not be equals there: if agent code could
write the worker's journal, staging area or result, attach to the worker
(``ptrace``, ``/proc/<pid>/mem``, ``/proc/<pid>/fd``) or signal it, it could
forge the evidence, or kill its own worker and turn a bad rollout into an
``infra_failure`` (retried and never graded: reward laundering). The options:

* ``PR_SET_DUMPABLE=0`` on the worker stops ``ptrace`` and ``/proc/<pid>/mem``
  but not a signal or a write to a file of the same uid;
* journal and result through descriptors inherited from the supervisor stop the
  writes but not a signal, and change the worker's file protocol;
* the executor under a second unprivileged uid needs a two-uid map made by the
  root supervisor (``newuidmap`` or ``--userns FD``) and a privileged helper to
  start every executor: root-only, and heavy;
* **the executor in a sandbox of its own, made by the worker inside its own
  (a nested bubblewrap): chosen.** The executor gets a new PID namespace (the
  worker's processes are not in it: nothing to signal, trace or open in
  ``/proc``), a new mount namespace in which the worker's files are covered by
  an empty tmpfs (only the workspace, ``/tmp`` and ``/dev/shm`` stay reachable),
  no network, and no way to make user namespaces of its own
  (``--disable-userns``), so it cannot undo any of this. It works as root or
  not, costs one ``bwrap`` start (milliseconds) per executor start, and the
  worker keeps full control: it sees and signals the executor's processes, the
  executor cannot see it.

The worker's own cage must then allow exactly one more user namespace (made by
the worker, trusted code); every cage that holds agent code has
``--disable-userns``.

Interrupting a cell sends SIGINT to the executor's process group, which also
holds the nested bwrap's monitor: killed by SIGINT, it would take the executor
down with it. So the monitor never takes SIGINT: by default the prefix starts it
through ``sh`` with SIGINT ignored (an ignored signal stays ignored across
``exec``), and the executor sets its own handler. A caller that starts the
prefix with SIGINT *blocked* instead (a blocked signal stays blocked across
``exec``, and is only held pending) asks for the prefix without ``sh``
(``ignore_sigint=False``), a process start less, and its program unblocks SIGINT
once its handler is in place: the ``repl`` executor does (:mod:`rollcage.tools._repl`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from rollcage.cage._bwrap import which
from rollcage.errors import SandboxError

__all__ = ["CAGE_ENV", "NestedCage", "nested_prefix"]

CAGE_ENV = "ROLLCAGE_EXECUTOR_CAGE"
"""Set by the supervisor in the worker's environment: ``bwrap`` (or ``bwrap:PATH``, the program as the
worker sees it) cages the executor (see the module docstring); unset or ``none``: the executor shares
the worker's sandbox (or the host, uncontained)."""

_IGNORE_SIGINT = 'trap "" INT; exec "$@"'


@dataclass(frozen=True)
class NestedCage:
    """How the worker cages its executor.

    Attributes:
        bwrap: The bwrap program, as the worker sees it.
        workspace: The directory the executor works in (kept writable).
        hide: Directories covered by an empty tmpfs (the worker's staging area, journal and proxy
            socket); the workspace is bound back inside them.
        share_net: Keep the worker's network namespace (only loopback, where the worker serves a
            harness's model endpoint); otherwise the cage has none of its own but loopback, unused.
    """

    bwrap: str
    workspace: str
    hide: tuple[str, ...]
    share_net: bool = False

    @classmethod
    def from_environment(
        cls, *, workspace: str, worker_paths: Iterable[str], share_net: bool = False
    ) -> NestedCage | None:
        """The executor's cage when the supervisor asked for one (:data:`CAGE_ENV`), else ``None``.

        Args:
            workspace: The executor's working directory.
            worker_paths: Files only the worker may touch (input, journal, result, proxy socket):
                their directories are hidden.
            share_net: See :attr:`share_net` (a harness reaching the worker's loopback forwarder).

        Raises:
            SandboxError: A cage was asked for and bwrap cannot be found, or a path to hide is ``/``.
        """
        mode = os.environ.get(CAGE_ENV, "none")
        if mode == "none":
            return None
        kind, _, program = mode.partition(":")
        if kind != "bwrap":
            raise SandboxError(f"{CAGE_ENV}={mode!r}: expected 'bwrap', 'bwrap:PATH' or 'none'")
        bwrap = program or which("bwrap")
        if bwrap is None:
            raise SandboxError(f"{CAGE_ENV}=bwrap but bwrap is not visible in the worker's sandbox")
        hide = sorted({os.path.dirname(os.path.abspath(path)) for path in worker_paths})
        if "/" in hide:
            raise SandboxError(f"cannot hide the worker's files from the executor: {worker_paths!r} are in /")
        return cls(bwrap=bwrap, workspace=os.path.abspath(workspace), hide=tuple(hide), share_net=share_net)

    def prefix(self, *, ignore_sigint: bool = True, new_session: bool = False) -> list[str]:
        """The argv prefix that runs a command in the executor's cage (working directory: the workspace).

        Args:
            ignore_sigint: Start bwrap through ``sh`` with SIGINT ignored; ``False`` for a caller that
                starts the prefix with SIGINT blocked (see the module docstring).
            new_session: Start the command in a session (and process group) of its own (``bwrap
                --new-session``), so that a signal to its group never reaches the cage's monitor: the
                ``bash`` tool's shell, which takes SIGINT itself (:mod:`rollcage.tools._shell`).
        """
        return nested_prefix(self, ignore_sigint=ignore_sigint, new_session=new_session)


# jupyter_client's parent-PID watch: in the cage the kernel's parent is the namespace's init (PID 1),
# which ipykernel takes for "my parent died" and exits.
_UNSET = ("JPY_PARENT_PID",)


def nested_prefix(cage: NestedCage, *, ignore_sigint: bool = True, new_session: bool = False) -> list[str]:
    """The command-line prefix for ``cage`` (see :class:`NestedCage`; pure)."""
    hides: list[str] = []
    sealed: list[str] = []
    for path in cage.hide:
        hides += ["--perms", "0755", "--tmpfs", path]
        # Read-only once the workspace is bound inside: nothing can even pretend to be written there.
        sealed += ["--remount-ro", path]
    unset: list[str] = []
    for name in _UNSET:
        unset += ["--unsetenv", name]
    wrapper = ["/bin/sh", "-c", _IGNORE_SIGINT, "rollcage-executor"] if ignore_sigint else []
    return [
        *wrapper,
        cage.bwrap,
        "--unshare-user",
        "--disable-userns",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        *([] if cage.share_net else ["--unshare-net"]),
        "--die-with-parent",
        # The worker's view, read-only, then the worker's own files covered.
        "--ro-bind",
        "/",
        "/",
        *hides,
        "--bind",
        cage.workspace,
        cage.workspace,
        *sealed,
        "--bind",
        "/tmp",
        "/tmp",
        "--proc",
        "/proc",
        # The worker's /dev again, usable (the read-only copy above has nodev): its device nodes and
        # its bounded /dev/shm, writable as the worker has it; the directory itself is read-only (root's
        # as root, remounted read-only without root: rollcage.cage._bwrap), so nothing can be made in
        # it. A fresh --dev would cost a tmpfs, a devpts and six binds more.
        "--dev-bind",
        "/dev",
        "/dev",
        "--chdir",
        cage.workspace,
        *unset,
        *(["--new-session"] if new_session else []),
        "--",
    ]
